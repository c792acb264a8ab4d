"""triton_accel.json: the per-machine settings install.py writes, read and checked.

Standard library only, and loaded by file path by both of its readers: the pack's top-level
``__init__.py`` (before anything imports torch or triton: TRITON_CACHE_DIR only counts when it
is set before triton's first import, and importing the ``kernels`` package imports triton) and
``install.py`` (which runs before the pack is importable). The file can be edited by hand, so
every value is checked; a bad one is ignored with a reason and never raised, because a typo in
it must not stop ComfyUI from loading the pack nor install.py from reporting.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Dict, List, MutableMapping, NamedTuple, Optional, Tuple

CONFIG_NAME = "triton_accel.json"
# The keys the pack reads (docs/install.md): folder to use as TRITON_CACHE_DIR, applied only
# when the user has not set TRITON_CACHE_DIR.
KEY_CACHE_DIR = "triton_cache_dir"
# Linux pseudo-filesystems: a cache there cannot hold files (or would write into a device).
PSEUDO_FS_ROOTS = ("/proc", "/sys", "/dev")

log = logging.getLogger("triton_accel")
JSON_KINDS = ((bool, "a boolean"), (str, "a string"), (int, "a number"), (float, "a number"), (list, "an array"),
              (dict, "an object"), (type(None), "null"))


class InstallConfig(NamedTuple):
    path: str
    values: Dict[str, str]  # the known keys whose values passed their checks
    problems: List[str]  # one sentence per thing ignored (the whole file, or one key), naming the file


def json_kind(value: object) -> str:
    """'a number', 'an array', ...: what the JSON file holds, in JSON's words (bool before int:
    True is an int in Python)."""
    return next((name for kind, name in JSON_KINDS if isinstance(value, kind)), type(value).__name__)


def config_path(pack_dir: str) -> str:
    return os.path.join(pack_dir, CONFIG_NAME)


def read_json_object(path: str) -> Tuple[dict, Optional[str]]:
    """The file's top-level JSON object, or ({}, why it cannot be used). No file: ({}, None)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return {}, None
    except RecursionError:  # json's decoder recurses once per nesting level
        return {}, "is nested too deeply to read"
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or bad UTF-8
        return {}, f"is unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(data, dict):
        return {}, f"is not a JSON object (it holds {json_kind(data)})"
    return data, None


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def cache_dir_problem(value: object) -> Optional[str]:
    """Why `value` cannot be the Triton cache folder, or None. Non-strings are named by their
    JSON kind only: repr() of a deeply nested value would itself recurse too deep."""
    if not isinstance(value, str):
        return f"is {json_kind(value)}, not a folder path"
    if not value.strip():
        return "is empty"
    if "\x00" in value:
        return "contains a NUL character"
    if not os.path.isabs(value):
        return f"{value!r} is not an absolute path"
    try:
        candidates = {os.path.normpath(value), os.path.realpath(value)}
        if os.name != "nt":
            for root in PSEUDO_FS_ROOTS:
                if any(c == root or c.startswith(root + "/") for c in candidates):
                    return f"{value!r} is under {root}, a pseudo-filesystem that cannot hold a cache"
        if os.path.exists(value) and not os.path.isdir(value):
            return f"{value!r} is a file, not a folder"
        parent = _nearest_existing(value)
        if not os.path.isdir(parent):
            return f"{value!r} cannot be created: {parent!r} is a file, not a folder"
        if not os.access(parent, os.W_OK):
            return f"{value!r} is not writable ({parent!r} is read-only)"
    except (OSError, ValueError) as exc:  # a path the OS refuses outright (too long, bad characters)
        return f"{value!r} is not a usable path ({type(exc).__name__}: {exc})"
    return None


def load(pack_dir: str) -> InstallConfig:
    """The config next to install.py, checked: valid values, and a reason for each ignored one."""
    path = config_path(pack_dir)
    data, problem = read_json_object(path)
    problems = [f"{path} {problem}"] if problem else []
    values: Dict[str, str] = {}
    if KEY_CACHE_DIR in data:
        why = cache_dir_problem(data[KEY_CACHE_DIR])
        if why is None:
            values[KEY_CACHE_DIR] = data[KEY_CACHE_DIR]
        else:
            problems.append(f"{KEY_CACHE_DIR} in {path} {why}")
    return InstallConfig(path, values, problems)


def apply_cache_dir(pack_dir: str, environ: MutableMapping[str, str] = os.environ) -> Optional[str]:
    """Set TRITON_CACHE_DIR from the config unless the user set it; log one warning per ignored
    value. Returns the folder it set, or None."""
    config = load(pack_dir)
    for problem in config.problems:
        log.warning("Triton Accel: ignoring a setting install.py left: %s", problem)
    cache_dir = config.values.get(KEY_CACHE_DIR)
    if cache_dir is None or environ.get("TRITON_CACHE_DIR"):
        return None
    environ["TRITON_CACHE_DIR"] = cache_dir
    return cache_dir


__all__ = ["CONFIG_NAME", "KEY_CACHE_DIR", "InstallConfig", "config_path", "read_json_object", "cache_dir_problem",
           "load", "apply_cache_dir"]
