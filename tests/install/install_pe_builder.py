"""Builds minimal PE images (DOS header, PE header, one .rsrc section) for the DLL version
reader tests that must run without network. The layout follows the PE/COFF spec; the real
DLL tests (msvc-runtime wheel) check the same reader against files Microsoft built."""
import struct

RT_VERSION = 16
RT_MANIFEST = 24


def version_block(version):
    ms = (version[0] << 16) | version[1]
    ls = (version[2] << 16) | version[3]
    key = "VS_VERSION_INFO\0".encode("utf-16-le")
    head_len = 6 + len(key)
    pad = (-head_len) % 4
    fixed = struct.pack("<13I", 0xFEEF04BD, 0x10000, ms, ls, ms, ls, 0x3F, 0, 0x40004, 2, 0, 0, 0)
    body = key + b"\0" * pad + fixed
    return struct.pack("<HHH", 6 + len(body), len(fixed), 0) + body


def resource_section(section_rva, type_id=RT_VERSION, version=(14, 44, 35211, 0), block=None):
    def directory(entry_id, target):
        return struct.pack("<IIHHHH", 0, 0, 0, 0, 0, 1) + struct.pack("<II", entry_id, target)

    root = directory(type_id, 0x80000000 | 0x18)
    names = directory(1, 0x80000000 | 0x30)
    langs = directory(0x409, 0x48)
    block = version_block(version) if block is None else block
    entry = struct.pack("<IIII", section_rva + 0x58, len(block), 0, 0)
    out = root + names + langs + entry
    out += b"\0" * (0x58 - len(out)) + block
    return out


def build_pe(version=(14, 44, 35211, 0), pe32plus=True, type_id=RT_VERSION, with_rsrc=True, block=None):
    section_rva, raw_ptr = 0x1000, 0x200
    rsrc = resource_section(section_rva, type_id, version, block) if with_rsrc else b"\0" * 16
    raw_size = (len(rsrc) + 0x1FF) & ~0x1FF
    if pe32plus:
        magic, n_dirs_off, dirs_off = 0x20B, 108, 112
    else:
        magic, n_dirs_off, dirs_off = 0x10B, 92, 96
    opt = bytearray(dirs_off + 16 * 8)
    struct.pack_into("<H", opt, 0, magic)
    struct.pack_into("<I", opt, n_dirs_off, 16)
    if with_rsrc:
        struct.pack_into("<II", opt, dirs_off + 2 * 8, section_rva, len(rsrc))
    coff = struct.pack("<HHIIIHH", 0x8664 if pe32plus else 0x14C, 1, 0, 0, 0, len(opt), 0x2022)
    section = struct.pack("<8sIIIIIIHHI", b".rsrc", len(rsrc), section_rva, raw_size, raw_ptr, 0, 0, 0, 0, 0x40000040)
    dos = bytearray(0x80)
    dos[0:2] = b"MZ"
    struct.pack_into("<I", dos, 0x3C, 0x80)
    head = bytes(dos) + b"PE\0\0" + coff + bytes(opt) + section
    assert len(head) <= raw_ptr
    return head + b"\0" * (raw_ptr - len(head)) + rsrc + b"\0" * (raw_size - len(rsrc))
