"""CriticWorker: values per response token, and the value-function update (FSDP2 or DeepSpeed).

With `lora` set the trunk stays frozen: its adapters and the (new) value head train."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from workbench import checks
from workbench.controller import ONE_TO_ALL, THREE_D_PROTO, THREE_D_REDUCED, Worker, register
from workbench.data.batch import Batch
from workbench.engines import budget, packing
from workbench.engines.backends import BACKENDS, check_data_parallel_only, make_engine
from workbench.engines.contract import Forward, LossFn, OptimConfig, check_training_fields
from workbench.engines.forward import model_outputs, response_values
from workbench.engines.kept_forward import KeptForwards
from workbench.engines.tensor_parallel import check_tensor_parallel_layout, local, shard_dim
from workbench.errors import ConfigError
from workbench.models.load import (
    LoadConfig,
    check_compiled_training,
    check_model_dir,
    check_training_precision,
    compile_forward,
    for_worker,
    read_config,
    training_dtype,
)
from workbench.models.lora import LoRAConfig, apply_lora, check_lora, check_targets
from workbench.models.value import load_value_model
from workbench.workers.snapshots import Snapshots
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


@dataclass
class CriticConfig:
    model_path: str
    """Causal-LM directory (a fresh value head is added) or a saved value model."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    mini_batch_size: int = 8
    """Rows per optimizer step, summed over data-parallel ranks."""
    micro_batch_size: int = 4
    max_tokens_per_micro_batch: int | None = None
    """As ActorConfig's: micro-batches of up to this many tokens instead of micro_batch_size rows."""
    packing: bool | None = None
    """As ActorConfig's: the values' forwards run packed where that is exact."""
    epochs: int = 1
    backend: str = "fsdp"
    """Training backend: "fsdp", "deepspeed", or "3d" (pipeline stages over the mesh's pp ranks,
    tensor parallel over its tp ranks, data-parallel replicas)."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage (1, 2 or 3) when backend="deepspeed"."""
    seed: int = 0
    load: LoadConfig = field(default_factory=LoadConfig)
    reuse_values_forward: bool = False
    """Compute the values with the update's own training forward and keep it for the update,
    saving one forward of the critic per iteration (workbench.engines.kept_forward). Exact where
    allowed: one epoch, and every update one optimizer step (rows <= mini_batch_size); other
    updates are refused. Holds the forward's activations from compute_values to update_critic."""
    lora: LoRAConfig | None = None
    """Train low-rank adapters on the frozen trunk, plus the whole value head (None: train every
    weight). Backends "fsdp" and "deepspeed"."""

    def __post_init__(self):
        checks.one_of(
            "CriticConfig", "backend", self.backend, BACKENDS, fix=f"unknown training backend; use one of {BACKENDS}"
        )
        checks.one_of("CriticConfig", "zero_stage", self.zero_stage, (1, 2, 3), fix="not a ZeRO stage; use 1, 2 or 3")
        check_training_fields("CriticConfig", self)
        checks.of_type("CriticConfig", "load", self.load, LoadConfig, "pass a workbench.models.load.LoadConfig")
        check_compiled_training("CriticConfig", self.load, self.backend, self.zero_stage)
        check_training_precision("CriticConfig", self.load, self.backend)
        check_lora("CriticConfig", self.lora, self.backend, train=True)
        if self.lora is not None and self.load.compile:
            raise ConfigError(
                "CriticConfig.load.compile", True, "compiled forwards are not wired with LoRA; use compile=False"
            )
        checks.of_type("CriticConfig", "reuse_values_forward", self.reuse_values_forward, bool, "use True or False")
        if self.reuse_values_forward:
            if self.epochs != 1:
                raise ConfigError(
                    "CriticConfig.reuse_values_forward",
                    True,
                    f"the values are the first epoch's forward, stale after its step (epochs={self.epochs}); "
                    "use epochs=1 or turn reuse_values_forward off",
                )
            if self.backend == "3d" or (self.backend == "deepspeed" and self.zero_stage == 3):
                raise ConfigError(
                    "CriticConfig.reuse_values_forward",
                    True,
                    f"kept forwards are supported with backend='fsdp' and DeepSpeed ZeRO-1/2, not "
                    f"backend={self.backend!r}"
                    + (" zero_stage=3" if self.backend == "deepspeed" else "")
                    + "; change the backend or turn reuse_values_forward off",
                )

    def check_layout(self, mesh, role: str) -> None:
        """Driver-side, before workers start: the layout and the model directory fit."""
        if self.backend == "3d":
            check_tensor_parallel_layout("CriticConfig", mesh, role, self.model_path, self.load.trust_remote_code)
        else:
            check_data_parallel_only("CriticWorker", mesh, role)
        check_mini_batch_splits("CriticConfig", self.mini_batch_size, mesh.dp, role)
        check_model_dir(self.model_path, "CriticConfig.model_path", "value", self.load.trust_remote_code)
        packing.check_layout(
            "CriticConfig", self.packing, mesh, read_config(self.model_path, self.load.trust_remote_code)
        )
        check_targets("CriticConfig", self.lora, self.model_path, value_head=True)

    def check_rows(self, rows: int, role: str) -> None:
        check_rows_split("CriticConfig", self.mini_batch_size, rows, role)
        if self.reuse_values_forward and rows > self.mini_batch_size:
            raise ConfigError(
                "CriticConfig.reuse_values_forward",
                True,
                f"{role}: an update of {rows} rows takes several optimizer steps (mini_batch_size="
                f"{self.mini_batch_size}), and the kept values are stale after the first; "
                f"raise mini_batch_size to {rows} or turn reuse_values_forward off",
            )

    def check_call(self, role: str, method: str, arguments: dict) -> None:
        batch = arguments.get("batch")
        if method == "update_critic" and isinstance(batch, Batch):
            self.check_rows(batch.num_valid, role)


