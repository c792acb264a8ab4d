"""install.py's act step and helpers: --fix downloads (fetcher injected, no network), DLL
copies, the config file, running commands, and the small parsers the probe uses."""
import io
import json
import os
import sys
import zipfile

import pytest

from install_helpers import load_install_module
from install_pe_builder import build_pe

inst = load_install_module()


def nupkg(version="3.12.10", extra=(), lib=True, header=True):
    major, minor = version.split(".")[:2]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("python.nuspec", "<package/>")
        if header:
            zf.writestr("tools/include/Python.h", "/* Python.h */\n")
        zf.writestr("tools/include/patchlevel.h", f"#define PY_MAJOR_VERSION {major}\n#define PY_MINOR_VERSION {minor}\n")
        zf.writestr("tools/include/cpython/object.h", "/* nested */\n")
        if lib:
            zf.writestr(f"tools/libs/python{major}{minor}.lib", b"!<arch>\n")
        zf.writestr("tools/python.exe", b"MZ")  # not copied: only include/ and libs/
        for name, data in extra:
            zf.writestr(name, data)
    return buf.getvalue()


class Fetcher:
    def __init__(self, payload):
        self.payload, self.urls = payload, []

    def __call__(self, url):
        self.urls.append(url)
        return self.payload


def test_fix_headers_into_empty_embedded_python(tmp_path):
    fetch = Fetcher(nupkg())
    made = inst.fix_python_headers("3.12.10", str(tmp_path), fetch=fetch, log=lambda s: None)
    assert fetch.urls == ["https://api.nuget.org/v3-flatcontainer/python/3.12.10/python.3.12.10.nupkg"]
    assert sorted(os.path.relpath(p, tmp_path).replace(os.sep, "/") for p in made) == [
        "include/Python.h", "include/cpython/object.h", "include/patchlevel.h", "libs/python312.lib"]
    assert not (tmp_path / "python.exe").exists()
    assert inst._include_minor(str(tmp_path / "include")) == 12


def test_fix_headers_is_idempotent_and_never_overwrites(tmp_path):
    (tmp_path / "libs").mkdir()
    (tmp_path / "libs" / "python312.lib").write_bytes(b"mine")
    inst.fix_python_headers("3.12.10", str(tmp_path), fetch=Fetcher(nupkg()), log=lambda s: None)
    assert (tmp_path / "libs" / "python312.lib").read_bytes() == b"mine"
    assert inst.fix_python_headers("3.12.10", str(tmp_path), fetch=Fetcher(nupkg()), log=lambda s: None) == []


def test_fix_headers_moves_include_of_another_minor_aside(tmp_path):
    inc = tmp_path / "include"
    inc.mkdir()
    (inc / "Python.h").write_text("old")
    (inc / "patchlevel.h").write_text("#define PY_MINOR_VERSION 11\n")
    logs = []
    inst.fix_python_headers("3.12.10", str(tmp_path), fetch=Fetcher(nupkg()), log=logs.append)
    assert (tmp_path / "include.old-3.11" / "Python.h").read_text() == "old"
    assert inst._include_minor(str(inc)) == 12
    assert logs == [f"renamed {inc} (Python 3.11) to {inc}.old-3.11"]


@pytest.mark.parametrize("payload, match", [
    (b"<html>not found</html>", "is not a NuGet package"),
    (nupkg(header=False), "has no tools/include/Python.h"),
    (nupkg(lib=False), "has no tools/libs/python312.lib"),
    (nupkg(extra=[("tools/include/../../evil.txt", "x")]), "refusing unsafe path"),
], ids=["not-zip", "no-header", "no-lib", "zip-slip"])
def test_fix_headers_rejects_bad_packages(tmp_path, payload, match):
    with pytest.raises(RuntimeError, match=match):
        inst.fix_python_headers("3.12.10", str(tmp_path / "py"), fetch=Fetcher(payload), log=lambda s: None)
    assert not (tmp_path / "evil.txt").exists()


