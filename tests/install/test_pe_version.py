"""The pure-Python DLL file version reader: real VC++ runtime DLLs from a PyPI wheel, and
built images for the error cases (truncated, not PE, no version resource)."""
import struct

import pytest

from install_helpers import wheel_member
from install_pe_builder import RT_MANIFEST, build_pe


def signature_scan(data: bytes):
    """Independent cross-check: find the VS_FIXEDFILEINFO signature and decode after it."""
    i = data.index(struct.pack("<I", 0xFEEF04BD))
    ms, ls = struct.unpack_from("<II", data, i + 8)
    return (ms >> 16, ms & 0xFFFF, ls >> 16, ls & 0xFFFF)


@pytest.mark.parametrize("dll", ["msvcp140.dll", "vcruntime140.dll", "vcruntime140_1.dll"])
@pytest.mark.parametrize("package_version", ["14.51.36231", "14.40.33807"])
def test_real_vcrt_dll_versions(inst, msvc_wheels, package_version, dll):
    wheel, expected = msvc_wheels[package_version]
    data = wheel_member(wheel, dll)
    assert inst.pe_file_version(data) == expected
    assert signature_scan(data) == expected


def test_real_dll_versions_against_the_minimum(inst, msvc_wheels):
    new = inst.pe_file_version(wheel_member(msvc_wheels["14.51.36231"][0], "vcruntime140.dll"))
    old = inst.pe_file_version(wheel_member(msvc_wheels["14.40.33807"][0], "vcruntime140.dll"))
    assert new[:2] >= inst.VCRT_MIN > old[:2]


def test_real_pe_without_version_resource(inst, msvc_wheels):
    # The wheel's own extension module has resources (a manifest) but no RT_VERSION.
    data = wheel_member(msvc_wheels["14.51.36231"][0], "msvc_runtime.cp312-win_amd64.pyd")
    with pytest.raises(inst.PEError, match=r"no version resource \(RT_VERSION\)"):
        inst.pe_file_version(data)


def test_real_dll_truncated(inst, msvc_wheels):
    data = wheel_member(msvc_wheels["14.51.36231"][0], "vcruntime140.dll")
    sig = data.index(struct.pack("<I", 0xFEEF04BD))  # inside the version resource
    for cut in (1, 63, 200, 400, sig - 40, sig + 10):
        with pytest.raises(inst.PEError, match="truncated file|not a PE file"):
            inst.pe_file_version(data[:cut])


def test_read_file_version_from_disk(inst, msvc_wheels, tmp_path):
    wheel, expected = msvc_wheels["14.51.36231"]
    path = tmp_path / "vcruntime140.dll"
    path.write_bytes(wheel_member(wheel, "vcruntime140.dll"))
    assert inst.read_file_version(str(path)) == expected


@pytest.mark.parametrize("pe32plus", [True, False], ids=["pe32plus", "pe32"])
def test_built_image(inst, pe32plus):
    assert inst.pe_file_version(build_pe((14, 44, 35211, 0), pe32plus=pe32plus)) == (14, 44, 35211, 0)
    assert inst.pe_file_version(build_pe((1, 2, 3, 4), pe32plus=pe32plus)) == (1, 2, 3, 4)


@pytest.mark.parametrize("data, match", [
    (b"", r"^not a PE file: only 0 bytes$"),
    (b"MZ" + b"\0" * 10, r"^not a PE file: only 12 bytes$"),
    (b"hello world, this is a text file and certainly not a DLL, really!!", r"^not a PE file: no 'MZ' DOS header$"),
    (b"\x7fELF" + b"\0" * 100, r"^not a PE file: no 'MZ' DOS header$"),
    (b"MZ" + b"\0" * 58 + struct.pack("<I", 0x40) + b"NE\0\0" + b"\0" * 60,
     r"^not a PE file: no 'PE' signature \(a DOS-only executable\?\)$"),
    (b"MZ" + b"\0" * 58 + struct.pack("<I", 0x10000) + b"\0" * 4,
     r"^truncated file: PE header offset 65536 is past the end \(68 bytes\)$"),
], ids=["empty", "tiny", "text", "elf", "ne-not-pe", "lfanew-past-end"])
def test_not_pe(inst, data, match):
    with pytest.raises(inst.PEError, match=match):
        inst.pe_file_version(data)


def test_built_truncated_everywhere(inst):
    data = build_pe()
    for cut in range(0, len(data) - 0x180, 7):
        with pytest.raises(inst.PEError):
            inst.pe_file_version(data[:cut])


def test_no_resource_directory(inst):
    with pytest.raises(inst.PEError, match=r"^no version resource: the image has no resource directory$"):
        inst.pe_file_version(build_pe(with_rsrc=False))


def test_resources_without_version(inst):
    with pytest.raises(inst.PEError, match=r"^no version resource \(RT_VERSION\) in the resource directory$"):
        inst.pe_file_version(build_pe(type_id=RT_MANIFEST))


def test_version_resource_of_wrong_kind(inst):
    with pytest.raises(inst.PEError, match="not a VS_VERSIONINFO block"):
        inst.pe_file_version(build_pe(block=b"\0" * 92))


def test_bad_fixedfileinfo_signature(inst):
    block = bytearray(build_pe())
    sig = struct.pack("<I", 0xFEEF04BD)
    i = block.index(sig)
    block[i:i + 4] = b"\0\0\0\0"
    with pytest.raises(inst.PEError, match="bad VS_FIXEDFILEINFO signature 0x00000000"):
        inst.pe_file_version(bytes(block))


def test_bad_optional_header_magic(inst):
    data = bytearray(build_pe())
    struct.pack_into("<H", data, 0x80 + 24, 0x1234)
    with pytest.raises(inst.PEError, match="unknown optional header magic 0x1234"):
        inst.pe_file_version(bytes(data))


def test_read_file_version_errors_name_the_file(inst, tmp_path):
    missing = tmp_path / "nope.dll"
    with pytest.raises(inst.PEError, match="nope.dll: cannot read"):
        inst.read_file_version(str(missing))
    text = tmp_path / "vcruntime140.dll"
    text.write_text("not a dll at all, just some text that is long enough to pass the size check!")
    with pytest.raises(inst.PEError, match=r"vcruntime140.dll: not a PE file: no 'MZ' DOS header"):
        inst.read_file_version(str(text))
