#!/usr/bin/env bash
# Issue 49's GPU figures, on a lent GPU machine (one GPU, 16 cores, no network), in one run:
#   1. the real-model GRPO step against TRL 1.16 (bench/real_model.py --step-rounds 2): both
#      sides on the GPU, HF generation, the same SmolLM2-135M-shaped model, prompts and settings;
#      the model has fresh weights (made there from the carried config and tokenizer: its
#      540 MB of weights do not travel), so answers run to --tokens and the figure is per step;
#   2. asynchronous PPO against every synchronous placement on the 16 cores, three rounds
#      (bench/async_rl.py --algos ppo --rounds 3, four threads per process).
# Prepare here:  .venv/bin/python bench/gpu_wheels.py --steps   (Ray etc. as for gpu_run.sh, plus
# TRL 1.16 and what it needs beyond the image, and the model's config and tokenizer files), then
#   run(command="bash bench/gpu_steps.sh", carry=[".cache/gpu_wheels"], timeout_s=600)
# Outputs under $OUT (then bench/results/gpu/): steps_short.json, async_rl/, gpu_steps.txt.
# Limits: STEPS_LIMIT, ASYNC_LIMIT seconds (0 leaves that part out). Written for issue 49; its
# dry run on the 2-core CPU machine passes both parts (DEVICE_DRY=1 PYTHON=.venv/bin/python: the
# wheels not installed, tiny settings; 150 s and 294 s). Never run on a GPU: no device was lent
# to that issue's sessions.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.cache/gpu_wheels}
OUT=${OUT:-/tmp/gpu_steps_out}
STEPS_LIMIT=${STEPS_LIMIT:-330}
ASYNC_LIMIT=${ASYNC_LIMIT:-210}
SITE=${SITE:-$(mktemp -d /tmp/gpu_site.XXXXXX)}
LOG="$OUT/gpu_steps.txt"
mkdir -p "$OUT"
: >"$LOG"
if [ -z "${DEVICE_DRY:-}" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl 2>&1 |
        tee -a "$LOG" || exit 2
    export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
    export PEER_PYTHON="$PYTHON"  # TRL's side: the same interpreter, TRL from the carried wheels
fi
export RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"
"$PYTHON" -c 'import torch, transformers, trl; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__, "trl", trl.__version__)' 2>&1 | tee -a "$LOG"

MODEL="$OUT/smollm2-fresh"
"$PYTHON" - "$WHEELS/smollm2" "$MODEL" <<'PY' 2>&1 | tee -a "$LOG"
import shutil, sys, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
src, out = Path(sys.argv[1]), Path(sys.argv[2])
if not (out / "config.json").exists():
    shutil.copytree(src, out, dirs_exist_ok=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out)).save_pretrained(out)
print("model", out)
PY

status=0
part() {
    local limit=$1
    shift
    [ "$limit" = 0 ] && return
    echo "== $* (limit ${limit} s)" | tee -a "$LOG"
    local start=$SECONDS
    timeout -s INT -k 30 "$limit" "$PYTHON" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "== exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
    [ "$rc" = 0 ] || status=1
}
if [ -n "${DEVICE_DRY:-}" ]; then
    STEPS_ARGS=(--minutes 0.3 --eval-size 4 --tokens 8 --threads 2)
    ASYNC_ARGS=(--iterations 3 --warmup 1 --rounds 1 --threads-per-process 1)
else
    STEPS_ARGS=(--minutes 1 --eval-size 8 --tokens 16 --threads 16)
    ASYNC_ARGS=(--rounds 3 --threads-per-process 4)
fi
part "$STEPS_LIMIT" bench/real_model.py --model "$MODEL" --step-rounds 2 --workbench-setting lora@2e-4 \
    --trl-setting lora@2e-4 --out "$OUT" --runs "$OUT/runs" "${STEPS_ARGS[@]}"
part "$ASYNC_LIMIT" bench/async_rl.py --algos ppo --out "$OUT/async_rl" "${ASYNC_ARGS[@]}"
exit $status
