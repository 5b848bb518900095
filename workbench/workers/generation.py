"""How an actor's rollout engine holds the policy's weights: one strategy object per actor
process (`ActorRolloutRefWorker.generation`), chosen once from its config and mesh
(`generation_kind`) and rebuilt when the driver changes its generation layout (`relayout`).

  * `Shared`: the rollout reads the training tensors themselves. An HF rollout where a rank
    holds its training weights whole (one data-parallel rank, or ZeRO-1/2), or generation as a
    pipeline over the training stages. Nothing moves.
  * `Copied`: the rollout holds a copy of its own (HF or vLLM; also a frozen or rollout-only
    group). Before a generation that follows an update the full weights (LoRA: the adapters)
    stream into it one tensor at a time, each gathered from the shards as it is reached; a
    rollout group on devices of its own receives them over a weight channel instead.
  * `Switched`: the 3D-HybridEngine (workbench.hybrid.transition) re-cuts the training shards
    into the generation layout before each generation and back after it.

Each has the same steps: `prepare` before a generation, `restore` after it, `load` for weights
that arrive from another group, `leave` before it is replaced.

Building one has two halves, because the training engine cuts the model in place: `draft` takes
what the rollout needs from the whole model before the engine exists, `bind` finishes the
strategy over the engine's weights.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, replace

import psutil
import torch
from torch.distributed.device_mesh import DeviceMesh

from workbench.engines.hf_rollout import HFRollout, weightless_copy
from workbench.engines.pipeline import PipelinedModel
from workbench.engines.pipelined_rollout import PipelinedRollout
from workbench.engines.rollout import end_token_ids
from workbench.engines.tensor_parallel import parallelize, pipelined_generation
from workbench.hybrid.transition import HybridEngine
from workbench.layouts import generation_groups
from workbench.models.load import for_worker, load
from workbench.models.lora import adapter_weights


def generation_kind(config, mesh) -> str:
    """How an actor with `config` generates under `mesh`:
    "switch" (3D-HybridEngine, tensor parallelism without stages), "stages" (a pipeline over the
    training stages), "switched stages" (stages of their own in a smaller tensor layout, switched
    into) or "copy" (every other case, whether the copy is shared or synced)."""
    hf_3d = config.rollout == "hf" and config.backend == "3d"
    if hf_3d and pipelined_generation(mesh):
        return "stages" if mesh.gen_tp in (None, mesh.tp) else "switched stages"
    if hf_3d and mesh.tp > 1 and mesh.pp == 1:
        return "switch"
    return "copy"


class Generation:
    """The rollout engine (None: this actor does not generate) and how its weights are kept."""

    def __init__(self, rollout):
        self.rollout = rollout

    def prepare(self, worker) -> None:
        """Before a generation: the rollout holds the current weights."""

    def restore(self, worker) -> None:
        """After a generation: generation-only memory goes, the training layout is back."""
        self.rollout.release()

    def load(self, weights) -> None:
        """Weights that arrive from another group ((name, tensor) pairs), loaded in place."""
        self.rollout.load_weights(weights)

    def leave(self) -> None:
        """Before this strategy is replaced (a new generation layout)."""


class Shared(Generation):
    """The rollout reads the training tensors: nothing to prepare."""


class Copied(Generation):
    """A rollout copy of its own, synced lazily: `synced` is the update count it holds."""

    def __init__(self, rollout, synced: int = 0, adapters: bool = False):
        super().__init__(rollout)
        self.synced = synced
        self.adapters = adapters  # LoRA on vLLM: the engine applies the adapters itself

    def prepare(self, worker) -> None:
        if worker.engine is None or self.synced == worker.version:
            return
        start = time.time()
        moved = _Counted()
        self.load(moved(worker.weights_to_sync()))
        peak_rss = psutil.Process().memory_info().rss
        self.synced = worker.version
        worker.record_span(
            "hybrid.sync_weights",
            start,
            time.time(),
            peak_rss_bytes=peak_rss,
            version=worker.version,
            bytes_loaded=moved.bytes,
            tensors=moved.tensors,
        )

    def load(self, weights) -> None:
        if self.adapters:
            self.rollout.load_adapter(adapter_weights(weights))
        else:  # the HF copy is the peft model too: same names (adapters only, with LoRA)
            self.rollout.load_weights(weights)


class Switched(Generation):
    """The 3D-HybridEngine's switch from `trained` (the training model) into the rollout's."""

    def __init__(self, rollout, hybrid: HybridEngine, trained):
        super().__init__(rollout)
        self.hybrid = hybrid
        self.trained = trained

    def prepare(self, worker) -> None:
        stats = self.hybrid.to_generation()
        end = time.time()
        worker.record_span("hybrid.transition", end - stats.seconds - stats.check_seconds, end, **stats.as_dict())

    def restore(self, worker) -> None:
        super().restore(worker)
        self.hybrid.to_training()

    def leave(self) -> None:
        self.hybrid.to_training()


@dataclass
class Draft:
    """What a generation takes from the whole model before the training engine cuts it."""

    kind: str
    rollout: object = None
    gen_tp_group: object = None


def draft(worker, model) -> Draft:
    kind = generation_kind(worker.config, worker.mesh)
    if kind == "switched stages":  # the switch fills its weights
        return Draft(kind, *_staged_rollout(worker, weightless_copy(model)))
    if kind == "stages":  # built over the training stages once they exist
        return Draft(kind)
    if kind == "switch":
        gen, gen_tp_group = _generation_model(worker, model)
        cfg, tokenizer = worker.config, worker.tokenizer
        rollout = HFRollout(gen, tokenizer.pad_token_id, end_token_ids(model, tokenizer), cfg.hf, tokenizer=tokenizer)
        return Draft(kind, rollout, gen_tp_group)
    return Draft(kind, _make_rollout(worker, model))


def bind(worker, drafted: Draft, model) -> Generation:
    """The strategy over the training engine's weights (`model`: the actor's, after the engine
    took it; it is the switch's training side where the actor does not train)."""
    engine, rollout = worker.engine, drafted.rollout
    if drafted.kind == "switch":
        trained = engine.model if engine is not None else parallelize(model, worker.device_mesh["tp"])
        return _switched(worker, trained, rollout, drafted.gen_tp_group)
    if drafted.kind == "switched stages":
        return _switched(worker, engine.model.hf, rollout, drafted.gen_tp_group)
    if drafted.kind == "stages":
        return Shared(_pipelined_rollout(worker))
    if engine is not None and isinstance(rollout, HFRollout):
        live = engine.shared_full_weights()
        if live is not None:
            rollout.share_weights(live)
            return Shared(rollout)
        rollout.materialize(engine.iter_full_weights())  # sharded: gathered one tensor at a time
    return Copied(rollout, adapters=_applies_adapters(worker.config))


