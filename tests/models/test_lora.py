"""LoRA in one process: the base with adapters disabled is the base model bit for bit, the
adapted model equals its merged form, exports load back, and bad settings are refused on the
driver with the field and the fix."""

import copy

import pytest
import torch

from tests.workers.losses import reinforce_loss
from tests.workers.reference import advantages_for, prompts
from workbench import Mesh
from workbench.engines.forward import model_outputs, response_log_probs
from workbench.engines.hf_rollout import HFRollout
from workbench.engines.rollout import SamplingConfig
from workbench.errors import ConfigError
from workbench.models import load
from workbench.models.lora import (
    LoRAConfig,
    adapter_weights,
    apply_lora,
    count_trainable,
    is_trained,
    merged_weights,
    save_lora,
    trainable_parameters,
)
from workbench.workers import ActorConfig
from workbench.workers.critic import CriticConfig

LORA = LoRAConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def trained(tiny_dir):
    """(base model, LoRA model after two AdamW steps, a batch of sampled responses)."""
    loaded = load(tiny_dir)
    base, tokenizer = loaded.model, loaded.tokenizer
    gen = HFRollout(copy.deepcopy(base), tokenizer.pad_token_id, tokenizer.eos_token_id).generate(
        prompts(tokenizer), SamplingConfig(max_new_tokens=8, seed=1)
    )
    batch = gen.union(advantages_for(gen))
    model = apply_lora(load(tiny_dir).model, LORA)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    for _ in range(2):  # two: the first moves only B (A's gradient is 0 while B = 0)
        optimizer.zero_grad()
        reinforce_loss(model_outputs(model.train(), batch), batch)[0].backward()
        optimizer.step()
    return base.eval(), model.eval(), batch


def test_only_adapters_are_trainable_and_they_moved(trained, tiny_dir):
    base, model, _ = trained
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(is_trained(n) for n in names)
    assert sum(p.numel() for p in trainable_parameters(model)) < 0.1 * sum(p.numel() for p in base.parameters())
    untouched = apply_lora(load(tiny_dir).model, LORA).state_dict()
    changed = {n for n, v in model.state_dict().items() if not torch.equal(v, untouched[n])}
    assert changed and all(is_trained(n) for n in changed)


def test_count_trainable_matches_the_adapted_model(trained, tiny_dir):
    _, model, _ = trained
    real = (sum(p.numel() for p in trainable_parameters(model)), sum(p.numel() for p in model.parameters()))
    assert count_trainable(tiny_dir, LORA) == real


@torch.no_grad()
def test_reference_is_the_base_exactly_and_adapted_equals_merged(trained, tiny_dir):
    base, model, batch = trained
    with model.disable_adapter():
        reference, _ = response_log_probs(model, batch)
    assert torch.equal(reference, response_log_probs(base, batch)[0])

    adapted, _ = response_log_probs(model, batch)
    assert (adapted - reference).abs().max() > 1e-3  # the adapters do something
    merged = load(tiny_dir).model
    merged.load_state_dict(dict(merged_weights(model.state_dict().items(), LORA)))
    assert (response_log_probs(merged.eval(), batch)[0] - adapted).abs().max() <= 1e-5
    peft_merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert all((peft_merged[k] - v).abs().max() <= 1e-6 for k, v in merged.state_dict().items())


@torch.no_grad()
def test_exports_load_back(trained, tiny_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, model, batch = trained
    adapters = {n: v for n, v in model.state_dict().items() if is_trained(n)}
    adapted, _ = response_log_probs(model, batch)

    save_lora(load(tiny_dir).model, LORA, adapters, tmp_path / "adapter")
    assert not (tmp_path / "adapter" / "model.safetensors").exists()  # adapters only
    again = PeftModel.from_pretrained(load(tiny_dir).model, tmp_path / "adapter").eval()
    assert torch.equal(response_log_probs(again, batch)[0], adapted)

    save_lora(load(tiny_dir).model, LORA, adapters, tmp_path / "merged", merged=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()  # a plain model directory
    assert (response_log_probs(merged, batch)[0] - adapted).abs().max() <= 1e-5
    from safetensors.torch import load_file

    written = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert set(adapter_weights(adapters.items())) == set(written)  # the names vLLM reads


@pytest.mark.parametrize(
    "make, where",
    [
        (lambda: LoRAConfig(rank=0), "LoRAConfig.rank=0"),
        (lambda: LoRAConfig(alpha=-1.0), "LoRAConfig.alpha=-1.0"),
        (lambda: LoRAConfig(dropout=1.0), "LoRAConfig.dropout=1.0"),
        (lambda: LoRAConfig(target_modules="q_proj"), "LoRAConfig.target_modules='q_proj'"),
        (lambda: ActorConfig(model_path="m", backend="3d", lora=LORA), "ActorConfig.lora=.*backend='fsdp'"),
        (lambda: ActorConfig(model_path="m", train=False, reference=True, lora=LORA), "ActorConfig.lora=.*train=True"),
        (lambda: ActorConfig(model_path="m", lora={"rank": 4}), "ActorConfig.lora=.*LoRAConfig"),
        (lambda: CriticConfig(model_path="m", backend="3d", lora=LORA), "CriticConfig.lora=.*backend="),
    ],
)
def test_bad_lora_settings_are_refused(make, where):
    with pytest.raises(ConfigError, match=f"^{where}"):
        make()


def test_unknown_target_modules_are_refused_on_the_driver(tiny_dir):
    config = ActorConfig(model_path=str(tiny_dir), lora=LoRAConfig(target_modules=("q_proj", "qkv")))
    with pytest.raises(
        ConfigError, match=r"ActorConfig.lora.target_modules=.*no linear layer named \['qkv'\].*'o_proj'"
    ):
        config.check_layout(Mesh(dp=2), "actor")
    critic = CriticConfig(model_path=str(tiny_dir), lora=LoRAConfig(target_modules=("score",)))
    with pytest.raises(ConfigError, match=r"CriticConfig.lora.target_modules=\['score'\]"):
        critic.check_layout(Mesh(dp=1), "critic")


def test_lora_config_loads_from_yaml_mappings():
    from workbench.config_loader import build

    config = build(ActorConfig, {"model_path": "m", "lora": {"rank": 16, "target_modules": ["q_proj", "v_proj"]}})
    assert config.lora == LoRAConfig(rank=16, target_modules=("q_proj", "v_proj"))
    with pytest.raises(ConfigError, match=r"^lora.rank=-2"):
        build(ActorConfig, {"model_path": "m", "lora": {"rank": -2}})
