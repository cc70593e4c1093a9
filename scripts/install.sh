#!/usr/bin/env bash
# One-command install: creates .venv in the repository root with Python >= 3.12,
# torch==2.13.0 (installed first and pinned), megatron-core==0.19.2, the test tools, and
# dhelix itself (editable, its bytecode compiled). Re-running is cheap: pip skips what is
# already there.
#
# Python: $PYTHON if set, else the first of python3.13, python3.12, python3 on PATH whose
# version is >= 3.12, else a pyenv-installed one (`pyenv root`, or $PYENV_ROOT / ~/.pyenv
# when pyenv is not on PATH; 3.12.x first, the tested version, then newer ones).
# A .venv made with an older Python (e.g. 3.11) is recreated.
set -euo pipefail
cd "$(dirname "$0")/.."
MIN_PY="3.12"

# Prints "X.Y" for a working interpreter whose version is >= MIN_PY; nothing otherwise.
py_ok() {
    "$1" -c 'import sys; v = sys.version_info
if v >= (3, 12): print(f"{v.major}.{v.minor}")' 2>/dev/null
}

find_python() {
    local c
    if [ -n "${PYTHON:-}" ]; then
        if [ -n "$(py_ok "$PYTHON")" ]; then echo "$PYTHON"; return 0; fi
        echo "error: PYTHON=$PYTHON is not a Python >= $MIN_PY; unset PYTHON or point it at one" >&2
        return 1
    fi
    for c in python3.13 python3.12 python3; do
        if command -v "$c" >/dev/null 2>&1 && [ -n "$(py_ok "$c")" ]; then
            command -v "$c"; return 0
        fi
    done
    local root="${PYENV_ROOT:-$HOME/.pyenv}"
    if command -v pyenv >/dev/null 2>&1; then root="$(pyenv root)"; fi
    if [ -d "$root/versions" ]; then
        # 3.12 (the tested version) first, then newer ones, newest first
        for c in $(ls -d "$root"/versions/3.12.* 2>/dev/null | sort -t. -k3,3nr) \
                 $(ls -d "$root"/versions/3.* 2>/dev/null | sort -t. -k2,2nr -k3,3nr); do
            if [ -x "$c/bin/python" ] && [ -n "$(py_ok "$c/bin/python")" ]; then
                echo "$c/bin/python"; return 0
            fi
        done
    fi
    echo "error: no Python >= $MIN_PY found (tried \$PYTHON, python3.13, python3.12, python3 on PATH, pyenv versions); install Python 3.12 (e.g. 'pyenv install 3.12' or 'apt install python3.12-venv') and re-run, or set PYTHON=/path/to/python3.12" >&2
    return 1
}

PY="$(find_python)"
if [ -x .venv/bin/python ] && [ -z "$(py_ok .venv/bin/python)" ]; then
    echo "install.sh: .venv uses $(.venv/bin/python -c 'import sys; print("Python %d.%d" % sys.version_info[:2])' 2>/dev/null || echo 'a broken Python'); dhelix needs >= $MIN_PY: recreating it with $PY"
    rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --disable-pip-version-check "torch==2.13.0"
$PIP install -q --disable-pip-version-check -r requirements.txt
$PIP install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
# The project's own bytecode, once: pip compiles what it installs, but not an editable
# project, and where PYTHONDONTWRITEBYTECODE is set every process (each rank of every
# launch) would compile these sources again (~0.4 s a process).
.venv/bin/python -m compileall -q -j 0 dhelix megatron_patches planner profiler scripts tests >/dev/null
.venv/bin/dhelix env --short