class CriticWorker(Worker, WeightChannelMember, Snapshots):
    def __init__(self, config: CriticConfig):
        super().__init__(config)
        torch.manual_seed(config.seed)
        loaded = load_value_model(config.model_path, for_worker(config.load, self.device, trained=True))
        if config.reuse_values_forward and has_dropout(loaded.model):
            raise ConfigError(
                "CriticConfig.reuse_values_forward",
                True,
                f"the value model at {config.model_path} uses dropout, so its training forward is not "
                "the values' forward; turn reuse_values_forward off (or set the dropout to 0)",
            )
        model = loaded.model
        if config.lora is not None:  # before sharding; the value head is new, so it trains whole
            model = apply_lora(model, config.lora, trained_heads=VALUE_HEADS)
        self.engine = make_engine(
            compile_forward(model, config.load),
            config.optim,
            self.device_mesh["dp"],
            backend=config.backend,
            zero_stage=config.zero_stage,
            micro_batch_size=config.micro_batch_size,
            mini_batch_size=max(1, config.mini_batch_size // self.mesh.dp),
            tp_mesh=self.device_mesh["tp"] if config.backend == "3d" and self.mesh.tp > 1 else None,
            compute_dtype=training_dtype(config.load, self.device, "CriticConfig"),
            pp_mesh=self.device_mesh["pp"] if config.backend == "3d" and self.mesh.pp > 1 else None,
        )
        self.kept: KeptForwards | None = None  # compute_values' training forward; dropped when the weights change
        self.packed = packing.wanted(config.packing, self.engine.model, "CriticConfig")

    @register(THREE_D_PROTO)
    def compute_values(self, batch: Batch, output_key: str = "values") -> Batch:
        """V of each response position, under `output_key` (Safe-RLHF's cost critic: cost_values).
        With reuse_values_forward, from the next update's training forward, which is kept."""
        self.kept = None  # an older kept forward, and its activations, go
        cfg = self.config  # the update's own cut (run_updates), so a kept forward matches its micro-batches
        plan, micro = budget.cut(batch, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, self.engine.dp_group)
        if cfg.reuse_values_forward and len(batch) <= self.rows_per_step:
            self.kept = KeptForwards(self.engine.model, micro, self.training_forward)
            values = budget.in_order([out["values"].detach() for out in self.kept.outputs], plan)
        else:
            self.engine.model.eval()
            with torch.no_grad():
                values = budget.in_order([response_values(self.engine.model, mb, self.packed) for mb in micro], plan)
        return Batch({output_key: values * batch["response_mask"]})

    @property
    def rows_per_step(self) -> int:
        """This rank's rows per optimizer step."""
        return max(1, self.config.mini_batch_size // self.mesh.dp)

    def training_forward(self, model, micro_batch: Batch):
        return model_outputs(model, micro_batch, needs=("values",), packed=self.packed)

    @register(THREE_D_REDUCED)
    def update_critic(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """Value-function steps with `loss_fn(outputs, micro_batch)` from the driver, outputs
        {"values": V of each response position} (e.g.
        algorithms.losses.CriticLoss, PPO's clipped value loss on batch["returns"])."""
        cfg = self.config
        kept, self.kept = self.kept, None
        forward: Forward = self.training_forward
        if kept is not None and len(batch) <= self.rows_per_step:  # epochs == 1 (config): one step
            forward = kept.forward(forward)  # over the kept rows: their forward is this step's
        metrics = run_updates(
            self.engine,
            batch,
            loss_fn,
            forward,
            self.rows_per_step,
            cfg.micro_batch_size,
            cfg.epochs,
            max_tokens=cfg.max_tokens_per_micro_batch,
        )
        if cfg.reuse_values_forward:  # the share of micro-batches that reused compute_values' forward
            metrics["values_forward_reused"] = kept.reused / len(kept.outputs) if kept else 0.0
        return mean_over_ranks({k if "/" in k else f"critic/{k}": v for k, v in metrics.items()})

    # ---- weights between pools (a replica computing values on other devices) ----------------
    @register(ONE_TO_ALL)
    def send_weights(self, version: int) -> dict:
        """Every weight to the replica's ranks: by reallocation where the channel reallocates
        (every rank sends its share, a layer unit at a time), else broadcast from rank 0 one
        tensor at a time (gathered from the shards)."""
        if self.channel_sources:  # tensor parallel ("3d"): straight from this rank's pieces
            pieces = self._pieces() if self.config.backend == "3d" else None
            return self.reallocate_over_channel(version, "replica.send_weights", engine=self.engine, pieces=pieces)
        return self.send_over_channel(self.engine.iter_full_weights(), version, "replica.send_weights")

    @register(ONE_TO_ALL)
    def receive_weights(self, version: int) -> dict:
        """Load the weights of the critic trained elsewhere into this replica's shards (or its
        tensor-parallel pieces, backend "3d": reallocation only), in place."""
        self.kept = None  # a kept forward ran on the old weights
        if self.channel_sources and self.config.backend == "3d":
            return self.reallocate_over_channel(version, "replica.receive_weights", pieces=self._pieces())
        if self.channel_sources:
            return self.reallocate_over_channel(version, "replica.receive_weights", load=self.engine.load_full_weights)
        if self.config.backend != "fsdp":
            raise RuntimeError(
                f"receive_weights: a {self.config.backend!r} replica takes its weights by reallocation only; "
                "connect it with WeightLink(reallocate=None or True)"
            )
        return self.receive_over_channel(self.engine.load_full_weights, version, "replica.receive_weights")

    def _pieces(self) -> dict[str, tuple[torch.Tensor, int | None]]:
        """This rank's piece of every weight of a tensor-parallel engine, and the dim it is cut
        along (None: whole), for a reallocation to send from or fill in place."""
        return {name: (local(t), shard_dim(t)) for name, t in self.engine.model.state_dict().items()}

    # ---- checkpoints -------------------------------------------------------------------------
    @register(ONE_TO_ALL, remembers_path=True)  # session.recover reloads the last path saved
    def save_checkpoint(self, path: str) -> str:
        """Sharded value model + optimizer state under `path`, and each rank's random generators."""
        self.engine.save(path)
        save_rank_state(path, self.rank)
        return path

    @register(ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> str:
        self.kept = None  # made with the weights being replaced
        self.engine.load(path)
        load_rank_state(path, self.rank)
        return path

    def _trained(self):  # Snapshots
        return self.engine

    def _restored(self, counters: dict) -> None:
        self.kept = None  # made with the weights being replaced

    @register(ONE_TO_ALL)
    def export_hf(self, path: str, merged: bool = False) -> str:
        """The value model as a Hugging Face token-classification directory (rank 0 writes);
        `workbench.models.value.load_value_model` or AutoModelForTokenClassification loads it.
        With LoRA: a peft adapter directory (adapters and the value head), or the merged model
        with merged=True."""
        cfg = self.config

        def template():  # an unsharded value model from the base directory
            return load_value_model(cfg.model_path, cfg.load).model

        export_trained(self.engine, self.rank, path, template, cfg.lora, merged, trained_heads=VALUE_HEADS)
        dist.barrier()
        return path


VALUE_HEADS = ("score",)
"""The value head of AutoModelForTokenClassification's Llama-style models (trained whole under LoRA)."""


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether a training forward of `model` is random (dropout modules, or attention dropout)."""
    config = getattr(model, "config", None)
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()) or bool(
        getattr(config, "attention_dropout", 0.0)
    )
