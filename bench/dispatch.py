"""Dispatch overhead of the single controller vs bare Ray actor calls, measured in one run.

Three figures, each as our median / bare Ray's median (goal: <= 1.2):
  trivial  - a registered no-op on a 4-worker group, `.get()` on the driver, vs
             ray.get of the same no-op on 4 bare actors;
  transfer - a 4 MB Batch made by a 2-worker group and consumed by another 2-worker group
             (each destination rank pulls its half worker to worker), vs bare actors passing
             object refs the same way;
  driver   - a small Batch from the driver (64 prompts of 16 tokens with their text, what an
             iteration's generate call sends) split over a 2-worker group, vs bare actors
             each given its half as a plain argument.
Rounds alternate ours/bare so both see the same machine load. Last line: one JSON object.
"""

import argparse
import json
import statistics
import time

import ray
import torch

from workbench import DP_PROTO, ONE_TO_ALL, Batch, Session, Worker, register

MB = 1 << 20


class BenchWorker(Worker):
    @register(ONE_TO_ALL)
    def noop(self):
        return None

    @register(DP_PROTO)  # an int argument goes to every rank; the Batches concatenate
    def make(self, nbytes: int) -> Batch:
        rows = 64
        return Batch({"data": torch.ones(rows, nbytes // rows // 4, dtype=torch.float32)})

    @register(DP_PROTO)
    def consume(self, batch: Batch) -> float:
        return float(batch["data"][0, 0])

    @register(DP_PROTO)
    def rows(self, batch: Batch) -> int:
        return len(batch)


class BareActor:
    def noop(self):
        return None

    def make(self, nbytes: int) -> torch.Tensor:
        return torch.ones(64, nbytes // 64 // 4, dtype=torch.float32)

    def consume(self, tensor: torch.Tensor) -> float:
        return float(tensor[0, 0])

    def rows(self, batch: Batch) -> int:
        return len(batch)


def prompt_batch(rows: int = 64, tokens: int = 16) -> Batch:
    ids = torch.randint(3, 200, (rows, tokens))
    return Batch(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": ids.clone()},
        columns={"prompt": [f"{i} + {i} =" for i in range(rows)], "ground_truth": [str(2 * i) for i in range(rows)]},
    )


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(ours, bare, warmup: int, rounds: int) -> tuple[list[float], list[float]]:
    """Seconds of each, alternating call by call so both see the same machine load."""
    for _ in range(warmup):
        ours(), bare()
    pairs = [(timed(ours), timed(bare)) for _ in range(rounds)]
    return [a for a, _ in pairs], [b for _, b in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200, help="trivial-call rounds")
    parser.add_argument("--transfer-rounds", type=int, default=80)
    parser.add_argument("--mb", type=float, default=4.0, help="batch size in MB for the transfer")
    args = parser.parse_args()
    nbytes = int(args.mb * MB)

    session = Session(num_devices=16)
    try:
        trivial = session.group("trivial", BenchWorker, session.pool("trivial", 4))
        source = session.group("source", BenchWorker, session.pool("source", 2))
        sink = session.group("sink", BenchWorker, session.pool("sink", 2))
        bare_pool = session.pool("bare", 8)
        Bare = ray.remote(BareActor)
        bare = [Bare.options(**bare_pool.scheduling(i)).remote() for i in range(8)]
        bare_trivial, bare_source, bare_sink = bare[:4], bare[4:6], bare[6:]
        ray.get([a.noop.remote() for a in bare])

        def ours_trivial():
            trivial.noop().get()

        def bare_trivial_call():
            ray.get([a.noop.remote() for a in bare_trivial])

        def ours_transfer():
            # Each source rank makes half the batch; each sink rank pulls one half.
            sink.consume(source.make(nbytes // 2)).get()

        def bare_transfer():
            refs = [a.make.remote(nbytes // 2) for a in bare_source]
            ray.get([b.consume.remote(r) for b, r in zip(bare_sink, refs)])

        ours, raw = alternate(ours_trivial, bare_trivial_call, 20, args.rounds)
        t_ours, t_raw = alternate(ours_transfer, bare_transfer, 3, args.transfer_rounds)

        prompts = prompt_batch()
        halves = prompts.chunk(2)

        def ours_driver():
            source.rows(prompts).get()

        def bare_driver():
            ray.get([a.rows.remote(h) for a, h in zip(bare_source, halves)])

        d_ours, d_raw = alternate(ours_driver, bare_driver, 20, args.rounds)
    finally:
        session.shutdown()

    med = statistics.median
    result = {
        "bench": "dispatch",
        "workers": 4,
        "trivial_ms": round(med(ours) * 1e3, 3),
        "trivial_bare_ms": round(med(raw) * 1e3, 3),
        "trivial_ratio": round(med(ours) / med(raw), 3),
        "transfer_mb": args.mb,
        "transfer_ms": round(med(t_ours) * 1e3, 3),
        "transfer_bare_ms": round(med(t_raw) * 1e3, 3),
        "transfer_ratio": round(med(t_ours) / med(t_raw), 3),
        "driver_batch_ms": round(med(d_ours) * 1e3, 3),
        "driver_batch_bare_ms": round(med(d_raw) * 1e3, 3),
        "driver_batch_ratio": round(med(d_ours) / med(d_raw), 3),
        "rounds": args.rounds,
        "transfer_rounds": args.transfer_rounds,
        "goal_ratio": 1.2,
    }
    print(
        f"trivial call, 4 workers: ours {result['trivial_ms']} ms vs bare Ray {result['trivial_bare_ms']} ms "
        f"-> x{result['trivial_ratio']}"
    )
    print(
        f"{args.mb:g} MB batch between two 2-worker groups: ours {result['transfer_ms']} ms vs bare Ray "
        f"{result['transfer_bare_ms']} ms -> x{result['transfer_ratio']}"
    )
    print(
        f"64-prompt Batch from the driver to a 2-worker group: ours {result['driver_batch_ms']} ms vs bare Ray "
        f"{result['driver_batch_bare_ms']} ms -> x{result['driver_batch_ratio']}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