def test_act_runs_fix_headers_with_injected_fetcher(tmp_path):
    f = inst.Facts(os="windows", python="python.exe", pack_dir=str(tmp_path))
    p = inst.Plan(None, [], [inst.Action("fix-headers", "headers", data={"version": "3.13.2", "target": str(tmp_path)})],
                  "pytorch", "", True)
    results = inst.act(p, f, quiet=True, log=lambda s: None, fetch=Fetcher(nupkg("3.13.2")))
    assert [(r.ok, r.detail) for r in results] == [(True, "4 files added")]
    assert (tmp_path / "libs" / "python313.lib").exists()


def test_act_reports_a_failed_download_without_crashing(tmp_path):
    def offline(url):
        raise OSError("network unreachable")
    f = inst.Facts(os="windows", python="python.exe", pack_dir=str(tmp_path))
    p = inst.Plan(None, [], [inst.Action("fix-headers", "headers", data={"version": "3.13.2", "target": str(tmp_path)})],
                  "pytorch", "", True)
    results = inst.act(p, f, quiet=True, log=lambda s: None, fetch=offline)
    assert [(r.ok, r.detail) for r in results] == [(False, "OSError: network unreachable")]


def test_copy_vcrt_keeps_old_files(tmp_path):
    src, dst = tmp_path / "System32", tmp_path / "python_embeded"
    src.mkdir()
    dst.mkdir()
    (src / "vcruntime140.dll").write_bytes(build_pe((14, 44, 35211, 0)))
    (dst / "vcruntime140.dll").write_bytes(build_pe((14, 29, 30133, 0)))
    logs = []
    inst.copy_vcrt(str(src), str(dst), ["vcruntime140.dll"], log=logs.append)
    assert inst.read_file_version(str(dst / "vcruntime140.dll")) == (14, 44, 35211, 0)
    assert inst.read_file_version(str(dst / "vcruntime140.dll.old-14.29.30133.0")) == (14, 29, 30133, 0)
    assert logs == [f"kept the old vcruntime140.dll as {dst / 'vcruntime140.dll.old-14.29.30133.0'}"]


def test_write_config_merges_and_is_read_back(tmp_path):
    (tmp_path / inst.CONFIG_NAME).write_text(json.dumps({"other": 1}))
    path = inst.write_config(str(tmp_path), "triton_cache_dir", "/safe/cache")
    assert json.loads(open(path).read()) == {"other": 1, "triton_cache_dir": "/safe/cache"}
    assert inst.read_config(str(tmp_path))["triton_cache_dir"] == "/safe/cache"
    (tmp_path / inst.CONFIG_NAME).write_text("{broken")
    assert inst.read_config(str(tmp_path)) == {}


def test_act_cache_actions(tmp_path):
    safe = tmp_path / "cache" / "triton"
    f = inst.Facts(pack_dir=str(tmp_path), triton_cache_dir="/home/me/.triton/cache", cache_writable=False,
                   torch_version="2.13.0+cpu", installed={"triton": "3.9.0"}, numpy_version="2.3.0",
                   cache_candidates=[{"path": str(safe), "ascii": True, "writable": True}])
    p = inst.plan(f)
    assert [a.kind for a in p.actions] == ["mkdir", "write-config"]
    assert all(r.ok for r in inst.act(p, f, quiet=True, log=lambda s: None))
    assert safe.is_dir()
    assert inst.read_config(str(tmp_path)) == {"triton_cache_dir": str(safe)}
    f.config = inst.read_config(str(tmp_path))
    assert inst.plan(f).actions == []  # idempotent


def _cmd(code):
    return [sys.executable, "-c", code]


