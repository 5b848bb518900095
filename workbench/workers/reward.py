"""Reward and cost models: a value-head LM scoring whole sequences (HybridFlow Table 4).

The score is the head's output at the last real token of prompt + response. Sequence-level
scores go in `scores` (or `costs`); `token_level_scores` puts the same number on the last
response token (zeros elsewhere), the form PPO's per-token rewards are built from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from workbench import checks
from workbench.controller import THREE_D_PROTO, Worker, register
from workbench.data.batch import Batch
from workbench.engines import budget, packing
from workbench.engines.forward import trim_padding
from workbench.engines.frozen import check_keep, frozen_load_config, keep_frozen
from workbench.engines.pipeline import PipelinedModel
from workbench.engines.tensor_parallel import check_tensor_parallel_layout, parallelize
from workbench.errors import ConfigError
from workbench.models.load import LoadConfig, check_model_dir, compile_forward, read_config
from workbench.models.value import last_token_index, load_value_model, token_values


@dataclass
class ScoreModelConfig:
    model_path: str
    """A trained value model (see workbench.stages.reward_model) or any causal-LM directory."""
    micro_batch_size: int = 8
    max_tokens_per_micro_batch: int | None = None
    """As ActorConfig's: micro-batches of up to this many tokens instead of micro_batch_size rows."""
    packing: bool | None = None
    """As ActorConfig's: the scoring forwards run packed where that is exact."""
    load: LoadConfig = field(default_factory=LoadConfig)
    seed: int = 0
    """Seeds the score head a plain causal-LM directory lacks (made afresh at load): every rank,
    process and run then scores with the same head."""
    keep: str = "whole"
    """Where the frozen scorer keeps its weights between forwards (workbench.engines.frozen):
    "whole" on every rank, "sharded" (FSDP2 shards over the data-parallel ranks, a layer gathered
    for its forward) or "host" (those shards in host memory). Sharded keeps need p1t1dN."""

    def __post_init__(self):
        if not isinstance(self.model_path, (str, os.PathLike)) or not str(self.model_path):
            raise ConfigError("ScoreModelConfig.model_path", self.model_path, "give a local checkpoint directory")
        checks.of_type("ScoreModelConfig", "seed", self.seed, int, "give a whole number")
        checks.whole(
            "ScoreModelConfig",
            "micro_batch_size",
            self.micro_batch_size,
            fix="use a whole number of rows >= 1 per forward",
        )
        if self.max_tokens_per_micro_batch is not None:
            checks.whole(
                "ScoreModelConfig",
                "max_tokens_per_micro_batch",
                self.max_tokens_per_micro_batch,
                fix="use a whole number of tokens >= 1 (at least the longest prompt plus max_new_tokens), or None",
            )
        checks.one_of("ScoreModelConfig", "packing", self.packing, (None, True, False), fix="use None, True or False")
        checks.of_type("ScoreModelConfig", "load", self.load, LoadConfig, "pass a workbench.models.load.LoadConfig")
        check_keep("ScoreModelConfig.keep", self.keep)
        if self.keep != "whole" and self.load.compile:
            raise ConfigError(
                "ScoreModelConfig.keep", self.keep, "compiled forwards are not wired for FSDP's hooks; use keep='whole'"
            )

    def check_layout(self, mesh, role: str) -> None:
        """Driver-side, before workers start: a decoder-only scorer with its tokenizer, cut as the
        "3d" backend cuts a critic (pipeline stages over pp, tensor parallel over tp, data-parallel
        replicas; a generation layout, from processes fused with the actor, is not its concern)."""
        check_model_dir(self.model_path, "ScoreModelConfig.model_path", "value", self.load.trust_remote_code)
        check_keep("ScoreModelConfig.keep", self.keep, mesh, role)
        if mesh.tp > 1 or mesh.pp > 1:
            check_tensor_parallel_layout("ScoreModelConfig", mesh, role, self.model_path, self.load.trust_remote_code)
        packing.check_layout(
            "ScoreModelConfig", self.packing, mesh, read_config(self.model_path, self.load.trust_remote_code)
        )


class RewardModelWorker(Worker):
    output_key = "scores"

    def __init__(self, config: ScoreModelConfig):
        super().__init__(config)
        torch.manual_seed(config.seed)  # a head the checkpoint lacks is made here: the same on every rank
        # kept sharded: loaded on the host and sharded on its way to the device
        loaded = load_value_model(config.model_path, frozen_load_config(config.load, self.device, False, config.keep))
        model = parallelize(loaded.model, self.device_mesh["tp"] if self.mesh.tp > 1 else None)
        if self.mesh.pp > 1:  # every rank of the pipeline gets the last stage's scores
            model = PipelinedModel(model, self.device_mesh["pp"])
        dp_mesh = self.device_mesh["dp"] if config.keep != "whole" else None  # a mesh costs collectives
        model = keep_frozen(model, config.keep, dp_mesh, self.device)
        self.model = compile_forward(model, config.load)
        self.packed = packing.wanted(config.packing, self.model, "ScoreModelConfig")
        self.dp_group = self.device_mesh["dp"].get_group() if dp_mesh is not None else None  # sharded: equal calls

    @torch.no_grad()
    def _score(self, batch: Batch) -> Batch:
        cfg = self.config
        plan, micro = budget.cut(batch, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, self.dp_group)
        scores = budget.in_order([self._last_values(mb) for mb in micro], plan)
        mask = batch["response_mask"]
        last = last_token_index(mask)
        token_level = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
        token_level[torch.arange(len(batch), device=scores.device), last] = scores
        return Batch({self.output_key: scores, f"token_level_{self.output_key}": token_level * mask})

    def _last_values(self, batch: Batch) -> torch.Tensor:
        """The head's output at each row's last real token: B."""
        if self.packed:
            layout = packing.pack(batch, share=packing.mode(packing.unwrap(self.model)) == "mask", whole=True)
            return packing.packed_call(self.model, layout).logits[0, layout.last].squeeze(-1).float()
        part, _ = trim_padding(batch)  # columns that are padding in every row
        values = token_values(self.model, part["input_ids"], part["attention_mask"], part["position_ids"])
        return values.gather(1, last_token_index(part["attention_mask"]).unsqueeze(1)).squeeze(1)

    @register(THREE_D_PROTO)
    def compute_reward(self, batch: Batch) -> Batch:
        return self._score(batch)


class CostModelWorker(RewardModelWorker):
    """Safe-RLHF's cost model: the same scorer, writing `costs`."""

    output_key = "costs"

    @register(THREE_D_PROTO)
    def compute_cost(self, batch: Batch) -> Batch:
        return self._score(batch)
