"""A test-only actor that can corrupt its next weight switch and compare the switch's two
executors on its live weights (shipped to Ray workers by value)."""

import torch

from workbench.controller import ONE_TO_ALL, register
from workbench.engines.tensor_parallel import local, shard_dim
from workbench.workers import ActorRolloutRefWorker


class CorruptibleActor(ActorRolloutRefWorker):
    @register(ONE_TO_ALL)
    def corrupt_next_switch(self, rank: int, on: bool = True) -> None:
        """On `rank`, add 1.0 to the last element of every gathered generation piece: a weight
        that belongs to another rank's training piece, as a broken gather would misplace it."""
        engine = self.generation.hybrid
        engine.__dict__.pop("_generation_piece", None)  # back to the class's method
        if on and self.rank == rank:
            honest = engine._generation_piece

            def corrupted(gathered, piece, dim):
                out = honest(gathered, piece, dim)
                out.reshape(-1)[-1] += 1.0
                return out

            engine._generation_piece = corrupted

    @register(ONE_TO_ALL)
    def use_transition_executor(self, executor: str) -> None:
        """Switch by `executor` from the next generation on (until the layout changes)."""
        self.generation.hybrid.executor = executor

    @register(ONE_TO_ALL)
    def switch_by_each_executor(self) -> dict:
        """Switch to generation by all-gather, back, then by reallocation, back: per executor the
        switch's stats, whether each cut training piece lives inside its generation piece while
        generating and came back bit-identical (own contiguous storage) after; and the names of
        the generation pieces that differ between the two."""
        engine, executor = self.generation.hybrid, self.generation.hybrid.executor
        engine.to_training()
        cut = _cut_pairs(engine)
        before = {name: local(train).clone() for name, train, _ in cut}
        result, generated = {}, {}
        for way in ("allgather", "reallocate"):
            engine.executor = way
            stats = engine.to_generation()
            generated[way] = {name: local(gen).clone() for name, _, gen in cut}
            inside = [_same_storage(local(train), local(gen)) for _, train, gen in cut]
            engine.to_training()
            restored = [
                torch.equal(local(train), before[name]) and local(train).is_contiguous() for name, train, _ in cut
            ]
            result[way] = {"stats": stats.as_dict(), "inside": all(inside), "restored": all(restored)}
        engine.executor = executor
        result["different"] = [
            n for n in before if not torch.equal(generated["allgather"][n], generated["reallocate"][n])
        ]
        return result


def _cut_pairs(engine):
    return [(name, train, gen) for name, train, gen in engine.pairs if shard_dim(train) is not None]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