def relayout(worker, current: Generation, previous) -> Generation:
    """The strategy after the driver moved the group from mesh `previous` to `worker.mesh`: a
    fresh generation model cut over the new generation groups (its weights are filled at each
    switch, so the initial ones from disk do); the training weights are untouched. Pipeline
    stages switch between generating as a pipeline and a whole copy on every rank."""
    mesh, cfg = worker.mesh, worker.config
    if mesh.pp > 1 and cfg.rollout == "hf":
        if _stage_generation(previous) == _stage_generation(mesh):
            return current
        current.leave()
        kind = generation_kind(cfg, mesh)
        if kind == "stages":
            return Shared(_pipelined_rollout(worker))
        skeleton = _skeleton(worker)
        if kind == "switched stages":
            return _switched(worker, worker.engine.model.hf, *_staged_rollout(worker, skeleton))
        rollout = _make_rollout(worker, skeleton)
        rollout.materialize(worker.engine.iter_full_weights())
        return Copied(rollout, synced=worker.version)
    if not isinstance(current, Switched):
        return current  # checked on the driver: without tensor parallelism the layout cannot change
    current.leave()
    gen, gen_tp_group = _generation_model(worker, _skeleton(worker))
    current.rollout.model = gen.eval()
    return _switched(worker, current.trained, current.rollout, gen_tp_group)


def _applies_adapters(config) -> bool:
    return config.lora is not None and config.rollout == "vllm"


def _skeleton(worker):
    return load(worker.config.model_path, for_worker(worker.config.load, worker.device, worker.config.train)).model