def test_act_stops_after_a_failed_pip_step(tmp_path):
    f = inst.Facts(pack_dir=str(tmp_path))
    p = inst.Plan(None, [], [inst.Action("pip", "first", _cmd("print('out of disk'); raise SystemExit(3)")),
                             inst.Action("pip", "second", _cmd("open(r'%s', 'w')" % (tmp_path / 'ran')))],
                  "pytorch", "", True)
    results = inst.act(p, f, quiet=True, log=lambda s: None)
    assert len(results) == 1 and not results[0].ok
    assert results[0].detail.endswith("failed with exit code 3: out of disk")
    assert not (tmp_path / "ran").exists()


def test_preflight_failure_removes_nothing(tmp_path):
    f = inst.Facts(pack_dir=str(tmp_path))
    marker = tmp_path / "uninstalled"
    p = inst.Plan(None, [], [inst.Action("pip", "remove the conflicting plain triton",
                                         _cmd("open(r'%s', 'w')" % marker),
                                         preflight=_cmd("import sys; assert sys.argv[-1] != '{tmp}'; sys.exit(1)")
                                         + ["{tmp}"])], "pytorch", "", True)
    results = inst.act(p, f, quiet=True, log=lambda s: None)
    assert not marker.exists()
    assert not results[0].ok and "so nothing was removed" in results[0].detail


# --- parsers and probe helpers ------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("2.10.0+cu128", (2, 10, 0)), ("3.3.0a0.post11", (3, 3, 0)), ("3.6.0.post26", (3, 6, 0)),
    ("12.8", (12, 8)), ("", ()), (None, ()), ("garbage", ()),
])
def test_parse_version(text, expected):
    assert inst.parse_version(text) == expected


@pytest.mark.parametrize("line, expected", [
    ('triton==3.5.0; platform_system == "Linux" and platform_machine == "x86_64"',
     ("triton", "==3.5.0", 'platform_system == "Linux" and platform_machine == "x86_64"')),
    ("pytorch-triton-rocm (==3.1.0) ; platform_system == 'Linux'",
     ("pytorch-triton-rocm", "==3.1.0", "platform_system == 'Linux'")),
    ("Triton_Windows==3.7.1.post27", ("triton-windows", "==3.7.1.post27", "")),
])
def test_requirement(line, expected):
    assert inst._requirement(line) == expected


@pytest.mark.parametrize("marker, os_name, expected", [
    ('platform_system == "Linux" and platform_machine == "x86_64"', "linux", True),
    ('platform_system == "Linux" and platform_machine == "x86_64"', "windows", False),
    ('platform_system == "Linux" and platform_machine == "aarch64"', "linux", False),
    ('sys_platform == "win32"', "windows", True),
    ('platform_system != "Windows"', "windows", False),
    ('platform_system == "Linux" and python_version < "3.14"', "linux", True),
    ('sys_platform == "darwin" or platform_system == "Linux"', "linux", True),
    ("", "windows", True),
])
def test_marker_applies(marker, os_name, expected):
    assert inst.marker_applies(marker, os_name) is expected


@pytest.mark.parametrize("path, expected", [
    (r"C:\Program Files\NVIDIA GPU Computing Toolkit\CUDA\v11.8", [11, 8]),
    (r"C:\Program Files\NVIDIA GPU Computing Toolkit\CUDA\v12.8" + "\\", [12, 8]),
    ("/usr/local/cuda-12.4", [12, 4]),
])
def test_cuda_version_of(path, expected):
    assert inst.cuda_version_of(path) == expected


def test_cuda_version_from_version_json(tmp_path):
    (tmp_path / "version.json").write_text(json.dumps({"cuda": {"version": "11.8.89"}}))
    assert inst.cuda_version_of(str(tmp_path / "")) == [11, 8]
    assert inst.cuda_version_of(str(tmp_path / "nothing")) is None


