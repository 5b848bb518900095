"""A test-only actor that can corrupt its next weight switch (shipped to Ray workers by value)."""

from workbench.controller import ONE_TO_ALL, register
from workbench.workers import ActorRolloutRefWorker


class CorruptibleActor(ActorRolloutRefWorker):
    @register(ONE_TO_ALL)
    def corrupt_next_switch(self, rank: int, on: bool = True) -> None:
        """On `rank`, add 1.0 to the last element of every gathered generation piece: a weight
        that belongs to another rank's training piece, as a broken gather would misplace it."""
        engine = self.hybrid
        engine.__dict__.pop("_generation_piece", None)  # back to the class's method
        if on and self.rank == rank:
            honest = engine._generation_piece

            def corrupted(gathered, piece, dim):
                out = honest(gathered, piece, dim)
                out.reshape(-1)[-1] += 1.0
                return out

            engine._generation_piece = corrupted