def _switched(worker, trained, rollout, gen_tp_group) -> Switched:
    """The 3D-HybridEngine between `trained` and the rollout's model (or its stages)."""
    staged = isinstance(rollout, PipelinedRollout)
    hybrid = HybridEngine(
        trained,
        rollout.pipe.hf if staged else rollout.model,
        worker.mesh,
        worker.rank,
        tp_group=worker.device_mesh["tp"].get_group(),
        gen_tp_group=gen_tp_group,
        check=worker.config.check_weight_sync,
        executor=worker.config.transition_executor,
    )
    return Switched(rollout, hybrid, trained)


def _pipelined_rollout(worker) -> PipelinedRollout:
    """Generation over the training stages (checked on the driver: the actor trains)."""
    tp_group = worker.device_mesh["tp"].get_group() if worker.mesh.tp > 1 else None
    return _rollout_over(worker, worker.engine.model, tp_group)


def _staged_rollout(worker, skeleton) -> tuple[PipelinedRollout, object]:
    """Generation over stages of its own, cut over the generation tensor-parallel groups of each
    stage (gen_tp < tp), and that tensor-parallel group: the hybrid engine fills their weights at
    each switch."""
    mesh = worker.mesh
    groups = torch.tensor(generation_groups(mesh)).reshape(-1, mesh.pp, mesh.gen_tp)
    device_mesh = DeviceMesh(worker.device.type, groups, mesh_dim_names=("replica", "pp", "tp"))
    tp_mesh = device_mesh["tp"] if mesh.gen_tp > 1 else None
    gen_tp_group = tp_mesh.get_group() if tp_mesh is not None else None
    stages = PipelinedModel(parallelize(skeleton, tp_mesh), device_mesh["pp"])
    return _rollout_over(worker, stages, gen_tp_group), gen_tp_group


def _rollout_over(worker, stages: PipelinedModel, tp_group) -> PipelinedRollout:
    tokenizer, cfg = worker.tokenizer, worker.config.hf
    end = end_token_ids(stages.hf, tokenizer)
    return PipelinedRollout(stages, tokenizer.pad_token_id, end, cfg, tokenizer=tokenizer, tp_group=tp_group)


def _generation_model(worker, model) -> tuple:
    """A copy of the model cut over this rank's generation tensor-parallel group (its weights are
    freed at once: the hybrid engine fills them before each generation), and that group."""
    groups = generation_groups(worker.mesh)
    gen = copy.deepcopy(model)
    if len(groups[0]) == 1:
        return gen, None
    device_mesh = DeviceMesh(worker.device.type, torch.tensor(groups), mesh_dim_names=("replica", "tp"))  # pp = 1
    return parallelize(gen, device_mesh["tp"]), device_mesh["tp"].get_group()


def _make_rollout(worker, model):
    cfg = worker.config
    if cfg.rollout == "hf":
        pad, eos = worker.tokenizer.pad_token_id, end_token_ids(model, worker.tokenizer)
        # A trained model's rollout gets its weights once the engine exists (shared with the
        # training tensors, or gathered from them): no full copy now.
        gen = weightless_copy(model) if cfg.train else copy.deepcopy(model)
        return HFRollout(gen, pad, eos, cfg.hf, tokenizer=worker.tokenizer)
    if cfg.rollout == "vllm":
        from workbench.engines.vllm_rollout import VLLMRollout  # heavy import, only when used

        # Ranks sharing a machine must not pin their engines to the same cores.
        cores = os.cpu_count() or 1
        engine = (
            replace(cfg.vllm, cpu_threads_bind=str(worker.rank % cores))
            if cfg.vllm.cpu_threads_bind == "per-rank"
            else cfg.vllm
        )
        return VLLMRollout(cfg.model_path, engine, lora=cfg.lora)
    return None


def _stage_generation(mesh) -> tuple:
    """How pipeline stages generate under `mesh`: whole weights on every rank, as a pipeline on
    the training weights, or as a pipeline switched into (with its generation tp)."""
    if not pipelined_generation(mesh):
        return ("whole",)
    gen_tp = mesh.gen_tp or mesh.tp
    return ("pipelined",) if gen_tp == mesh.tp else ("switched", gen_tp)


class _Counted:
    """Wraps a (name, tensor) stream and counts what passes: the bytes a weight sync moved."""

    def __init__(self):
        self.bytes = self.tensors = 0

    def __call__(self, named):
        for name, tensor in named:
            self.bytes += tensor.numel() * tensor.element_size()
            self.tensors += 1
            yield name, tensor
