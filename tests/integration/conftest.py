"""Integration harness: a real ComfyUI server in a subprocess with this pack installed.

ComfyUI is found through the environment variable COMFYUI_PATH (a ComfyUI checkout whose
requirements are installed in the Python running pytest, or in COMFYUI_PYTHON). Without it
every test here is skipped with the reason shown by `pytest -rs`.

One server per test session (module `comfy` fixture is session-scoped):
- base directory: a fresh temporary folder (`--base-directory`), so models, custom_nodes,
  input, output, temp and user data all live there; the ComfyUI checkout is never written to
  (the database goes to the temporary folder too, through --database-url);
- custom_nodes/comfyui-triton-accel: a symlink to this repository (a folder name with dashes
  on purpose: the pack must not depend on its folder name);
- custom_nodes/triton_accel_testnodes: a copy of tests/integration/testnodes (test-only nodes);
- models/diffusion_models: tiny random-weight models written by make_tiny_models.py through
  ComfyUI's own model classes (cached between sessions, see TRITON_ACCEL_IT_CACHE);
- environment: TRITON_INTERPRET=1, so a forced Triton path runs our kernels on the CPU
  through the interpreter; COMFYUI_EXTRA_PYTHONPATH is put first on PYTHONPATH (an older
  ComfyUI's frontend packages, for instance);
- flags: --cpu --cache-none (every prompt re-executes, so call counters are per prompt);
  working directory: the temporary folder (0.29 writes comfyui_detail.log into its cwd).

Environment variables: COMFYUI_PATH (required), COMFYUI_PYTHON (default: this Python),
COMFYUI_EXTRA_PYTHONPATH, TRITON_ACCEL_IT_CACHE (model cache; default
~/.cache/triton-accel-integration), TRITON_ACCEL_IT_REPORT (folder for JSON reports of what the
attention override received; default: the session's temporary folder), COMFYUI_START_TIMEOUT
(seconds, default 180), COMFYUI_PROMPT_TIMEOUT (seconds, default 600).
"""
from __future__ import annotations

import hashlib
import json
import re
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PACK_FOLDER_NAME = "comfyui-triton-accel"
TESTNODES_FOLDER_NAME = "triton_accel_testnodes"
# pytest runs with --import-mode=importlib (pyproject.toml): make the helper module importable.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

SKIP_REASON = ("COMFYUI_PATH is not set: the integration tests need a ComfyUI checkout "
               "(see tests/integration/README.md)")


def pytest_collection_modifyitems(config, items):
    skip = None if os.environ.get("COMFYUI_PATH") else pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.integration)
            if skip is not None:
                item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _SERVER is not None and HERE in Path(str(item.fspath)).resolve().parents:
        report.sections.append(("ComfyUI server log (tail)", _SERVER.log_tail(120)))


class PromptError(RuntimeError):
    """ComfyUI rejected a prompt or its execution failed; the message carries the details."""


