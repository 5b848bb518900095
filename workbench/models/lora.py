"""LoRA adapters (peft) on a loaded model: the base frozen, low-rank adapters trained.

The workers keep one module: the peft-wrapped model. Its adapters are the only trainable
parameters (the engines give the optimizer nothing else); with them disabled
(`peft_model.disable_adapter()`) the same module computes the base model exactly, which is how
an actor with LoRA serves as its own reference policy without a second copy of the weights.

Names: inside the workers parameters carry peft's names
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`); `hf_name` and
`merged_weights` give the plain Hugging Face names a rollout engine or an export expects.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from workbench import checks
from workbench.errors import ConfigError

LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER = "default"
"""peft's name for the one adapter a worker trains."""
_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters W + (alpha / rank) · B·A on the named linear layers (Hu et al. 2021)."""

    rank: int = 8
    """r: inner width of each adapter (B is out x r, A is r x in)."""
    alpha: float = 16.0
    """Scale numerator: the update is (alpha / rank) · B·A."""
    dropout: float = 0.0
    """Dropout on the adapter's input in training forwards. Keep 0 for PPO-style losses: with
    dropout the training forward is not the one that computed old_log_probs."""
    target_modules: tuple[str, ...] = LLAMA_LINEARS
    """Last name component of the linear layers that get adapters (default: every projection
    of a Llama block)."""

    def __post_init__(self):
        checks.whole("LoRAConfig", "rank", self.rank, fix="use a whole number >= 1 (typically 8-64)")
        checks.real("LoRAConfig", "alpha", self.alpha, 0, low_open=True, fix="use alpha > 0 (typically 2 x rank)")
        checks.real("LoRAConfig", "dropout", self.dropout, 0, 1, high_open=True, fix="use a dropout in [0, 1)")
        targets = self.target_modules
        if isinstance(targets, str) or not targets or not all(isinstance(t, str) and t for t in targets):
            raise ConfigError(
                "LoRAConfig.target_modules",
                targets,
                f"give a non-empty list of linear layer names, e.g. {list(LLAMA_LINEARS[:4])}",
            )
        object.__setattr__(self, "target_modules", tuple(targets))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def check_lora(owner: str, lora: LoRAConfig | None, backend: str, train: bool) -> None:
    """Driver-side: where LoRA is wired (the worker configs call it from __post_init__)."""
    if lora is None:
        return
    checks.of_type(owner, "lora", lora, LoRAConfig, "pass a workbench.models.lora.LoRAConfig(rank=...) or None")
    if not train:
        raise ConfigError(
            f"{owner}.lora", lora, "adapters are trained weights: set train=True, or lora=None for a frozen model"
        )
    if backend not in ("fsdp", "deepspeed"):
        raise ConfigError(
            f"{owner}.lora",
            lora,
            f"LoRA is wired for backend='fsdp' and backend='deepspeed', not {backend!r}; change the backend or "
            f"set lora=None",
        )


def check_targets(owner: str, lora: LoRAConfig | None, model_path: str | os.PathLike, value_head: bool = False):
    """Driver-side, before workers start: every target names a linear layer of the model (built
    on the meta device from its config: no weights read)."""
    if lora is None:
        return
    linears = linear_names(model_path, value_head)
    missing = [t for t in lora.target_modules if t not in linears]
    if missing:
        raise ConfigError(
            f"{owner}.lora.target_modules",
            list(lora.target_modules),
            f"the model at {model_path} has no linear layer named {missing}; its linear layers are {sorted(linears)}",
        )


def linear_names(model_path: str | os.PathLike, value_head: bool = False) -> set[str]:
    """Last name components of the model's nn.Linear layers (heads excluded)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = (AutoModelForTokenClassification if value_head else AutoModelForCausalLM).from_config(config)
    head = {"lm_head", "score"}
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)} - head


def count_trainable(model_path: str | os.PathLike, lora: LoRAConfig) -> tuple[int, int]:
    """(trainable, all) parameters of the model at `model_path` with `lora`'s adapters, as peft's
    print_trainable_parameters counts them; built on the meta device (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = apply_lora(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path)), lora)
    return sum(p.numel() for p in trainable_parameters(model)), sum(p.numel() for p in model.parameters())


def apply_lora(model: torch.nn.Module, lora: LoRAConfig, trained_heads: Iterable[str] = ()):
    """`model` wrapped by peft with fresh adapters (B = 0: at first it computes the base model
    exactly), everything else frozen. `trained_heads`: whole modules trained beside the adapters
    (a value model's new `score` head)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        modules_to_save=list(trained_heads) or None,
    )
    # LoadConfig.gradient_checkpointing is non-reentrant, so adapters behind the frozen embedding
    # get their gradients without peft's enable_input_require_grads.
    return get_peft_model(model, config, adapter_name=ADAPTER)


