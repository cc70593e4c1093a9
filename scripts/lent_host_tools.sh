# Sourced by the scripts that run on a lent machine (scripts/lent_gpu_checks.sh,
# scripts/bench_emulated_gpu.sh): makes `ip`/`tc` and megatron-core available there.
#   - no `ip`/`tc` on PATH: unpacks the Debian .deb files under .debs/ (iproute2 and its
#     libraries, docs/benchmark.md) into /tmp/iproute2 and puts them on PATH / LD_LIBRARY_PATH;
#     NEED_IPROUTE=1 makes their absence an error, else the caller goes on without them;
#   - `$PY -c "import megatron.core"` fails and a wheel is under .whl/: installs it into
#     /tmp/site and puts that on PYTHONPATH. The repository root is on PYTHONPATH either way.
# Expects $PY (the Python to use) and the repository root as the working directory.
# Returns 2 (from `source`) when a required tool cannot be provided.
if ! command -v tc >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1; then
    if ls .debs/*.deb >/dev/null 2>&1; then
        mkdir -p /tmp/iproute2
        for deb in .debs/*.deb; do dpkg -x "$deb" /tmp/iproute2 || return 2; done
        export PATH=/tmp/iproute2/usr/sbin:/tmp/iproute2/sbin:/tmp/iproute2/usr/bin:/tmp/iproute2/bin:$PATH
        export LD_LIBRARY_PATH=/tmp/iproute2/usr/lib/x86_64-linux-gnu:/tmp/iproute2/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        ip -V >/dev/null || return 2
    elif [ -n "${NEED_IPROUTE:-}" ]; then
        echo "error: no ip/tc and no .debs/*.deb to unpack them from (docs/benchmark.md)" >&2
        return 2
    fi
fi
if ! $PY -c "import megatron.core" >/dev/null 2>&1 && ls .whl/megatron_core-*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/megatron_core-*.whl || return 2
    export PYTHONPATH=/tmp/site:.${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
fi
