"""Generated tokens/s of VLLMRollout.generate vs vLLM's own `llm.generate`, measured in one run.

Same engine, same 64 token-id prompts (arithmetic task), 64 new tokens, temperature 1:
  ours       - VLLMRollout.generate (Batch in, Batch out: padding stripped, log-probs, join)
  bare       - llm.generate on the same engine, the same per-prompt SamplingParams (so the
               same tokens), default output: no log-probs, detokenized text
  bare_lp    - the same with logprobs=0 (what ours asks vLLM for)
and `plain`: a stock engine (same settings, no log-prob processor, default logprobs_mode)
in a subprocess running the bare call, to price the processor.
Rounds alternate (order flipped every round) so all see the same machine load; tokens are
counted (rows may stop at EOS). On a shared, busy machine tokens/s swing 2-3x between rounds,
so it also prints the share of VLLMRollout.generate's time spent outside llm.generate (the
wrapper's own cost, which load does not blur). Also the engine start and load_weights times.
Last line: one JSON object.
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="10m", help="tiny-kit size (1m, 10m, 30m)")
    parser.add_argument("--model-dir", default=None, help="an HF checkpoint dir instead of the tiny kit")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--no-plain", action="store_true", help="skip the stock-engine comparison")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rollout_vllm_probe."))
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, work: Path) -> None:
    import torch

    from workbench.data.arithmetic import ArithmeticConfig, generate
    from workbench.data.prompts import tokenize_prompts
    from workbench.engines.rollout import SamplingConfig
    from workbench.engines.vllm_rollout import VLLMRollout, VLLMRolloutConfig
    from workbench.models import count_parameters, load_tokenizer, make_tiny

    model_dir = Path(args.model_dir) if args.model_dir else make_tiny(args.size, work / f"tiny-{args.size}")
    tokenizer = load_tokenizer(model_dir)[0]
    problems = generate(ArithmeticConfig(), args.prompts, seed=0)
    rows = [{"prompt": p.prompt, "ground_truth": p.ground_truth} for p in problems]
    prompts = tokenize_prompts(rows, tokenizer, 64)
    token_lists = [r[m.bool()].tolist() for r, m in zip(prompts["input_ids"], prompts["attention_mask"])]
    cfg = VLLMRolloutConfig(max_model_len=256, max_num_seqs=args.prompts, cache_root=str(work / "vllm-cache"))
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0, seed=0)

    rollout = VLLMRollout(model_dir, cfg)
    from vllm.inputs import TokensPrompt

    llm = rollout.llm
    engine_generate = llm.generate
    inputs = [TokensPrompt(prompt_token_ids=ids) for ids in token_lists]
    inside = []  # seconds ours spent inside llm.generate: the rest is the wrapper's own cost

    def timed_engine_generate(*a, **k):
        start = time.perf_counter()
        out = engine_generate(*a, **k)
        inside.append(time.perf_counter() - start)
        return out

    llm.generate = timed_engine_generate  # instance attribute: only VLLMRollout's calls go through it

    def bare(logprobs):
        # The very SamplingParams ours sends (same per-prompt seeds, so the same tokens and
        # the same number of decode steps), with or without the log-probs.
        params = [rollout._sampling_params(sampling, i) for i in range(len(inputs))]
        for p in params:
            p.logprobs, p.detokenize = logprobs, True
        outs = engine_generate(inputs, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def ours():
        return int(rollout.generate(prompts, sampling)["response_mask"].sum())

    def timed(fn):
        start = time.perf_counter()
        tokens = fn()
        return tokens, time.perf_counter() - start

    runs = {"ours": ours, "bare": lambda: bare(None), "bare_lp": lambda: bare(0)}
    rates = {k: [] for k in runs}
    pair_ratios, wrapper_share = [], []
    for fn in runs.values():  # warm-up
        fn()
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))  # none always goes first
        for name in order:
            inside.clear()
            tokens, seconds = timed(runs[name])
            rates[name].append(tokens / seconds)
            if name == "ours":
                wrapper_share.append(1 - sum(inside) / seconds)
        pair_ratios.append(rates["ours"][-1] / rates["bare"][-1])
    del llm.generate  # back to the class method

    seeds = [rollout._sampling_params(sampling, i).seed for i in range(len(inputs))]
    weights = _state_dict(model_dir)
    loads = []
    for _ in range(5):
        rollout.load_weights(weights.items())
        loads.append(rollout.last_load_seconds)
    start_seconds = rollout.start_seconds
    rollout.shutdown()

    # A second in-process engine cannot start in this process: the stock one gets its own.
    plain = [] if args.no_plain else _plain_engine_rates(model_dir, cfg, token_lists, seeds, args)

    med = statistics.median
    result = {
        "bench": "rollout_vllm_probe",
        "model": args.model_dir or f"tiny-{args.size}",
        "params": count_parameters(args.size) if not args.model_dir else None,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "ours_tok_s": round(med(rates["ours"])),
        "bare_tok_s": round(med(rates["bare"])),
        "bare_logprobs_tok_s": round(med(rates["bare_lp"])),
        "ratio_vs_bare": round(med(rates["ours"]) / med(rates["bare"]), 3),
        "ratio_vs_bare_paired": round(med(pair_ratios), 3),
        "wrapper_share_of_generate": round(med(wrapper_share), 4),
        "ratio_vs_bare_logprobs": round(med(rates["ours"]) / med(rates["bare_lp"]), 3),
        "plain_engine_bare_tok_s": round(med(plain)) if plain else None,
        "ratio_vs_plain_engine": round(med(rates["ours"]) / med(plain), 3) if plain else None,
        "rounds_tok_s": {k: [round(x) for x in v] for k, v in {**rates, "plain": plain}.items()},
        "engine_start_s": round(start_seconds, 2),
        "load_weights_ms": round(med(loads) * 1e3, 2),
        "goal_ratio": 0.9,
    }
    print(
        f"tokens/s: ours {result['ours_tok_s']}, bare llm.generate {result['bare_tok_s']} "
        f"(with logprobs {result['bare_logprobs_tok_s']}), "
        f"stock engine {result['plain_engine_bare_tok_s']}"
    )
    print(
        f"ratio ours/bare {result['ratio_vs_bare']} (paired rounds {result['ratio_vs_bare_paired']}); "
        f"VLLMRollout's own share of generate time {result['wrapper_share_of_generate']:.2%}"
    )
    print(f"engine start {result['engine_start_s']} s; load_weights {result['load_weights_ms']} ms")
    print(json.dumps(result))


def _plain_engine_rates(model_dir, cfg, token_lists, seeds, args) -> list[float]:
    """tokens/s of the bare call on a stock engine (same settings, no log-prob processor)."""
    script = """
import json, sys, time
from workbench.engines.vllm_rollout import VLLMRolloutConfig, _device_settings
import os
cfg = VLLMRolloutConfig(**json.loads(sys.argv[1]))
env, kwargs = _device_settings(cfg)
os.environ.update(env)
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
args = json.loads(sys.argv[2])
llm = LLM(model=args["model"], max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
          seed=cfg.seed, **kwargs)
inputs = [TokensPrompt(prompt_token_ids=ids) for ids in args["prompts"]]
params = [SamplingParams(max_tokens=args["new_tokens"], temperature=1.0, seed=s) for s in args["seeds"]]
rates = []
for _ in range(args["rounds"] + 1):
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
print(json.dumps(rates[1:]))
"""
    payload = {
        "model": str(model_dir),
        "prompts": token_lists,
        "seeds": seeds,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
    }
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(asdict(cfg)), json.dumps(payload)],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(f"the stock-engine subprocess failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _state_dict(model_dir):
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


if __name__ == "__main__":
    main()
