#!/usr/bin/env bash
# One-command install on a fresh CPU machine: creates .venv in the repository root with
# torch==2.13.0 (CPU build, installed first so nothing pulls an unpinned CUDA torch),
# megatron-core==0.16.1, the test tools, and dhelix itself (editable).
# Re-running is cheap: pip skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --disable-pip-version-check "torch==2.13.0"
$PIP install -q --disable-pip-version-check -r requirements.txt
$PIP install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
.venv/bin/dhelix env --short
