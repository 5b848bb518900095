"""Planner inputs as data: model architecture, RLHF workload, and cluster hardware.
The named clusters (A100, H100, H200, this machine) are built in `clusters`.

Units everywhere in the planner: bytes, seconds, FLOP/s, bytes/s.
Sources: Llama 2 paper (Touvron et al. 2023) for the model shapes; HybridFlow §8.1 for the
testbed and workload (16 machines of 8 A100-80GB; prompts and responses of 1024 tokens).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Literal

from workbench.planner.errors import UnknownPresetError
from workbench.prompt_sharing import SHARE_MIN_PARAM_TOKENS

GIB = 1024**3


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only Llama-style transformer (RMSNorm, SwiGLU MLP, optional grouped KV heads)."""

    name: str
    """Human-readable name, shown in plans and errors."""
    n_layers: int
    """Number of transformer blocks (L)."""
    hidden: int
    """Model width (h)."""
    n_heads: int
    """Attention (query) heads; tensor parallelism must divide it."""
    n_kv_heads: int
    """Key/value heads (= n_heads without grouped-query attention); sizes the KV cache."""
    intermediate: int
    """SwiGLU MLP inner width."""
    vocab: int
    """Vocabulary size."""
    value_head: bool = False
    """True for critic / reward / cost models: a scalar head replaces the LM head."""
    lora_rank: int = 0
    """Trained with LoRA adapters of this rank on every projection of each block (q, k, v, o,
    gate, up, down; workbench.models.lora's default targets), the base frozen; 0: every weight
    trains. Sizes the gradients and Adam states (`trainable_params`)."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one block that enter a matmul: q, k, v, o projections and the 3 MLP mats."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_dim + 3 * h * self.intermediate

    @property
    def head_params(self) -> int:
        return self.hidden if self.value_head else self.vocab * self.hidden

    @property
    def matmul_params(self) -> int:
        """Parameters that cost 2 FLOPs per token in a forward pass (all but embedding, norms)."""
        return self.n_layers * self.layer_matmul_params + self.head_params

    @property
    def param_count(self) -> int:
        """Embedding + blocks (with two RMSNorm vectors each) + final norm + head (untied)."""
        h = self.hidden
        return self.vocab * h + self.n_layers * (self.layer_matmul_params + 2 * h) + h + self.head_params

    @property
    def adapter_params(self) -> int:
        """LoRA parameters: r·(in + out) for each adapted projection of each block."""
        h, kv, inter = self.hidden, self.kv_dim, self.intermediate
        per_layer = 2 * (h + h) + 2 * (h + kv) + 3 * (h + inter)  # q, o; k, v; gate, up, down
        return self.n_layers * self.lora_rank * per_layer

    @property
    def trainable_params(self) -> int:
        """What gets gradients and Adam states when the model trains: everything, or under LoRA
        the adapters (plus a value model's new head, which trains whole)."""
        if not self.lora_rank:
            return self.param_count
        return self.adapter_params + (self.head_params if self.value_head else 0)

    @property
    def synced_params(self) -> int:
        """What a weight sync into a generation engine moves after each update: every weight, or
        under LoRA the adapters alone (the frozen base is there once for all; the runtime's
        `hybrid.sync_weights` moves just them)."""
        return self.adapter_params if self.lora_rank else self.param_count

    def with_lora(self, rank: int) -> ModelSpec:
        """The same model trained with LoRA adapters of `rank` (0: full fine-tuning)."""
        if not (isinstance(rank, int) and rank >= 0):
            raise ValueError(f"ModelSpec.with_lora(rank={rank!r}): use a whole number >= 0 (0 = full fine-tuning)")
        return dataclasses.replace(self, lora_rank=rank)

    def forward_flops_per_token(self, context: float) -> float:
        """2·(matmul params) + 4·L·context·h: dense matmuls plus QKᵀ and AV over `context`
        attended positions (Kaplan et al. 2020, §2.1; pass the mean context, s/2 for causal)."""
        return 2.0 * self.matmul_params + 4.0 * self.n_layers * context * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V for every layer: 2 · L · kv_dim · 2 bytes."""
        return 4 * self.n_layers * self.kv_dim

    @classmethod
    def from_hf_config(cls, config, name: str | None = None) -> ModelSpec:
        """The shape of a Hugging Face Llama-style config (e.g. a tiny-kit checkpoint's)."""
        return cls(
            name or getattr(config, "name_or_path", "") or config.model_type,
            config.num_hidden_layers,
            config.hidden_size,
            config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            config.intermediate_size,
            config.vocab_size,
        )

    @classmethod
    def from_model_dir(cls, path, lora_rank: int = 0, value_head: bool = False) -> ModelSpec:
        """The shape of the model in a Hugging Face directory (its config only: no weights
        read), trained with LoRA adapters of `lora_rank` (0: full fine-tuning, or frozen)."""
        from workbench.models.load import load_config

        spec = cls.from_hf_config(load_config(path), os.path.basename(os.path.normpath(path)))
        return (spec.as_value_model() if value_head else spec).with_lora(lora_rank)

    def as_value_model(self) -> ModelSpec:
        """The same trunk with a scalar head (critic, reward, cost models)."""
        if self.value_head:
            return self
        return dataclasses.replace(self, name=f"{self.name}-value", value_head=True)

    def describe(self) -> str:
        return (
            f"{self.name} ({self.param_count / 1e9:.2f}B params)"
            if self.param_count > 5e8
            else f"{self.name} ({self.param_count / 1e6:.1f}M params)"
        )


# Llama-2 shapes from the Llama 2 paper / HF configs. Llama-2-34B was never released; its
# shape is the one Code Llama 34B uses (48 layers, GQA with 8 KV heads), as in other papers.
# The tiny-* shapes are the tiny model kit's (`workbench.models.tiny.SIZES` with its default
# 262-token tokenizer), written out so the planner stays free of torch; a test keeps them equal.
MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec("llama2-7b", 32, 4096, 32, 32, 11008, 32000),
        ModelSpec("llama2-13b", 40, 5120, 40, 40, 13824, 32000),
        ModelSpec("llama2-34b", 48, 8192, 64, 8, 22016, 32000),
        ModelSpec("llama2-70b", 80, 8192, 64, 8, 28672, 32000),
        ModelSpec("tiny-1m", 4, 128, 4, 4, 352, 262),
        ModelSpec("tiny-10m", 6, 384, 6, 6, 1024, 262),
        ModelSpec("tiny-30m", 10, 512, 8, 8, 1280, 262),
    ]
}