def test_python_kind_and_pth(tmp_path):
    emb = tmp_path / "python_embeded"
    emb.mkdir()
    (emb / "python312._pth").write_text("python312.zip\n.\n../ComfyUI\n# comment\nimport site\n")
    kind, pth = inst.detect_python_kind(str(emb), str(emb), str(emb))
    assert (kind, pth) == ("embedded", str(emb / "python312._pth"))
    assert inst.pth_entries(pth) == [str(emb / "python312.zip"), str(emb), str(tmp_path / "ComfyUI")]
    venv = tmp_path / "venv"
    venv.mkdir()
    assert inst.detect_python_kind(str(venv / "bin"), str(venv), "/usr") == ("venv", None)
    conda = tmp_path / "conda"
    (conda / "conda-meta").mkdir(parents=True)
    assert inst.detect_python_kind(str(conda), str(conda), str(conda)) == ("conda", None)
    assert inst.detect_python_kind("/usr/bin", "/usr", "/usr") == ("system", None)


def test_find_shadows(tmp_path):
    comfy, site, other = tmp_path / "ComfyUI", tmp_path / "site-packages", tmp_path / "other"
    for d in (comfy, site / "triton", other / "triton"):
        d.mkdir(parents=True)
    (comfy / "triton.py").write_text("")
    found = inst.find_shadows([str(comfy), str(site), str(other), str(comfy)], [str(site)])
    assert found == [str(comfy / "triton.py"), str(other / "triton")]


def test_dir_writable_leaves_nothing(tmp_path):
    assert inst.dir_writable(str(tmp_path / "a" / "b"))
    assert not (tmp_path / "a").exists()
    assert os.listdir(tmp_path) == []


def test_cache_candidates(tmp_path):
    cands = inst.cache_candidates("windows", r"C:\pack", {"SYSTEMDRIVE": "D:", "PROGRAMDATA": r"C:\ProgramData"})
    assert cands[:2] == [os.path.join(r"C:\pack", ".cache", "triton"), r"D:\triton-accel-cache"]


def test_quoting():
    assert inst.cmdline([r"C:\Program Files\py\python.exe", "-m", "pip", "install", "triton-windows>=3.6,<3.7"]) == \
        r'"C:\Program Files\py\python.exe" -m pip install "triton-windows>=3.6,<3.7"'


def test_probe_this_python():
    """The probe on the interpreter running the tests: a real subprocess, JSON back."""
    f = inst.probe(sys.executable)
    assert f.probe_error is None
    assert tuple(f.python_version) == tuple(sys.version_info[:3])
    assert f.os == "linux" and f.python_kind in ("venv", "system", "conda")
    assert f.pip_available
    p = inst.plan(f)
    assert p.path == "pytorch"  # no GPU on the test machines


