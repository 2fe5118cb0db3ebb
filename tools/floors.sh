#!/usr/bin/env bash
# The test suite against the floors: every dependency pyproject.toml declares, the runtime ones and the test
# extra's, at the lowest release its range admits (uv's --resolution lowest-direct); what those pull in comes at
# the newest release they allow. CI does not run it (.ci/run tests the newest releases); run it after changing a
# range in pyproject.toml or using something a floor may lack.
#
# It builds a fresh virtual environment outside the checkout, in FLOORS_VENV (default /tmp/wsarena-floors; about
# 2.5 GB, the cuDNN wheel most of it), with ${PYTHON:-python3.11}, the lowest Python requires-python admits;
# installs uv there with pip; prints the versions it got, then runs `python -m pytest -q -p no:randomly` from the
# checkout (arguments, where given, replace `-q -p no:randomly`). The exit status is pytest's.
# A FLOORS_VENV already there is removed first, where it is a virtual environment (a pyvenv.cfg in it); else it is
# refused, exit 2, and left as it is (a folder named by mistake, $HOME).
# torch comes first, through pip as this machine has it set up, which finds the test extra's 2.13.0 as a CPU
# build (README, Requirements); uv keeps it, where it would otherwise resolve a CUDA build of several GB.
# FLOORS_TORCH names another requirement or wheel file for it.
# On 2 cores: 5 to 8 minutes (4m40s on an idle machine), the build 20 seconds of them with the wheels in uv's cache
# (a first build downloads about 3 GB), the suite the rest.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${FLOORS_VENV:-/tmp/wsarena-floors}
# shellcheck source=tools/_venv.sh
. "$ROOT/tools/_venv.sh"
fresh_venv FLOORS_VENV "${PYTHON:-python3.11}"
"$VENV/bin/python" -m pip install --quiet "${FLOORS_TORCH:-torch==2.13.0}" uv
"$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" --resolution lowest-direct -e "$ROOT[test]"
"$VENV/bin/python" - <<'EOF'
import re
from importlib.metadata import requires, version

names = sorted({re.match(r"[A-Za-z0-9_.-]+", r)[0] for r in requires("wsarena") or []}, key=str.lower)
print("floors:", ", ".join(f"{name} {version(name)}" for name in names))
EOF
run_tests "$@"