def specs_from_models(models: dict[str, tuple[str, int, bool]]) -> dict[str, ModelSpec]:
    """ModelSpecs per role from (model directory, LoRA rank, value head), e.g. a run config's
    (`workbench.run.build.planner_models`), for `Dataflow.model_specs`."""
    return {role: ModelSpec.from_model_dir(path, rank, value) for role, (path, rank, value) in models.items()}


def model_preset(name: str) -> ModelSpec:
    """A model shape by name (case-insensitive): llama2-7b/13b/34b/70b, tiny-1m/10m/30m."""
    try:
        return MODEL_PRESETS[name.lower()]
    except KeyError:
        raise UnknownPresetError("model", name, list(MODEL_PRESETS)) from None


FROZEN_KEEPS: tuple[Literal["whole", "sharded", "host"], ...] = ("whole", "sharded", "host")
"""How a frozen model can keep its weights (`Workload.frozen_keep`), by the device memory it
holds, most first: the order a tie between plans is broken in (nothing gathered first, nothing
copied in from the host before that), and the order `deploy_plan` compares a config with."""


@dataclass(frozen=True)
class Workload:
    """Shapes of one RLHF iteration. Defaults: the HybridFlow paper's setting (§8.1)."""

    batch_size: int = 1024
    """Prompts per iteration (`data.loader.batch_size`)."""
    prompt_len: int = 1024
    """Prompt tokens per sequence (padded length)."""
    max_new_tokens: int = 1024
    """Generated tokens per sequence, the decode steps (`sampling.max_new_tokens`)."""
    n: int = 1
    """Responses per prompt (`sampling.n`, GRPO's groups); every call after generation sees
    batch_size·n sequences."""
    epochs: int = 1
    """Passes over the batch in each training call (`actor.epochs`)."""
    mini_batch_size: int = 128
    """Sequences per optimizer step (`actor.mini_batch_size`); the default makes the paper's
    8 steps of 1024 sequences."""
    micro_batch_size: int = 8
    """Sequences per forward/backward micro-batch on one data-parallel rank."""
    gradient_checkpointing: bool = True
    """Full activation checkpointing in training: stores one tensor per layer, costs a second
    forward pass (Chen et al. 2016)."""
    param_sharding: Literal["optimizer", "full"] = "optimizer"
    """How data-parallel ranks shard a model. "optimizer": the Megatron distributed optimizer
    (ZeRO-1; the papers' setting), one gradient reduce-scatter and one parameter all-gather
    per optimizer step. "full": FSDP / ZeRO-3, as the workbench's workers run; every
    micro-batch all-gathers each layer's parameters in the forward (and again in the
    backward) and reduce-scatters its gradients. Memory is estimated as for "optimizer"
    either way (an upper bound for "full")."""

    transition: Literal["deepspeed_chat", "vanilla", "hybridflow"] = "hybridflow"
    """How the actor's weights go from the training to the generation layout (HybridFlow
    Table 2): "hybridflow" (all-gather inside micro-DP groups, no redundant copy), "vanilla"
    (all-gather inside TP·PP groups, training shard kept beside) or "deepspeed_chat"
    (all-gather over all the actor's devices)."""

    transition_executor: Literal["reallocate", "allgather"] = "reallocate"
    """How the runtime moves the weights at that switch (`ActorConfig.transition_executor`):
    "reallocate" (point-to-point, `workbench.transfers.switch_bytes`; deepspeed_chat then moves
    (d-1)/d·M/(p·t) less than Table 2) or "allgather" (the collectives of Table 2)."""

    rollout_weights: Literal["broadcast", "reallocate"] = "broadcast"
    """How a rollout group takes the actor's weights after each update
    (`AlgoConfig.rollout_weights`): "broadcast" from the trainer's rank 0, or "reallocate" from
    every trainer rank where the runtime can (`Simulator.rollout_reallocates`: whole weights out
    of an FSDP trainer; LoRA's adapters and other trainers take the broadcast)."""

    broadcast_homes: tuple[str, ...] = ()
    """Trained models whose copies the runtime cannot reallocate into from their training
    backend (`workbench.workers.rollout_link.reallocatable`: an actor not trained by FSDP, a
    critic trained by DeepSpeed): their rollout groups and replicas take the broadcast from
    rank 0 (`Simulator.weight_push_time`). A headless run fills it from its configs."""

    frozen_keep: Literal["whole", "sharded", "host", "auto"] = "whole"
    """Where frozen models (reference, reward, cost) keep their weights between forwards
    (`ActorConfig.reference_keep`, `ScoreModelConfig.keep`; workbench.engines.frozen): "whole" on
    every data-parallel rank, "sharded" as FSDP shards (1/dp each; each forward all-gathers every
    layer) or "host" (those shards in host memory, no device memory; each forward also copies
    its shard in at `ClusterSpec.host_bandwidth`). One setting for every frozen model of the
    workload (a headless run's is its reference's); layouts with tp or pp > 1 keep whole, as
    the runtime does (it refuses shards there). "auto": `automap` and `search` plan with each
    keep and return the fastest plan that fits (its workload names the keep chosen); a
    `Simulator` prices one keep, so it refuses "auto"."""

    def __post_init__(self) -> None:
        if self.mini_batch_size < 1:
            raise ValueError(f"Workload.mini_batch_size={self.mini_batch_size}: use 1 or more sequences per step")
        if self.frozen_keep not in (*FROZEN_KEEPS, "auto"):
            raise ValueError(f"Workload.frozen_keep={self.frozen_keep!r}: use 'whole', 'sharded', 'host' or 'auto'")
        if self.rollout_weights not in ("broadcast", "reallocate"):
            raise ValueError(f"Workload.rollout_weights={self.rollout_weights!r}: use 'broadcast' or 'reallocate'")
        if self.param_sharding not in ("optimizer", "full"):  # a typo would silently mean "optimizer"
            raise ValueError(
                f"Workload.param_sharding={self.param_sharding!r}: use 'optimizer' "
                f"(distributed optimizer, ZeRO-1) or 'full' (FSDP / ZeRO-3)"
            )
        if self.transition not in ("deepspeed_chat", "vanilla", "hybridflow"):
            raise ValueError(
                f"Workload.transition={self.transition!r}: use 'hybridflow', "
                f"'vanilla' or 'deepspeed_chat' (HybridFlow Table 2)"
            )
        if self.transition_executor not in ("reallocate", "allgather"):
            raise ValueError(
                f"Workload.transition_executor={self.transition_executor!r}: use 'reallocate' "
                f"(point-to-point reallocation, the runtime's default) or 'allgather'"
            )

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.max_new_tokens

    @property
    def sequences(self) -> int:
        return self.batch_size * self.n

    @property
    def mini_batches(self) -> int:
        """Optimizer steps per epoch: the sequences in mini-batches of `mini_batch_size` (a
        last, smaller one is a step too)."""
        return -(-self.sequences // self.mini_batch_size)

    def forward_tokens(self, train: bool, pp: int = 1, params: float = 0.0) -> float:
        """Tokens a training (`train`) or scoring forward of a `params`-parameter model computes
        per sequence. The workers run a prompt once for all the rows of a micro-batch that
        repeat it (`workbench.engines.forward.shared_prompt_logits`: GRPO's n samples sit side by
        side) where that saves enough (`SHARE_MIN_PARAM_TOKENS`), except under pipeline
        parallelism and, in training, activation checkpointing."""
        rows_per_prompt = min(self.n, self.micro_batch_size)
        shared = self.shares_prompts(train, pp, params)
        return self.prompt_len / (rows_per_prompt if shared else 1) + self.max_new_tokens

    def shares_prompts(self, train: bool, pp: int = 1, params: float = 0.0) -> bool:
        """Whether such a forward computes each prompt once for the rows that repeat it (two
        model calls per micro-batch instead of one; see `forward_tokens`)."""
        rows_per_prompt = min(self.n, self.micro_batch_size)
        saved = (self.micro_batch_size - self.micro_batch_size / rows_per_prompt) * self.prompt_len
        return (
            rows_per_prompt > 1
            and pp == 1
            and not (train and self.gradient_checkpointing)
            and saved * params >= SHARE_MIN_PARAM_TOKENS
        )

    @classmethod
    def tiny(cls) -> Workload:
        """A workload that runs on this CPU machine with the tiny kit."""
        return cls(batch_size=16, prompt_len=32, max_new_tokens=32, mini_batch_size=8, micro_batch_size=4)


@dataclass(frozen=True)
class ClusterSpec:
    """`n_nodes` identical machines with `devices_per_node` accelerators each."""

    name: str
    """Preset or user name, shown in plans."""
    n_nodes: int
    """Machines."""
    devices_per_node: int
    """Accelerators per machine (U in HybridFlow Alg. 1); tensor parallelism stays inside one."""
    device_memory: float
    """Usable memory per device, bytes (Q)."""
    peak_flops: float
    """Dense bf16 peak per device, FLOP/s."""
    train_efficiency: float
    """Achieved fraction of peak in training matmuls (model FLOPs utilisation)."""
    inference_efficiency: float
    """Achieved fraction of peak in forward-only passes and prefill."""
    memory_bandwidth: float
    """Device memory (HBM) bandwidth, bytes/s; bounds decoding."""
    bandwidth_efficiency: float
    """Achieved fraction of memory bandwidth while decoding."""
    intra_node_bandwidth: float
    """Per-device bandwidth to peers in the same machine (NVLink), bytes/s."""
    inter_node_bandwidth: float
    """Per-machine network bandwidth to other machines, bytes/s (shared by its devices)."""
    comm_efficiency: float = 0.7
    """Achieved fraction of link bandwidth in collectives."""
    collective_latency: float = 20e-6
    """Fixed cost of one collective or point-to-point message, seconds."""
    step_overhead: float = 0.0
    """Fixed seconds per forward pass of a micro-batch or decoding step (framework dispatch,
    sampling, cache bookkeeping), on top of FLOPs and bytes. Negligible for large models on
    GPUs (0 in their presets); several ms per step for tiny models on a CPU (calibration)."""
    sequence_overhead: float = 0.0
    """Seconds each running sequence adds to a decoding step of its replica beyond its FLOPs
    and bytes: the generation engine's per-sequence host work (scheduling, block tables,
    sampling, stop checks, detokenisation). A replica's host runs it for all of its sequences,
    so it grows with the sequences per replica, which is what makes a few large tensor-parallel
    replicas slower than more small ones (HybridFlow measured generation TP 2 fastest for 7B
    and 4 for 13B with the actor trained 1-8-2 on 16 A100s)."""
    train_overhead: float = 0.0
    """Fixed seconds per training micro-batch beyond its forward-equivalents (autograd's
    bookkeeping, dense gradients of embeddings, the loss's own passes): 0 on GPU presets, where
    large models hide it; on this CPU it is most of a small model's training step (calibration
    fits it: a training call's time follows its micro-batch count far more than its tokens)."""
    inference_overhead: float = 0.0
    """Fixed seconds per forward-only micro-batch (log-prob, value and score calls) beyond its
    FLOPs: 0 on GPU presets; on this CPU a small micro-batch's matmuls run far below the
    rate of large ones, so a forward's time follows its micro-batch count as well as its
    tokens (Hockney's n½ as a time per micro-batch; the calibration fits it)."""
    kernel_latency: float = 0.0
    """Seconds one kernel costs beyond its bytes and FLOPs (launch, ramp-up): Hockney's
    t = (n + n½)/r∞ model of a kernel moving n bytes at rate r∞, with n½/r∞ written as a time.
    Charged for every kernel of a layer (`KERNELS_PER_LAYER`) in each decoding step and each
    forward pass, so small per-device work (large TP, tiny models) gets less efficient."""
    shard_overhead: float = 0.0
    """Seconds each collective of a sharded data-parallel unit costs beyond its bytes and
    `collective_latency`: FSDP2 copies a layer's shards into one buffer before its all-gather
    and out after, and runs hooks around it (likewise for the gradient reduce-scatter). 0 on
    GPU presets, where the copies run at HBM speed beside the transfer; on this CPU about as
    much as the transfer itself (a dp-2 forward of tiny-10m: +50 ms over a replica's, half of
    it beyond the all-gathers' bytes; the calibration fits it from two-device calls)."""
    gather_overhead: float = 0.0
    """Seconds each tensor gathered whole from its shards costs beyond its bytes and
    `collective_latency` (a sharded actor's weight sync into its rollout copy and its weight
    push gather tensor by tensor: DTensor's dispatch and the copy out): 0 on GPU presets;
    fitted from a timed sync on this CPU, down to -collective_latency (a small tensor's gather
    can cost less than the all-reduce latency the collectives fitted)."""
    call_overhead: float = 0.0
    """Seconds each model-function call costs beyond its work: the driver's dispatch, argument
    hand-off and result collection. Negligible against minute-long calls on GPUs (HybridFlow
    §4: the single controller's overhead is small), so 0 in their presets; milliseconds
    against sub-second calls here (measured by the profiler)."""
    host_bandwidth: float = 25e9
    """Host-to-device bytes/s per device (PCIe 4.0 x16 as achieved): what a frozen model kept in
    host memory (`Workload.frozen_keep="host"`) pays to copy its shards in for every forward.
    inf where the device is the host (a calibrated CPU cluster: the copy is no copy)."""
    driver_bandwidth: float = float("inf")
    """Bytes/s at which data passes through the driver (single controller), where the
    algorithm computes on it: the advantage step gathers the calls' outputs and sends the
    batch to every trained model. inf (not modelled) on GPU presets, where HybridFlow moves
    data worker to worker; measured by the profiler here (Ray object transfers, pickling)."""
    allocation: Literal["aligned", "free"] = "free"
    """Default device split between colocated sets. "aligned": ReaLHF meshes only, whole
    machines or a power-of-two slice inside one (1, 2, 4, 8, 16, 24, ... on 8-GPU machines),
    as real clusters schedule them. "free": any device count, packed machine by machine."""
    dtype_bytes: int = 2
    """Bytes per weight and activation element the devices compute and communicate in: 2
    (bf16) on GPU presets; 4 on a calibrated CPU, whose workers run fp32. Scales what
    collectives, weight switches and decoding reads move; memory capacity stays counted in
    the workload's bf16 figures (`memory.py`)."""
    decode_overlap: bool = True
    """Whether a decoding step's weight and KV reads overlap its matmuls, so the step costs the
    larger of the two (GPUs: the roofline). False on a calibrated CPU, where one thread streams
    the weights through the very matmuls it computes, and the step costs their sum."""
    broadcast_tree: bool = False
    """Whether a broadcast to r receivers takes ceil(log2(r + 1)) sends in turn (gloo's binomial
    tree: 43 MB to 1 receiver 28 ms here, to 2 or 3 receivers 56 ms), as a weight push pays it.
    False on GPU presets: NCCL pipelines its ring and tree broadcasts, so every link carries the
    bytes about once whatever the receivers."""
    cores_per_node: float | None = None
    """Compute units the devices of one machine time-share: a CPU machine offering more
    logical devices than cores. With k busy devices each runs at min(1, cores/k) of its
    speed (TimeCost shares them). None: every device computes on its own (GPUs)."""
    calibrated: bool = True
    """False when the figures are placeholders that calibration must replace."""
    note: str = ""
    """Where the figures come from."""

    @property
    def n_devices(self) -> int:
        return self.n_nodes * self.devices_per_node

    def mesh_sizes(self) -> list[int]:
        """Valid device-mesh sizes (ReaLHF §1): divisors of one node, or whole nodes."""
        u = self.devices_per_node
        return [d for d in range(1, u + 1) if u % d == 0] + [k * u for k in range(2, self.n_nodes + 1)]
