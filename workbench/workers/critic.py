"""CriticWorker: values per response token, and the value-function update (FSDP2)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workbench.controller import DP_PROTO, Worker, register
from workbench.controller.protocols import DP_REDUCED
from workbench.data.batch import Batch
from workbench.engines.fsdp import LossFn, OptimConfig
from workbench.engines.training import BACKENDS, make_engine
from workbench.models.load import LoadConfig
from workbench.models.value import load_value_model, token_values
from workbench.workers.training import mean_over_ranks, run_updates


@dataclass
class CriticConfig:
    model_path: str
    """Causal-LM directory (a fresh value head is added) or a saved value model."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    mini_batch_size: int = 8
    """Rows per optimizer step, summed over data-parallel ranks."""
    micro_batch_size: int = 4
    epochs: int = 1
    backend: str = "fsdp"
    """Training backend: "fsdp" or "deepspeed"."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage (1, 2 or 3) when backend="deepspeed"."""
    cliprange_value: float | None = 0.5
    """Clip new values to old_values ± this in the loss (PPO value clipping); None = off."""
    seed: int = 0
    load: LoadConfig = field(default_factory=LoadConfig)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"CriticConfig.backend: unknown training backend {self.backend!r}; use one of {BACKENDS}")


def response_values(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """V(s_t) for each response position t: the value at the token before it. B x R."""
    values = token_values(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    r = batch["responses"].shape[1]
    return values[:, -r - 1 : -1]


def clipped_value_loss(cliprange: float | None) -> LossFn:
    """0.5 * max((V - R)^2, (clip(V, V_old ± c) - R)^2), token mean (PPO value loss)."""

    def loss_fn(model, batch):
        mask = batch["response_mask"].float()
        values = response_values(model, batch)
        returns = batch["returns"]
        loss_raw = (values - returns) ** 2
        if cliprange is None:
            per_token, clipfrac = loss_raw, torch.zeros(())
        else:
            old = batch["values"]
            clipped = old + (values - old).clamp(-cliprange, cliprange)
            loss_clipped = (clipped - returns) ** 2
            per_token = torch.maximum(loss_raw, loss_clipped)
            clipfrac = ((loss_clipped > loss_raw).float() * mask).sum() / mask.sum().clamp(min=1)
        loss = 0.5 * (per_token * mask).sum() / mask.sum().clamp(min=1)
        vpred = (values.detach() * mask).sum() / mask.sum().clamp(min=1)
        return loss, {"critic/vf_loss": loss.item(), "critic/vf_clipfrac": float(clipfrac), "critic/vpred_mean": float(vpred)}

    return loss_fn


class CriticWorker(Worker):
    def __init__(self, config: CriticConfig):
        super().__init__(config)
        torch.manual_seed(config.seed)
        loaded = load_value_model(config.model_path, config.load)
        self.engine = make_engine(
            loaded.model, config.optim, self.device_mesh["dp"], backend=config.backend, zero_stage=config.zero_stage,
            micro_batch_size=config.micro_batch_size, mini_batch_size=max(1, config.mini_batch_size // self.mesh.dp),
        )

    @register(DP_PROTO)
    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        self.engine.model.eval()
        step = self.config.micro_batch_size
        values = torch.cat([response_values(self.engine.model, batch[i : i + step]) for i in range(0, len(batch), step)])
        return Batch({"values": values * batch["response_mask"]})

    @register(DP_REDUCED)
    def update_critic(self, batch: Batch, loss_fn: LossFn | None = None) -> dict[str, float]:
        """Value-function steps (default: clipped value loss) on batch["returns"]."""
        cfg = self.config
        loss_fn = loss_fn or clipped_value_loss(cfg.cliprange_value)
        metrics = run_updates(self.engine, batch, loss_fn, cfg.mini_batch_size // self.mesh.dp, cfg.micro_batch_size, cfg.epochs)
        return mean_over_ranks({f"critic/{k}" if "/" not in k else k: v for k, v in metrics.items()})
