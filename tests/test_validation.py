"""Every invalid setting from the issue is refused on the driver, before any remote work, with
an error naming the field, the value and the fix."""

import shutil
import time

import pytest
import ray
import torch

import algorithms
from algorithms import GRPO, Groups
from tests.controller.workers import ConfigHolder
from workbench import Batch, Mesh, PlacementError
from workbench.engines.contract import OptimConfig
from workbench.engines.rollout import SamplingConfig
from workbench.engines.vllm_rollout import VLLMRolloutConfig
from workbench.errors import ConfigError
from workbench.models import make_tiny
from workbench.models.load import LoadConfig, ModelLoadError
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.critic import CriticConfig, CriticWorker
from workbench.workers.reward import RewardModelWorker, ScoreModelConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny("1m", tmp_path_factory.mktemp("validation") / "policy", seed=0))


def worker_hosts() -> int:
    return sum(
        1
        for a in ray._private.state.actors().values()
        if a["State"] == "ALIVE" and a["ActorClassName"].startswith("WorkerHost")
    )


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: ActorConfig("m", mini_batch_size=-8), "ActorConfig.mini_batch_size=-8"),
        (lambda: ActorConfig("m", mini_batch_size=0), "ActorConfig.mini_batch_size=0"),
        (lambda: ActorConfig("m", micro_batch_size=0), "ActorConfig.micro_batch_size=0"),
        (lambda: ActorConfig("m", epochs=0), "ActorConfig.epochs=0"),
        (lambda: ActorConfig("m", temperature=0.0), "ActorConfig.temperature=0.0"),
        (
            lambda: ActorConfig("m", train=False, rollout=None, reference=False),
            r"ActorConfig\(train, rollout, reference\)=\(False, None, False\)",
        ),
        (lambda: CriticConfig("m", micro_batch_size=0), "CriticConfig.micro_batch_size=0"),
        (lambda: CriticConfig("m", epochs=0), "CriticConfig.epochs=0"),
        (lambda: ScoreModelConfig("m", micro_batch_size=0), "ScoreModelConfig.micro_batch_size=0"),
        (lambda: OptimConfig(lr=-1e-4), "OptimConfig.lr=-0.0001"),
        (lambda: OptimConfig(lr=float("nan")), "OptimConfig.lr=nan"),
        (lambda: OptimConfig(betas=(0.9, 1.0)), r"OptimConfig.betas\[1\]=1.0"),
        (lambda: OptimConfig(grad_clip=-1), "OptimConfig.grad_clip=-1"),
        (lambda: SamplingConfig(max_new_tokens=0), "SamplingConfig.max_new_tokens=0"),
        (lambda: SamplingConfig(n=2.5), "SamplingConfig.n=2.5"),
        (lambda: SamplingConfig(top_k=-1), "SamplingConfig.top_k=-1"),
        (lambda: LoadConfig(dtype="fp8"), "LoadConfig.dtype='fp8'"),
        (lambda: VLLMRolloutConfig(max_model_len=0), "VLLMRolloutConfig.max_model_len=0"),
        (lambda: VLLMRolloutConfig(gpu_memory_utilization=1.5), "VLLMRolloutConfig.gpu_memory_utilization=1.5"),
        (lambda: algorithms.PPOConfig(gamma=1.5), "PPOConfig.gamma=1.5"),
        (lambda: algorithms.PPOConfig(estimator="gea"), "PPOConfig.estimator='gea'"),
        (lambda: algorithms.PPOConfig(kl_coef=-0.1), "PPOConfig.kl_coef=-0.1"),
        (lambda: algorithms.PPOConfig(clip_ratio_c=0.5), "PPOConfig.clip_ratio_c=0.5"),
        (lambda: Mesh(tp=0), "Mesh.tp=0"),
        (lambda: Mesh(dp=1.5), "Mesh.dp=1.5"),
    ],
)
def test_bad_settings_are_refused_at_construction(make, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        make()


def test_layouts_the_workers_do_not_implement_are_refused_before_workers_start(session, tiny):
    pool = session.pool("two", 2)
    before = worker_hosts()
    for mesh in (Mesh(tp=2), Mesh(pp=2)):
        with pytest.raises(ConfigError, match=r"actor mesh=.*data parallelism only.*Mesh\(dp=2\)"):
            session.group("actor", ActorRolloutRefWorker, pool, ActorConfig(tiny), mesh=mesh)
        with pytest.raises(ConfigError, match=r"critic mesh=.*data parallelism only"):
            session.group("critic", CriticWorker, pool, CriticConfig(tiny), mesh=mesh)
    with pytest.raises(
        ConfigError, match=r"ActorConfig.mini_batch_size=3: .* 2 data-parallel ranks; use a multiple of 2"
    ):
        session.group("actor", ActorRolloutRefWorker, pool, ActorConfig(tiny, mini_batch_size=3))
    with pytest.raises(PlacementError, match=r"devices=1.5 is not a device count"):
        session.pool("x", 1.5)
    assert worker_hosts() == before


def test_a_vllm_rollout_without_vllm_installed_is_refused_before_workers_start(session, tiny, monkeypatch):
    """vLLM is an extra: an environment made by `make demo` has none, and says how to add it."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    before = worker_hosts()
    with pytest.raises(ConfigError, match=r"ActorConfig.rollout='vllm': vLLM is not installed.*make env"):
        session.group("actor", ActorRolloutRefWorker, session.pool("one_vllm", 1), ActorConfig(tiny, rollout="vllm"))
    assert worker_hosts() == before


def test_model_directories_are_checked_on_the_driver(session, tiny, tmp_path):
    from transformers import BertConfig

    pool = session.pool("one", 1)
    bert = tmp_path / "bert"
    BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        architectures=["BertForMaskedLM"],
    ).save_pretrained(bert)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny}/{name}", bert / name)
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(tiny, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    before, start = worker_hosts(), time.monotonic()
    cases = [
        (ActorRolloutRefWorker, ActorConfig(str(tmp_path / "missing")), r"ActorConfig.model_path: .* does not exist"),
        (ActorRolloutRefWorker, ActorConfig(str(bert)), r"ActorConfig.model_path=.*not a decoder-only causal"),
        (CriticWorker, CriticConfig(str(bert)), r"CriticConfig.model_path=.*not a decoder-only causal.*BERT"),
        (RewardModelWorker, ScoreModelConfig(str(bert)), r"ScoreModelConfig.model_path=.*not a decoder-only"),
        (ActorRolloutRefWorker, ActorConfig(str(no_tokenizer)), r"ActorConfig.model_path=.*has no tokenizer"),
    ]
    for cls, config, message in cases:
        with pytest.raises(ModelLoadError, match=message):
            session.group("model", cls, pool, config)
    assert time.monotonic() - start < 20 and worker_hosts() == before  # nothing started remotely


def prompt_batch(rows: int, width: int) -> Batch:
    ids = torch.ones(rows, width, dtype=torch.long)
    return Batch({"input_ids": ids, "attention_mask": ids.clone()}, {"uid": [f"u{i}" for i in range(rows)]})


def test_overlong_prompts_and_uneven_mini_batches_are_refused_before_the_call(session, tiny):
    holder = session.group("actor", ConfigHolder, session.pool("two", 2), ActorConfig(tiny, mini_batch_size=12))
    sampling = SamplingConfig(max_new_tokens=16)
    assert holder.generate_sequences(prompt_batch(2, 496), sampling).get()["width"].tolist() == [496, 496]
    with pytest.raises(
        ModelLoadError, match=r"prompts of 497 tokens \+ max_new_tokens=16 = 513 exceed the 512 positions"
    ):
        holder.generate_sequences(prompt_batch(2, 497), sampling)
    algo = GRPO(
        Groups(actor=holder, reward=holder), algorithms.GRPOConfig(sampling=SamplingConfig(n=2), kl_loss_coef=0.0)
    )
    with pytest.raises(ConfigError, match=r"ActorConfig.mini_batch_size=12: the actor update gets 16 rows.*\[12, 4\]"):
        algo.step(prompt_batch(8, 4))  # 8 prompts x 2 samples


def test_a_config_edited_in_place_is_checked_again_at_the_next_step(session, tiny):
    holder = session.group("actor", ConfigHolder, session.pool("one", 1), ActorConfig(tiny, mini_batch_size=4))
    algo = GRPO(
        Groups(actor=holder, reward=holder), algorithms.GRPOConfig(sampling=SamplingConfig(n=2), kl_loss_coef=0.0)
    )
    calls = sum(1 for r in session.trace() if r.role == "actor")
    algo.config.sampling = SamplingConfig(n=1)  # what docs/controller.md invites, gone wrong
    with pytest.raises(ValueError, match=r"GRPOConfig.sampling.n=1: GRPO compares n >= 2"):
        algo.step(prompt_batch(4, 4))
    algo.config.sampling = SamplingConfig(n=2)
    algo.config.lam = 1.5
    with pytest.raises(ConfigError, match=r"GRPOConfig.lam=1.5: use a GAE lambda in \[0, 1\]"):
        algo.step(prompt_batch(4, 4))
    assert sum(1 for r in session.trace() if r.role == "actor") == calls  # no remote call was made