def peft_model(module: torch.nn.Module):
    """The peft model inside an engine's module (DeepSpeed wraps it in `.module`), or None."""
    from peft import PeftModel

    for candidate in (module, getattr(module, "module", None)):
        if isinstance(candidate, PeftModel):
            return candidate
    return None


def is_trained(name: str) -> bool:
    """A peft parameter name that belongs to an adapter or a trained head copy."""
    return ".lora_" in name or ".modules_to_save." in name


def hf_name(name: str) -> str:
    """peft name -> the base model's Hugging Face name (for frozen weights and trained heads)."""
    name = name.removeprefix(_PREFIX).replace(".base_layer.", ".")
    return name.replace(f".modules_to_save.{ADAPTER}.", ".")


def adapter_weights(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a peft state, under the names peft's adapter files use
    (`...q_proj.lora_A.weight`: no adapter name), which vLLM and `PeftModel.from_pretrained` read."""
    return {name.replace(f".{ADAPTER}.", "."): tensor for name, tensor in named if is_trained(name)}


def merged_weights(named: Iterable[tuple[str, torch.Tensor]], lora: LoRAConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft state streamed as the merged model's (HF names, W + scaling · B·A per adapted layer):
    each base weight is held only until its two adapter matrices have passed."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        if ".original_module." in name:
            continue  # a trained head's frozen original; its trained copy is the merged head
        layer, kind = _adapted_part(name)
        if layer is None:
            yield hf_name(name), tensor
            continue
        parts = pending.setdefault(layer, {})
        parts[kind] = tensor
        if len(parts) == 3:
            del pending[layer]
            delta = (parts["B"].float() @ parts["A"].float()) * lora.scaling
            yield hf_name(f"{layer}.weight"), (parts["W"] + delta).to(parts["W"].dtype)
    if pending:
        raise ValueError(f"merged_weights: adapted layers without all of W, A, B: {sorted(pending)}")


def _adapted_part(name: str) -> tuple[str | None, str]:
    """(adapted layer's peft prefix, "W" | "A" | "B") for a weight of an adapted layer."""
    for marker, kind in ((".base_layer.weight", "W"), (f".lora_A.{ADAPTER}.weight", "A")):
        if name.endswith(marker):
            return name.removesuffix(marker), kind
    if name.endswith(f".lora_B.{ADAPTER}.weight"):
        return name.removesuffix(f".lora_B.{ADAPTER}.weight"), "B"
    return None, ""


def save_lora(
    base: torch.nn.Module,
    lora: LoRAConfig,
    adapters: dict[str, torch.Tensor],
    path: str | os.PathLike,
    merged: bool = False,
    trained_heads: Iterable[str] = (),
) -> None:
    """Write trained `adapters` (peft names) for `base` (a fresh copy of the frozen model) as a
    peft adapter directory, or with merged=True as a plain model directory with them merged in."""
    model = apply_lora(base, lora, trained_heads)
    result = model.load_state_dict(adapters, strict=False)
    missing = [k for k in result.missing_keys if is_trained(k)]
    if result.unexpected_keys or missing:
        raise KeyError(f"save_lora: unexpected tensors {result.unexpected_keys[:5]}, missing adapters {missing[:5]}")
    (model.merge_and_unload() if merged else model).save_pretrained(path)


def write_adapter(adapters: dict[str, torch.Tensor], lora: LoRAConfig, path: str | os.PathLike) -> None:
    """A peft adapter directory from adapter tensors under peft's file names (`adapter_weights`),
    without a model: what vLLM loads as a LoRA adapter."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)
    ).save_pretrained(str(path))
    save_file({k: v.contiguous() for k, v in adapters.items()}, os.path.join(path, "adapter_model.safetensors"))


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What an optimizer steps: every parameter that wants a gradient (all of them in full
    fine-tuning; the adapters and trained heads under LoRA)."""
    return [p for p in model.parameters() if p.requires_grad]
