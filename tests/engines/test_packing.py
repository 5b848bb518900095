"""Packed forwards and token-budget micro-batches in one process: the packed forward gives the
padded forward's log-probs, entropy, values and gradients (plain and LoRA); micro-batches keep
to their budget, ranks get balanced tokens, and what cannot pack or fit is refused by name."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from workbench import Batch
from workbench.engines import budget, packing
from workbench.engines.accumulation import accumulate_gradients
from workbench.engines.forward import model_outputs, response_log_probs, response_values
from workbench.errors import ConfigError
from workbench.models import load, make_tiny
from workbench.models.lora import LoRAConfig, apply_lora
from workbench.models.value import load_value_model


def rows(groups=3, n=4, prompt=9, r=7, seed=0, vocab=200, observation=True) -> Batch:
    """`groups` prompts (left-padded differently) x n rows each, responses of 1..r tokens; with
    `observation`, one response token that is not the policy's (a multi-turn tool answer)."""
    g = torch.Generator().manual_seed(seed)
    count = groups * n
    attention = torch.ones(count, prompt + r, dtype=torch.long)
    ids = torch.randint(3, vocab, (count, prompt + r), generator=g)
    for k in range(groups):
        block = slice(k * n, (k + 1) * n)
        attention[block, : int(torch.randint(0, 4, (1,), generator=g))] = 0
        ids[block, :prompt] = ids[k * n, :prompt]
    for i in range(count):
        attention[i, prompt + int(torch.randint(1, r + 1, (1,), generator=g)) :] = 0
    ids = ids * attention
    response_mask = attention[:, prompt:].clone()
    if observation:
        response_mask[0, 0] = 0
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "responses": ids[:, prompt:],
            "response_mask": response_mask,
            "advantages": torch.linspace(-1, 1, count),
        }
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny("1m", tmp_path_factory.mktemp("tiny") / "m", seed=1))


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def close(a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> bool:
    """Equal within fp32 rounding of differently shaped matmuls, relative to `scale`."""
    return bool((a - b).abs().max() <= 2e-5 * max(scale, 1.0))


@pytest.mark.parametrize("share", [False, True], ids=["own-prompts", "shared-prompts"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_packed_log_probs_entropy_and_gradients_equal_the_padded_forward(model_dir, share, lora):
    model = load(model_dir).model
    if lora:
        model = apply_lora(model, LoRAConfig(rank=4, alpha=8.0))
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B = 0 at first: give A a gradient too
                p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    model.train()
    batch = rows()
    out = {}
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        log_probs, entropy = response_log_probs(model, batch, 0.7, True, share, packed=packed)
        ((log_probs * batch["advantages"][:, None]).sum() + entropy.sum()).backward()
        out[packed] = log_probs.detach(), entropy.detach(), grads(model)
    (lp0, ent0, g0), (lp1, ent1, g1) = out[False], out[True]
    assert close(lp1, lp0, lp0.abs().max()) and close(ent1, ent0, ent0.abs().max())
    assert ((lp1 != 0) == batch["response_mask"].bool()).all(), "a log-prob outside the policy's tokens"
    assert set(g1) == set(g0) and g0
    for name, g in g0.items():
        assert close(g1[name], g, g.abs().max()), name


def test_packed_values_equal_the_padded_forward_on_real_tokens(model_dir):
    model = load_value_model(model_dir).model.train()
    batch = rows()
    real = batch["attention_mask"][:, -7:].bool()
    for_grad = {}
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        values = response_values(model, batch, packed)
        (values * real).sum().backward()
        for_grad[packed] = values.detach(), grads(model)
    (v0, g0), (v1, g1) = for_grad[False], for_grad[True]
    assert close(v1[real], v0[real], v0.abs().max())
    assert (v1[~real] == 0).all()
    for name, g in g0.items():
        assert close(g1[name], g, g.abs().max()), name


def test_a_packed_prompt_once_for_its_rows_is_fewer_tokens_and_one_model_call(model_dir):
    model = load(model_dir).model
    batch = rows(groups=2, n=4, observation=False)
    calls = []
    model.register_forward_hook(lambda m, args, kwargs, out: calls.append(kwargs["input_ids"].shape), with_kwargs=True)
    shared, own = packing.pack(batch, share=True), packing.pack(batch, share=False)
    prompt_tokens = batch["attention_mask"][:, :9].sum(1)
    assert len(own) - len(shared) == int(prompt_tokens[[1, 2, 3, 5, 6, 7]].sum())
    response_log_probs(model, batch, packed=True)
    assert calls == [(1, len(shared))]


def test_a_step_over_token_budget_micro_batches_equals_the_row_count_step(model_dir):
    """accumulate_gradients weighs each micro-batch by its share: the cut does not change the step."""
    model = load(model_dir).model
    batch = rows(groups=4, n=4)

    class TokenMean:
        needs = ("log_probs",)

        def __call__(self, outputs, mb):
            mask = mb["response_mask"].float()
            return -(outputs["log_probs"] * mb["advantages"][:, None] * mask).sum() / mask.sum(), {}

        @staticmethod
        def weight(mb):
            return float(mb["response_mask"].sum())

    def step(micro, packed):
        copy_ = copy.deepcopy(model)
        accumulate_gradients(copy_, TokenMean(), micro, lambda m, mb: model_outputs(m, mb, packed=packed))
        return grads(copy_)

    by_rows = step([batch[i : i + 4] for i in range(0, 16, 4)], packed=False)
    by_tokens = step(budget.micro_batches(batch, 4, 40), packed=True)
    assert len(budget.micro_batches(batch, 4, 40)) > 1
    for name, g in by_rows.items():
        assert close(by_tokens[name], g, g.abs().max()), name


@pytest.mark.parametrize("seed", range(6))
def test_micro_batches_keep_to_the_budget_and_hold_every_row_once(seed):
    batch = rows(groups=5, n=3, r=30, seed=seed)
    limit = int(budget.row_tokens(batch).max()) + 10
    plan = budget.split(batch, limit)
    assert sorted(torch.cat(plan).tolist()) == list(range(len(batch)))
    for index in plan:
        assert len(packing.pack(batch[index], share=True)) <= limit  # what a packed forward computes
        assert len(index) >= 1
    # as few as first-fit would need, give or take the balancing
    assert len(plan) <= 2 * -(-int(budget.row_tokens(batch).sum()) // limit) + 1


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dp", [2, 4])
def test_ranks_get_tokens_within_one_row_of_each_other(seed, dp):
    g = torch.Generator().manual_seed(seed)
    batch = rows(groups=8, n=4, r=60, seed=seed)
    batch = batch[torch.randperm(len(batch), generator=g)]  # rows of a prompt scattered
    mini_batch_size = 16
    balanced = budget.balance(batch, dp, mini_batch_size)
    tokens = budget.row_tokens(balanced)
    part, step = len(batch) // dp, mini_batch_size // dp
    for start in range(0, part, step):
        parts = [balanced[k * part + start : k * part + start + step] for k in range(dp)]
        loads = [int(budget.row_tokens(p).sum()) for p in parts]
        longest = max(int(budget.row_tokens(p).max()) for p in parts)
        assert max(loads) - min(loads) <= longest, loads
        # the optimizer step's rows are the same rows, only on other ranks
        before = [batch[k * part + start : k * part + start + step] for k in range(dp)]
        assert sorted(Batch.concat(before)["input_ids"].tolist()) == sorted(Batch.concat(parts)["input_ids"].tolist())
    assert int(tokens.sum()) == int(budget.row_tokens(batch).sum())


def test_a_row_longer_than_the_budget_is_refused_by_name():
    batch = rows(r=30, seed=3)
    longest = int(budget.row_tokens(batch).max())
    with pytest.raises(ConfigError, match=r"ActorConfig.max_tokens_per_micro_batch.*row \d+ has \d+ tokens"):
        budget.check_rows(batch, longest - 1, "ActorConfig")
    budget.check_rows(batch, longest, "ActorConfig")


def test_models_packing_is_not_exact_for_are_refused_by_name(model_dir):
    assert packing.refusal(load(model_dir).model) is None
    assert packing.mode(load(model_dir).model) == "mask"
    sliding = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    sliding.config.sliding_window = 8
    assert "sliding-window" in packing.refusal(sliding)
    assert "not a transformers model" in packing.refusal(torch.nn.Linear(2, 2))
    assert packing.wanted(None, sliding, "ActorConfig") is False  # padded there, quietly
    with pytest.raises(ConfigError, match=r"ActorConfig.packing.*sliding-window"):
        packing.wanted(True, sliding, "ActorConfig")
    assert packing.wanted(False, load(model_dir).model, "ActorConfig") is False


def test_eager_attention_is_refused_and_sdpa_stays_sdpa_for_other_calls(model_dir):
    from workbench.models.load import LoadConfig

    eager = load(model_dir, LoadConfig(attn_implementation="eager")).model
    assert "'eager'" in packing.refusal(eager)
    model = load(model_dir).model.eval()
    batch = rows()
    padded, _ = response_log_probs(model, batch)
    packed, _ = response_log_probs(model, batch, packed=True)
    assert model.config._attn_implementation == packing.BLOCKS
    assert torch.equal(response_log_probs(model, batch)[0], padded)  # padded calls: SDPA, bit for bit
    assert close(packed, padded, padded.abs().max())


def test_packed_gradients_hold_under_activation_checkpointing(model_dir):
    """The backward recomputes each layer's attention after the packed call has returned."""
    model = load(model_dir).model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = rows()
    out = {}
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        log_probs, _ = response_log_probs(model, batch, packed=packed, share_prompts=False)
        (log_probs * batch["advantages"][:, None]).sum().backward()
        out[packed] = grads(model)
    for name, g in out[False].items():
        assert close(out[True][name], g, g.abs().max()), name


@pytest.mark.parametrize("share", [False, True], ids=["own-prompts", "shared-prompts"])
def test_a_packed_score_at_each_rows_last_token_equals_the_padded_one(model_dir, share):
    """A reward model's score: the head at each row's last real token (one row without a response)."""
    from workbench.models.value import last_token_index, token_values

    model = load_value_model(model_dir).model.eval()
    batch = rows()
    batch["attention_mask"][3, 9:] = 0
    batch["response_mask"][3] = 0
    with torch.no_grad():
        values = token_values(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        want = values.gather(1, last_token_index(batch["attention_mask"])[:, None]).squeeze(1)
        layout = packing.pack(batch, share=share, whole=True)
        got = packing.packed_call(model, layout).logits[0, layout.last].squeeze(-1)
    assert close(got, want, want.abs().max())


def test_the_driver_refuses_an_overlong_row_and_deals_the_rest_to_balance_ranks():
    """algorithms' update_actor / update_critic pass their rows through budget.for_update."""
    from types import SimpleNamespace

    batch = rows(groups=4, n=4, r=40, seed=2)
    longest = int(budget.row_tokens(batch).max())
    group = SimpleNamespace(
        config=SimpleNamespace(max_tokens_per_micro_batch=longest - 1, mini_batch_size=16), mesh=SimpleNamespace(dp=2)
    )
    with pytest.raises(ConfigError, match="ActorConfig.max_tokens_per_micro_batch"):
        budget.for_update(batch, group, "ActorConfig")
    group.config.max_tokens_per_micro_batch = longest
    dealt = budget.for_update(batch, group, "ActorConfig")
    halves = [int(budget.row_tokens(dealt[k * 8 : (k + 1) * 8]).sum()) for k in range(2)]
    assert abs(halves[0] - halves[1]) <= longest
    group.config.max_tokens_per_micro_batch = None
    assert budget.for_update(batch, group, "ActorConfig") is batch