def test_probe_of_a_broken_interpreter(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'Fatal Python error: init_fs_encoding' >&2\nexit 1\n")
    fake.chmod(0o755)
    f = inst.probe(str(fake))
    assert f.probe_error == "probe exited with code 1: Fatal Python error: init_fs_encoding"
    assert [x.code for x in inst.plan(f).findings] == ["PROBE_FAILED"]
    missing = inst.probe(str(tmp_path / "nope"))
    assert missing.probe_error.startswith("could not run ")


def test_probe_windows_branch_on_a_simulated_portable(tmp_path, monkeypatch):
    """probe()'s Windows-only steps, run on Linux: a fake python_embeded folder (a symlink to
    this machine's base Python, a ._pth file, libs/, an old vcruntime140.dll), a fake
    System32 with built DLLs, and the env vars that trip Triton."""
    import sysconfig

    base = os.path.realpath(sys.executable)
    tag = "%d%d" % sys.version_info[:2]
    emb = tmp_path / "ComfyUI_windows_portable" / "python_embeded"
    emb.mkdir(parents=True)
    (emb / "python").symlink_to(base)
    (emb / f"python{tag}._pth").write_text(f"python{tag}.zip\n.\n../ComfyUI\nimport site\n")
    (emb / "vcruntime140.dll").write_bytes(build_pe((14, 29, 30133, 0)))
    comfy = tmp_path / "ComfyUI_windows_portable" / "ComfyUI"
    (comfy / "custom_nodes" / "pack").mkdir(parents=True)
    (comfy / "triton.py").write_text("")
    system32 = tmp_path / "Windows" / "System32"
    system32.mkdir(parents=True)
    (system32 / "msvcp140.dll").write_bytes(build_pe((14, 44, 35211, 0)))
    (system32 / "vcruntime140.dll").write_bytes(build_pe((14, 44, 35211, 0)))
    (system32 / "vcruntime140_1.dll").write_bytes(build_pe((14, 44, 35211, 0))[:300])  # truncated
    env = {"SystemRoot": str(tmp_path / "Windows"), "Cuda_Path": r"C:\CUDA\v11.8", "CC": str(tmp_path),
           "TRITON_CACHE_DIR": str(tmp_path / "J\u00fcrgen" / "cache"), "PATH": os.environ.get("PATH", "")}
    monkeypatch.setattr(sys, "platform", "win32")
    f = inst.probe(str(emb / "python"), env=env, pack_dir=str(comfy / "custom_nodes" / "pack"))
    monkeypatch.undo()

    assert f.probe_error is None
    assert (f.os, f.python_kind, f.pth_file) == ("windows", "embedded", str(emb / f"python{tag}._pth"))
    assert f.vcrt_system == {"msvcp140.dll": [14, 44, 35211, 0], "vcruntime140.dll": [14, 44, 35211, 0]}
    assert list(f.vcrt_errors) == [str(system32 / "vcruntime140_1.dll")]
    assert f.vcrt_errors[str(system32 / "vcruntime140_1.dll")] == (
        f"{system32 / 'vcruntime140_1.dll'}: truncated file: section header 0 at offset 392 needs 24 bytes, file has 300")
    assert f.vcrt_python == {"vcruntime140.dll": [14, 29, 30133, 0]}
    assert f.python_lib is None and str(emb) in f.python_lib_dirs
    assert f.python_h == os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    assert (f.cuda_path, f.cuda_path_version) == (r"C:\CUDA\v11.8", [11, 8])
    assert (f.cc, f.cc_is_file) == (str(tmp_path), False)
    assert f.shadows == [str(comfy / "triton.py")]
    assert (f.cache_from_env, f.cache_ascii) == (True, False)
    [cache] = [x for x in inst.plan(f).findings if x.code == "CACHE_NON_ASCII"]
    assert cache.severity == "error" and cache.fix.startswith("Set TRITON_CACHE_DIR to a writable folder")
    assert f.long_paths_enabled is None  # no winreg here: unknown, never a false alarm
    codes = {x.code for x in inst.plan(f).findings}
    assert {"VCRT_SHADOW", "VCRT_UNREADABLE", "PYTHON_LIB_MISSING", "CUDA_PATH_OLD", "CC_NOT_FILE",
            "TRITON_SHADOWED", "CACHE_NON_ASCII"} <= codes


@pytest.mark.parametrize("value, expected", [(0, False), (1, True), (OSError("no such key"), None)],
                         ids=["disabled", "enabled", "missing"])
def test_long_paths_reader_with_a_fake_winreg(monkeypatch, value, expected):
    import types

    class Key:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def query(key, name):
        assert name == "LongPathsEnabled"
        if isinstance(value, Exception):
            raise value
        return value, 4

    opened = []
    fake = types.SimpleNamespace(HKEY_LOCAL_MACHINE="HKLM",
                                 OpenKey=lambda root, path: opened.append((root, path)) or Key(),
                                 QueryValueEx=query)
    monkeypatch.setitem(sys.modules, "winreg", fake)
    assert inst.read_long_paths_enabled() is expected
    assert opened == [("HKLM", r"SYSTEM\CurrentControlSet\Control\FileSystem")]
