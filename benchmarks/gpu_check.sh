#!/usr/bin/env bash
# The GPU issue's device check in one command, on a CUDA machine with no network (torch >= 2.11,
# Triton >= 3.6, pytest already installed there), from the repository root:
#
#     bash benchmarks/gpu_check.sh            # logs and JSON go to $OUT (default /tmp/dsnorm-gpu)
#
# Peers that are not installed there travel as wheels in .whl/ (pip download --no-deps ...): they
# are installed into /tmp/site first. Then, each step under its own time limit so that one slow
# step cannot take the others' time:
#   1. dsnorm itself is installed (no index, no build isolation: the lower bound torch 2.11 is
#      what the machine has; where its setuptools is older than pyproject's build requirement, 77,
#      which pip does not check without build isolation, the checks run from the source tree
#      instead) and imported;
#   2. tests/test_cuda.py: the compiled kernels against the reference (bits, ulps, gradients,
#      torch.compile, CUDA graphs, the fusions);
#   3. benchmarks/gpu.py --quick --no-compile: copy bandwidth, the M x N sweep with the launcher's
#      forward and backward, fwd+bwd through autograd, decode latency under a CUDA graph;
#   4. dsnorm bench --device cuda: the DeepSeek sites against the reference, torch.compile, Liger,
#      F.rms_norm and the torch.add floor, decode also replayed from CUDA graphs;
#   5. dsnorm bench --device cuda --backward --cases train: forward + backward at training shapes;
#   6. benchmarks/gpu_configs.py: the launch-configuration sweep behind the heuristics;
#   7. benchmarks/gpu_host_profile.py: the host's share of an eager call (dsnorm against Liger);
#   8. benchmarks/gpu_decode.py: decode latency taken apart (dsnorm's kernel, the same with an
#      approximate rstd, variants with the same bits by other instructions, Liger; with
#      BASELINE=path/to/kernels.py also another revision's kernel).
# On an H200 (2026-11-30) the steps took 4 + 5 + 83 + 34 + 74 + 30 + 37 + 17 s, and the whole
# command 296 s with the wheels' install and nvidia-smi (before step 8). The limits below add up to 525 s, inside
# the device tool's 600 s a command with room for the unlimited parts (nvidia-smi, the wheels);
# the sweep prints each row as it is measured, so a sweep cut short by its limit still leaves its
# first rows. JSON results are written outside $OUT and packed into one archive in $OUT after each
# step (the device tool brings back at most 8 files: 6 logs and the archive), so a run cut short
# keeps what it measured. The exit status is the number of steps that failed.
set -u
OUT=${OUT:-/tmp/dsnorm-gpu}
JSON=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
failed=0
step() {  # step SECONDS LOG COMMAND...: run with a time limit, log to $OUT/LOG, count failures
    local limit=$1 log=$2
    shift 2
    echo "=== $* (limit ${limit}s)" | tee -a "$OUT/$log"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$log"
    local rc=${PIPESTATUS[0]}
    echo "=== rc=$rc after $((SECONDS - t0))s" | tee -a "$OUT/$log"
    [ "$rc" = 0 ] || failed=$((failed + 1))
    if ls "$JSON"/*.json >/dev/null 2>&1; then
        tar czf "$OUT/results-json.tgz" -C "$JSON" .
    fi
}

{
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
    python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/tests.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        2>&1 | tee -a "$OUT/tests.txt"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if python3 -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" 2>/dev/null; then
    step 30 tests.txt python3 -m pip install -q --no-index --no-deps --no-build-isolation .
else
    echo "setuptools < 77 here (pyproject's build requirement): running from the source tree" | tee -a "$OUT/tests.txt"
fi
# Should the install fail (it counts as a failed step), the checks still run from the source tree.
python3 -c "import dsnorm" 2>/dev/null || export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
step 15 tests.txt python3 -c "import dsnorm, torch; print('dsnorm', dsnorm.__version__, 'imported; cuda initialised:', torch.cuda.is_initialized())"
step 115 tests.txt python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
step 60 gpu.txt python3 benchmarks/gpu.py --quick --no-compile --json "$JSON/gpu.json"
step 95 bench.txt python3 -m dsnorm.cli bench --device cuda --json "$JSON/bench.json"
step 45 bwd.txt python3 -m dsnorm.cli bench --device cuda --backward --cases train --json "$JSON/bwd.json"
step 55 configs.txt python3 benchmarks/gpu_configs.py
step 25 configs.txt python3 benchmarks/gpu_host_profile.py
step 85 decode.txt python3 benchmarks/gpu_decode.py ${BASELINE:+--baseline "$BASELINE"} --json "$JSON/decode.json"
echo "steps failed: $failed" | tee -a "$OUT/tests.txt"
exit "$failed"
