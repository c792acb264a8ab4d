"""install.py's implementation, one module per job.

install.py loads this folder by path as a package under a private name (the pack's own
package name is whatever folder ComfyUI Manager cloned it into, and nothing of the pack is
importable when install.py runs), so the modules import each other relatively and use the
standard library only.

common   the pack folder, kernels/core/gpu_rules.py and kernels/core/install_config.py (loaded by
         path), shared names and text helpers
pe       the PE file version reader (VC++ runtime DLLs)
model    the data: Facts, Finding, Action, Target, Blocker, Plan, Options, Check, Result
probe    gathers Facts, torch and triton only in a subprocess of the target Python
target   which Triton package and version fit the installed torch
checks   the pure plan(facts, options) and its one check per subject
actions  runs the actions, the self-check subprocess and the verdict
cli      flags, output, --json, the --venv/--demo bootstrap
"""
