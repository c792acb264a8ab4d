"""PE file version reader: pure Python, so it works on any OS (the VC++ runtime DLL checks run
and are tested on Linux too)."""
from __future__ import annotations

import struct
from typing import Tuple


class PEError(ValueError):
    """The file is not a PE image, is truncated, or has no version resource."""


RT_VERSION = 16
VS_FIXEDFILEINFO_SIGNATURE = 0xFEEF04BD


def _unpack(fmt: str, data: bytes, offset: int, what: str) -> tuple:
    size = struct.calcsize(fmt)
    if offset < 0 or offset + size > len(data):
        raise PEError(f"truncated file: {what} at offset {offset} needs {size} bytes, file has {len(data)}")
    return struct.unpack_from(fmt, data, offset)


def pe_file_version(data: bytes) -> Tuple[int, int, int, int]:
    """File version (dwFileVersionMS/LS of VS_FIXEDFILEINFO) of a PE image given as bytes.

    DOS header -> PE header -> optional header data directory 2 (resources) -> section
    table (RVA -> file offset) -> resource directory tree type RT_VERSION -> first name ->
    first language -> data entry -> VS_VERSIONINFO -> VS_FIXEDFILEINFO.
    """
    if len(data) < 64:
        raise PEError(f"not a PE file: only {len(data)} bytes")
    if data[:2] != b"MZ":
        raise PEError("not a PE file: no 'MZ' DOS header")
    (e_lfanew,) = _unpack("<I", data, 0x3C, "e_lfanew")
    if data[e_lfanew:e_lfanew + 4] != b"PE\0\0":
        if e_lfanew + 4 > len(data):
            raise PEError(f"truncated file: PE header offset {e_lfanew} is past the end ({len(data)} bytes)")
        raise PEError("not a PE file: no 'PE' signature (a DOS-only executable?)")
    coff = e_lfanew + 4
    _machine, n_sections, _ts, _sym, _nsym, opt_size, _ch = _unpack("<HHIIIHH", data, coff, "COFF header")
    opt = coff + 20
    (magic,) = _unpack("<H", data, opt, "optional header")
    if magic == 0x10B:  # PE32
        n_dirs_off, dirs_off = 92, 96
    elif magic == 0x20B:  # PE32+
        n_dirs_off, dirs_off = 108, 112
    else:
        raise PEError(f"not a PE image: unknown optional header magic 0x{magic:x}")
    (n_dirs,) = _unpack("<I", data, opt + n_dirs_off, "NumberOfRvaAndSizes")
    if n_dirs <= 2:
        raise PEError("no version resource: the image has no resource directory")
    rsrc_rva, rsrc_size = _unpack("<II", data, opt + dirs_off + 2 * 8, "resource data directory")
    if rsrc_rva == 0 or rsrc_size == 0:
        raise PEError("no version resource: the image has no resource directory")

    sections = []
    sec_off = opt + opt_size
    for i in range(n_sections):
        name, vsize, va, raw_size, raw_ptr = _unpack("<8sIIII", data, sec_off + 40 * i, f"section header {i}")
        sections.append((va, max(vsize, raw_size), raw_ptr, raw_size))

    def rva_to_offset(rva: int, what: str) -> int:
        for va, span, raw_ptr, raw_size in sections:
            if va <= rva < va + span:
                delta = rva - va
                if delta >= raw_size:
                    raise PEError(f"{what} (RVA 0x{rva:x}) lies in uninitialised section data")
                return raw_ptr + delta
        raise PEError(f"{what} (RVA 0x{rva:x}) is in no section")

    base = rva_to_offset(rsrc_rva, "resource directory")

    def entries(dir_off: int, what: str):
        _c, _t, _maj, _min, n_named, n_ids = _unpack("<IIHHHH", data, base + dir_off, what)
        if n_named + n_ids > 4096:
            raise PEError(f"corrupt {what}: {n_named + n_ids} entries")
        for k in range(n_named + n_ids):
            yield _unpack("<II", data, base + dir_off + 16 + 8 * k, f"{what} entry {k}")

    version_dir = None
    for name_id, target in entries(0, "resource root directory"):
        if not name_id & 0x80000000 and name_id == RT_VERSION:
            version_dir = target
            break
    if version_dir is None:
        raise PEError("no version resource (RT_VERSION) in the resource directory")
    node, depth = version_dir, 0
    while node & 0x80000000:  # descend name -> language, first entry each time
        depth += 1
        if depth > 4:
            raise PEError("corrupt resource directory: too deep")
        first = next(iter(entries(node & 0x7FFFFFFF, "version resource directory")), None)
        if first is None:
            raise PEError("no version resource: empty RT_VERSION directory")
        node = first[1]
    data_rva, data_size, _cp, _res = _unpack("<IIII", data, base + node, "version resource data entry")
    start = rva_to_offset(data_rva, "version resource data")
    block = data[start:start + data_size]
    if len(block) < data_size:
        raise PEError("truncated file: the version resource runs past the end of the file")
    # VS_VERSIONINFO: wLength, wValueLength, wType, szKey "VS_VERSION_INFO\0" (UTF-16), pad to 4.
    key = "VS_VERSION_INFO\0".encode("utf-16-le")
    if block[6:6 + len(key)] != key:
        raise PEError("no version resource: RT_VERSION data is not a VS_VERSIONINFO block")
    fixed = (6 + len(key) + 3) & ~3
    (wvalue_len,) = _unpack("<H", block, 2, "VS_VERSIONINFO")
    if wvalue_len == 0:
        raise PEError("no version resource: VS_VERSIONINFO has no VS_FIXEDFILEINFO")
    sig, _struc, ms, ls = _unpack("<IIII", block, fixed, "VS_FIXEDFILEINFO")
    if sig != VS_FIXEDFILEINFO_SIGNATURE:
        raise PEError(f"no version resource: bad VS_FIXEDFILEINFO signature 0x{sig:08x}")
    return (ms >> 16, ms & 0xFFFF, ls >> 16, ls & 0xFFFF)


def read_file_version(path: str) -> Tuple[int, int, int, int]:
    """File version of a DLL/EXE on disk; PEError (with the path) for anything unreadable."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise PEError(f"{path}: cannot read: {exc}") from exc
    try:
        return pe_file_version(data)
    except PEError as exc:
        raise PEError(f"{path}: {exc}") from exc
