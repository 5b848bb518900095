#!/usr/bin/env bash
# The GPU checks on a lent GPU machine, which has no network: the carried wheels (made here by
# bench/gpu_wheels.py: Ray trimmed, tensordict, ...) go into a scratch directory, then
# bench/gpu_check_real.py and bench/gpu_check.py run, each under a time limit (SIGINT first, so
# the session still shuts Ray down). All they print also goes to $OUT/gpu_check.txt.
#
#   bash bench/gpu_run.sh                 # there, with .cache/gpu_wheels carried
#
# Exit status: 0 when every check passed; 1 when a check failed or a script ran out of time;
# 2 when the wheels did not install. A limit of 0 leaves its check out: REAL_LIMIT
# (gpu_check_real.py), BASIC_LIMIT (gpu_check.py), REALLOC_LIMIT (tests/hybrid/test_reallocate.py
# with its pieces on the GPU: six ranks share it over gloo, through host memory). PYTHON, WHEELS
# and the limits may be set to dry-run it elsewhere; arguments go to gpu_check_real.py (e.g. --cpu).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.cache/gpu_wheels}
OUT=${OUT:-/tmp/gpu_run_out}
REAL_LIMIT=${REAL_LIMIT:-240}
BASIC_LIMIT=${BASIC_LIMIT:-120}
REALLOC_LIMIT=${REALLOC_LIMIT:-120}
LOG="$OUT/gpu_check.txt"
SITE=$(mktemp -d /tmp/gpu_site.XXXXXX)
mkdir -p "$OUT"
: >"$LOG"

"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl 2>&1 |
    tee -a "$LOG" || exit 2
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    "$PYTHON" -c 'import sys, torch, transformers, peft, ray, tensordict, workbench
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      "transformers", transformers.__version__, "peft", peft.__version__, "ray", ray.__version__,
      "tensordict", tensordict.__version__, "workbench", workbench.__file__)'
} 2>&1 | tee -a "$LOG"

status=0
check() {
    local limit=$1
    shift
    echo "== $* (limit ${limit} s)" | tee -a "$LOG"
    local start=$SECONDS
    timeout -s INT -k 30 "$limit" "$PYTHON" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "== exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
    [ "$rc" = 0 ] || status=1
}
[ "$REAL_LIMIT" = 0 ] || check "$REAL_LIMIT" bench/gpu_check_real.py "$@"
# -o addopts=: the project's addopts name nbval, which that machine lacks
export WORKBENCH_TEST_DEVICE=cuda  # read by that test alone
[ "$REALLOC_LIMIT" = 0 ] || check "$REALLOC_LIMIT" -m pytest -o addopts= -p no:cacheprovider -q tests/hybrid/test_reallocate.py
[ "$BASIC_LIMIT" = 0 ] || check "$BASIC_LIMIT" bench/gpu_check.py  # BASIC_LIMIT=0 leaves it out
exit $status
