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
# TRITON_ACCEL_ALL_RELEASES=1 (CI sets it): also the Triton releases 3.2-3.9 users run, each in
# .cache/triton-versions (kept between runs, ~5.8 GB), installed before pytest so that the
# compile tests building under an older release (Gluon with 3.6, Turing with 3.2, ...) run in a
# fresh clone too, and tests/versions, which compiles every kernel under each of them. Without
# it those tests skip, saying which release they need. Never fatal: offline, they skip with the reason.
extra=()
if [ "${TRITON_ACCEL_ALL_RELEASES:-0}" = "1" ]; then
    "$venv/bin/python" tests/versions/version_matrix.py --install-only || echo "Triton release installs failed; the version tests report it"
else
    extra=(--ignore=tests/versions)
fi

report_dir=$(mktemp -d)
trap 'rm -rf "$report_dir"' EXIT
report=$report_dir/junit.xml
set +e
# Test files run in parallel (pytest-xdist), each file in one worker (--dist loadfile: a
# file's module fixtures, e.g. the Triton version matrix, run once): the suite is CPU-bound
# under the Triton interpreter, and a 2-core CI machine halves its time. TEST_WORKERS=0 runs
# it in this process; the default is one worker per core, at most 4 (each holds torch).
workers=${TEST_WORKERS:-$("$venv/bin/python" -c 'import os; print(min(4, max(1, len(os.sched_getaffinity(0)))))')}
"$venv/bin/python" -m pytest -ra -n "$workers" --dist loadfile --junitxml="$report" "${extra[@]}" "$@"
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
