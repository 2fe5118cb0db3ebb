#!/usr/bin/env bash
# The test suite under another CPython than CI's (python3, 3.11 on the machines CI runs on): run it under each
# release requires-python admits after using something they differ in (argparse's help, tracing and where a Ctrl-C
# lands, locals(), a deprecation, an error's wording). CI does not run it: a run takes as long as CI's suite.
#
# It builds a fresh virtual environment outside the checkout, in PYTHONS_VENV (default /tmp/wsarena-<python's
# name>, about 2.5 GB, the cuDNN wheel most of it), with ${PYTHON:-python3.12}; installs the package editable, its
# dependencies and the test extra's, at the newest releases their ranges admit; prints the Python and PyTorch it
# got, then runs `python -m pytest -q -p no:randomly` from the checkout (arguments, where given, replace
# `-q -p no:randomly`). The exit status is pytest's.
# A PYTHONS_VENV already there is removed first, where it is a virtual environment (a pyvenv.cfg in it); else it is
# refused, exit 2, and left as it is (a folder named by mistake, $HOME).
# PyTorch comes first, as in floors.sh: PYTHONS_TORCH names its requirement or wheel file (default the test extra's
# torch==2.13.0, which pip finds as a CPU build for CPython 3.11 only on the machines CI runs on; for another
# CPython it resolves a CUDA build of several GB, whose tests run on the CPU all the same). PYTHONS_TORCH=none leaves
# PyTorch out: its tests then skip, each module with importorskip's reason, and the rest runs as without it.
# On 2 cores: the build 2 to 3 minutes with the wheels in pip's cache (PyTorch's CUDA build 2 more, and 5 GB), the
# suite as long as CI's.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3.12}
VENV=${PYTHONS_VENV:-/tmp/wsarena-$(basename "$PYTHON")}
TORCH=${PYTHONS_TORCH:-torch==2.13.0}
# shellcheck source=tools/_venv.sh
. "$ROOT/tools/_venv.sh"
fresh_venv PYTHONS_VENV "$PYTHON"
# pyproject.toml's runtime dependencies and test extra, less torch (installed first, or not at all)
mapfile -t REQUIREMENTS < <("$VENV/bin/python" - "$ROOT/pyproject.toml" <<'EOF'
import re
import sys
import tomllib

with open(sys.argv[1], "rb") as file:
    project = tomllib.load(file)["project"]
for requirement in project["dependencies"] + project["optional-dependencies"]["test"]:
    if re.match(r"[A-Za-z0-9_.-]+", requirement)[0].lower() != "torch":
        print(requirement)
EOF
)
if [ "$TORCH" != none ]; then "$VENV/bin/python" -m pip install --quiet "$TORCH"; fi
"$VENV/bin/python" -m pip install --quiet --no-deps -e "$ROOT"
"$VENV/bin/python" -m pip install --quiet "${REQUIREMENTS[@]}"
"$VENV/bin/python" - <<'EOF'
import platform
from importlib.metadata import PackageNotFoundError, version

try:
    torch = version("torch")
except PackageNotFoundError:
    torch = "not installed: its tests skip"
print(f"{platform.python_implementation()} {platform.python_version()}, torch {torch}")
EOF
run_tests "$@"
