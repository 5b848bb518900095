"""What real vocabularies cost, the training side: gradient checkpointing (the same loss and
gradients, recomputed) and bf16 compute with fp32 master weights, through the FSDP2 engine in a
one-rank process group (gloo on a file store: no Ray)."""

import copy
import sys

import pytest
import torch
import torch.distributed as dist

from workbench.data.batch import Batch
from workbench.engines.backends import make_engine
from workbench.engines.contract import OptimConfig
from workbench.engines.forward import model_outputs
from workbench.errors import ConfigError
from workbench.models import make_tiny
from workbench.models.load import LoadConfig, ModelLoadError, enable_gradient_checkpointing, load, training_dtype
from workbench.models.lora import LoRAConfig, apply_lora, is_trained
from workbench.workers.actor import ActorConfig


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("1m", tmp_path_factory.mktemp("kit") / "tiny-1m", seed=0)


class NLL:
    """The mean pre-training NLL of the rows: a loss with gradients through every layer."""

    needs = ("nll",)

    def __call__(self, outputs, micro_batch):
        loss = outputs["nll"].mean()
        return loss, {"loss": float(loss.detach())}


def text_batch(tokenizer, rows: int = 4) -> Batch:
    encoded = tokenizer([f"Q: {i}+{i + 3}=? A: {2 * i + 3}" for i in range(rows)], padding=True, return_tensors="pt")
    mask = encoded["attention_mask"]
    return Batch({"input_ids": encoded["input_ids"], "attention_mask": mask, "loss_mask": mask.clone()})


def forward(model, micro_batch):
    return model_outputs(model, micro_batch, NLL.needs)