class ComfyServer:
    def __init__(self, comfy_path: Path, base_dir: Path, python: str, env: dict):
        self.comfy_path = comfy_path
        self.base_dir = base_dir
        self.python = python
        self.env = env
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = base_dir / "comfyui.log"
        self.client_id = uuid.uuid4().hex
        self.proc = None
        self._log_file = None

    # ---- process ----------------------------------------------------------------------
    def start(self, timeout: float):
        cmd = [self.python, str(self.comfy_path / "main.py"), "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
               "--disable-auto-launch", "--base-directory", str(self.base_dir),
               "--database-url", f"sqlite:///{self.base_dir / 'user' / 'comfyui.db'}",
               "--cache-none"]
        (self.base_dir / "user").mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "wb")
        # cwd is the temporary base folder: ComfyUI 0.29 writes comfyui_detail.log into its cwd.
        self.proc = subprocess.Popen(cmd, cwd=self.base_dir, env=self.env, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with code {self.proc.returncode} while starting:\n"
                                   f"{self.log_tail(80)}")
            try:
                with urllib.request.urlopen(self.url + "/system_stats", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"ComfyUI did not answer within {timeout:.0f}s:\n{self.log_tail(80)}")

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        if self._log_file is not None:
            self._log_file.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    # ---- HTTP -------------------------------------------------------------------------
    def request(self, method: str, path: str, body=None, timeout: float = 30):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if raw else None)
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = raw.decode(errors="replace")
            return e.code, payload

    def get_json(self, path: str):
        status, payload = self.request("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path} -> HTTP {status}: {payload}")
        return payload

    def post_json(self, path: str, body=None):
        status, payload = self.request("POST", path, body if body is not None else {})
        if status != 200:
            raise RuntimeError(f"POST {path} -> HTTP {status}: {payload}")
        return payload

    def object_info(self, node: str | None = None) -> dict:
        return self.get_json("/object_info" + (f"/{node}" if node else ""))

    def queue_prompt(self, prompt: dict) -> str:
        status, payload = self.request("POST", "/prompt", {"prompt": prompt, "client_id": self.client_id})
        if status != 200 or not isinstance(payload, dict) or "prompt_id" not in payload:
            raise PromptError(f"ComfyUI rejected the prompt (HTTP {status}):\n"
                              f"{json.dumps(payload, indent=1)[:6000]}")
        if payload.get("node_errors"):
            raise PromptError(f"ComfyUI reported node errors:\n{json.dumps(payload['node_errors'], indent=1)}")
        return payload["prompt_id"]

    def wait(self, prompt_id: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PromptError(f"ComfyUI died (code {self.proc.returncode}) while running {prompt_id}:\n"
                                  f"{self.log_tail(80)}")
            history = self.get_json(f"/history/{prompt_id}")
            entry = history.get(prompt_id) if isinstance(history, dict) else None
            if entry:
                status = entry.get("status") or {}
                if status.get("status_str") == "error":
                    raise PromptError("execution failed:\n" + _execution_error(status))
                if status.get("completed", False) or status.get("status_str") == "success":
                    return entry
            time.sleep(0.2)
        raise PromptError(f"prompt {prompt_id} did not finish within {timeout:.0f}s")

    def run(self, prompt: dict, timeout: float | None = None) -> dict:
        """Queue a prompt, wait for it, return its history entry (raises PromptError)."""
        timeout = timeout or float(os.environ.get("COMFYUI_PROMPT_TIMEOUT", "600"))
        return self.wait(self.queue_prompt(prompt), timeout)

    def output_file(self, file_info: dict) -> Path:
        root = {"output": "output", "temp": "temp", "input": "input"}[file_info.get("type", "output")]
        return self.base_dir / root / file_info.get("subfolder", "") / file_info["filename"]

    # ---- this pack's stats ------------------------------------------------------------
    def stats(self) -> dict:
        return self.get_json("/triton_accel/stats")

    def reset_stats(self):
        self.post_json("/triton_accel/stats/reset")

    def spy(self) -> dict:
        return self.get_json("/triton_accel_test/spy")

    def reset_spy(self):
        self.post_json("/triton_accel_test/spy/reset")


def _execution_error(status: dict) -> str:
    lines = []
    for kind, data in status.get("messages", []):
        if kind in ("execution_error", "execution_interrupted"):
            lines.append(f"{kind}: node {data.get('node_id')} ({data.get('node_type')}): "
                         f"{data.get('exception_type')}: {data.get('exception_message')}")
            tb = data.get("traceback")
            if tb:
                lines.append("".join(tb) if isinstance(tb, list) else str(tb))
    return "\n".join(lines) or json.dumps(status)[:4000]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _comfy_version(comfy_path: Path) -> str:
    try:
        text = (comfy_path / "comfyui_version.py").read_text()
    except OSError:
        return "unknown"
    # Read, never executed: the Comfy Registry's security check rejects exec in a pack.
    found = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", text)
    return found.group(1) if found else "unknown"


def _server_env() -> dict:
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env.pop("COMFYUI_PATH", None)
    extra = os.environ.get("COMFYUI_EXTRA_PYTHONPATH")
    if extra:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _tiny_models(comfy_path: Path, python: str, env: dict) -> tuple[Path, list[dict]]:
    """Make (or reuse from the cache) the tiny models for this ComfyUI version."""
    script = HERE / "make_tiny_models.py"
    key = hashlib.sha1(script.read_bytes()).hexdigest()[:12]
    cache_root = Path(os.environ.get("TRITON_ACCEL_IT_CACHE",
                                     Path.home() / ".cache" / "triton-accel-integration"))
    folder = cache_root / f"comfyui-{_comfy_version(comfy_path)}-{key}"
    manifest = folder / "manifest.jsonl"
    if not manifest.exists():
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        proc = subprocess.run([python, str(script), str(tmp)], cwd=comfy_path, env=env,
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"make_tiny_models.py failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-6000:]}")
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        (tmp / "manifest.jsonl").write_text("\n".join(lines) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    return folder, [json.loads(ln) for ln in manifest.read_text().splitlines() if ln.strip()]


_SERVER: ComfyServer | None = None


@pytest.fixture(scope="session")
def comfy(tmp_path_factory):
    """The running ComfyUI server (ComfyServer), shared by the whole session."""
    global _SERVER
    comfy_path = os.environ.get("COMFYUI_PATH")
    if not comfy_path:
        pytest.skip(SKIP_REASON)
    comfy_path = Path(comfy_path).resolve()
    if not (comfy_path / "main.py").exists():
        pytest.fail(f"COMFYUI_PATH={comfy_path} has no main.py")
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    env = _server_env()

    base = tmp_path_factory.mktemp("comfyui-base")
    # Inductor's caches (precompiled headers among them) are keyed by path, not by torch
    # version: one shared with another torch on this machine gave C++ errors (at::vec undeclared).
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(base / "inductor-cache"))
    custom_nodes = base / "custom_nodes"
    custom_nodes.mkdir()
    os.symlink(REPO, custom_nodes / PACK_FOLDER_NAME, target_is_directory=True)
    shutil.copytree(HERE / "testnodes", custom_nodes / TESTNODES_FOLDER_NAME,
                    ignore=shutil.ignore_patterns("__pycache__"))

    models_folder, manifest = _tiny_models(comfy_path, python, env)
    target = base / "models" / "diffusion_models"
    target.mkdir(parents=True)
    for entry in manifest:
        os.symlink(models_folder / entry["file"], target / entry["file"])

    server = ComfyServer(comfy_path, base, python, env)
    server.version = _comfy_version(comfy_path)
    server.models = {e["family"]: e for e in manifest}
    server.report_dir = Path(os.environ.get("TRITON_ACCEL_IT_REPORT", base / "report"))
    server.report_dir.mkdir(parents=True, exist_ok=True)
    _SERVER = server
    try:
        server.start(float(os.environ.get("COMFYUI_START_TIMEOUT", "180")))
        yield server
    finally:
        server.stop()
        _SERVER = None
        print(f"\n[integration] ComfyUI {server.version} log: {server.log_path}")
