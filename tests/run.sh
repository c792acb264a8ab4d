#!/usr/bin/env bash
# The test command (README): makes or reuses a virtual environment, installs from the
# package registries what the tests need, and runs the whole suite. Extra arguments go to
# pytest. TRITON_ACCEL_VENV picks the environment's folder (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${TRITON_ACCEL_VENV:-.venv}
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r tests/requirements.txt

report_dir=$(mktemp -d)
trap 'rm -rf "$report_dir"' EXIT
report=$report_dir/junit.xml
set +e
"$venv/bin/python" -m pytest -ra --junitxml="$report" "$@"
rc=$?
set -e
if [ "$rc" -ne 0 ]; then
    exit "$rc"
fi
# A green run in which nothing actually ran (everything skipped or deselected) is a failure:
# it would hide a broken suite behind an exit code of 0.
"$venv/bin/python" - "$report" <<'PY'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
total = sum(int(s.get("tests", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
if total - skipped <= 0:
    sys.exit(f"no test ran ({total} collected, {skipped} skipped)")
print(f"tests run: {total - skipped}, skipped: {skipped}")
PY
