# Sourced by floors.sh and pythons.sh, whose virtual environment and test run it makes alike. ROOT is the checkout.
#
# fresh_venv VARIABLE PYTHON: make a fresh virtual environment with PYTHON in VENV, which the variable VARIABLE
# named (or its default did); VENV must be outside the checkout. One already there is removed first, where it is a
# virtual environment (a pyvenv.cfg in it); else it is refused, exit 2, and left as it is (a folder named by
# mistake, $HOME). run_tests ARGS...: pytest from the checkout in VENV, with ARGS, or `-q -p no:randomly` where none
# are given; the exit status is pytest's.
fresh_venv() {
    local script
    script=$(basename "$0")
    case "$VENV" in "$ROOT"|"$ROOT"/*) echo "$script: $1 must be outside the checkout" >&2; exit 2;; esac
    # removed before it is built again: only a virtual environment, not a folder named in its place by mistake ($HOME)
    if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ]; then
        echo "$script: $1 $VENV is there and is no virtual environment: it is not removed" >&2; exit 2
    fi
    rm -rf "$VENV"
    "$2" -m venv "$VENV"
}

run_tests() {
    cd "$ROOT"
    if [ $# -eq 0 ]; then set -- -q -p no:randomly; fi
    exec "$VENV/bin/python" -m pytest "$@"
}