def one_step(tiny, load_cfg: LoadConfig, compute_dtype=None, lora: LoRAConfig | None = None):
    loaded = load(tiny, load_cfg)
    torch.manual_seed(0)
    if lora is not None:
        loaded.model = apply_lora(loaded.model, lora)
        for name, p in loaded.model.named_parameters():  # B != 0: A gets gradients in the first step too
            if ".lora_B." in name:
                p.data.normal_(0, 0.02)
    engine = make_engine(loaded.model, OptimConfig(lr=1e-2), None, compute_dtype=compute_dtype)
    engine.model.train()
    batch = text_batch(loaded.tokenizer)
    metrics = engine.train_step(NLL(), [batch[:2], batch[2:]], forward)
    return metrics, engine.full_weights(), engine.model


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny):
    plain = load(tiny).model.train()
    checkpointed = copy.deepcopy(plain)
    enable_gradient_checkpointing(checkpointed, LoadConfig(gradient_checkpointing=True))
    assert checkpointed.is_gradient_checkpointing and not plain.is_gradient_checkpointing
    batch = text_batch(load(tiny).tokenizer)
    losses = []
    for model in (plain, checkpointed):
        loss = forward(model, batch)["nll"].mean()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=1e-6)
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_gradient_checkpointing_through_the_fsdp_engine_steps_like_without(tiny, group):
    plain_metrics, plain_weights, _ = one_step(tiny, LoadConfig())
    metrics, weights, model = one_step(tiny, LoadConfig(gradient_checkpointing=True))
    assert model.is_gradient_checkpointing
    assert metrics["loss"] == pytest.approx(plain_metrics["loss"], abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(plain_metrics["grad_norm"], rel=1e-5)
    for name, value in weights.items():
        torch.testing.assert_close(value, plain_weights[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_lora_step_with_gradient_checkpointing_equals_one_without(tiny, group):
    """LoRA behind a frozen embedding: non-reentrant recomputation still gives the adapters (and
    only them) their gradients, the same as without it."""
    lora = LoRAConfig(rank=4, alpha=8.0)
    plain_metrics, plain_weights, _ = one_step(tiny, LoadConfig(), lora=lora)
    metrics, weights, model = one_step(tiny, LoadConfig(gradient_checkpointing=True), lora=lora)
    assert model.base_model.model.is_gradient_checkpointing
    assert metrics["loss"] == pytest.approx(plain_metrics["loss"], abs=1e-6)
    assert metrics["grad_norm"] > 0 and metrics["grad_norm"] == pytest.approx(plain_metrics["grad_norm"], rel=1e-5)
    initial = dict(apply_lora(load(tiny).model, lora).named_parameters())
    for name, value in weights.items():
        torch.testing.assert_close(value, plain_weights[name], rtol=1e-5, atol=1e-6, msg=name)
        if name in initial and not is_trained(name):
            assert torch.equal(value, initial[name].detach()), name  # the frozen base did not move


def test_a_lora_bf16_step_keeps_fp32_adapters_and_the_base_unchanged(tiny, group):
    lora = LoRAConfig(rank=4, alpha=8.0)
    fp32_metrics, _, _ = one_step(tiny, LoadConfig(), compute_dtype=torch.float32, lora=lora)
    metrics, weights, _ = one_step(tiny, LoadConfig(compute_dtype="bfloat16"), compute_dtype=torch.bfloat16, lora=lora)
    assert metrics["loss"] == pytest.approx(fp32_metrics["loss"], rel=2e-2)
    initial = dict(apply_lora(load(tiny).model, lora).named_parameters())
    for name, value in weights.items():
        if value.is_floating_point():
            assert value.dtype == torch.float32, name
        if name in initial and not is_trained(name):
            assert torch.equal(value, initial[name].detach()), name


def test_a_bf16_step_computes_in_bf16_and_keeps_fp32_master_weights(tiny, group):
    assert training_dtype(LoadConfig(compute_dtype="bfloat16"), "cpu") == torch.bfloat16  # this CPU runs bf16
    fp32_metrics, fp32_weights, _ = one_step(tiny, LoadConfig(), compute_dtype=torch.float32)
    metrics, weights, model = one_step(tiny, LoadConfig(compute_dtype="bfloat16"), compute_dtype=torch.bfloat16)
    seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    model(input_ids=torch.tensor([[1, 2, 3]]))
    hook.remove()
    assert seen == [torch.bfloat16]  # layers compute in bf16 ...
    assert all(w.dtype == torch.float32 for w in weights.values() if w.is_floating_point())  # ... fp32 master weights
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["loss"] == pytest.approx(
        fp32_metrics["loss"], rel=2e-2
    )
    moved = [(weights[k] - fp32_weights[k]).abs().max() for k in weights if weights[k].is_floating_point()]
    assert max(moved) > 0  # a different (bf16) step, but a step


def test_precision_options_are_validated(tiny, monkeypatch):
    assert training_dtype(LoadConfig(), "cpu") == torch.float32  # auto: the fp32 reference on CPU
    assert training_dtype(LoadConfig(compute_dtype="float32"), "cpu") == torch.float32
    with pytest.raises(ConfigError, match=r"LoadConfig\.compute_dtype=.*use one of"):
        LoadConfig(compute_dtype="fp16")
    with pytest.raises(ConfigError, match=r"gradient_checkpointing=.*True or False"):
        LoadConfig(gradient_checkpointing="yes")
    monkeypatch.setattr(
        sys.modules["workbench.models.load"], "cpu_runs_bf16", lambda: False
    )  # the package exports a function `load`
    with pytest.raises(ConfigError, match=r"ActorConfig\.load\.compute_dtype=.*cannot multiply bf16 .*'float32'"):
        training_dtype(LoadConfig(compute_dtype="bfloat16"), "cpu", "ActorConfig")
    with pytest.raises(ConfigError, match=r"ActorConfig\.load\.compute_dtype=.*backend='3d'"):
        ActorConfig(model_path=str(tiny), backend="3d", load=LoadConfig(compute_dtype="bfloat16"))


def test_a_model_without_checkpointing_support_is_refused():
    with pytest.raises(ModelLoadError, match="does not support gradient checkpointing"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2), LoadConfig(gradient_checkpointing=True), "here")
