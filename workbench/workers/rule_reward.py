"""Rule-based rewards: a plain Python function (exact match, a unit-test sandbox, a verifier)
scored off the driver and called like a worker group (HybridFlow §5: non-neural reward modules).

    reward = RuleReward(arithmetic.score)            # fn(response_text, ground_truth) -> float
    scores = reward.compute_reward(generated)        # a DataFuture, like any group's call

Scoring runs in long-lived processes, started once per session and reused by every call: a
small pool of Ray actors (`RewardScorer`), each owning one child process that runs the
functions. A new process per call would cost seconds of imports each iteration (and Ray kills
idle task workers when the pools hold every CPU slot), so nothing here is started per call.

The time limit is enforced from outside the function: the scorer waits on its child with a
deadline and SIGKILLs it when the deadline passes, so a function that swallows exceptions,
ignores signals or deadlocks is still stopped. The error names the row being scored; a fresh
child replaces the killed one on the next call. A function that raises or returns NaN/inf
fails the call with an error naming the function and the row.

Each scoring call leaves one span per piece in the session's trace (`session.trace()`), on its
own row (pool "rule_reward", one rank per scoring process), tagged like a worker group's calls;
the span covers receiving the rows and scoring them in the child.
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import cloudpickle
import ray
import torch

from workbench import checks
from workbench.agents.env import sandbox_for
from workbench.agents.sandbox import SandboxLimits, ToolError, check_jail
from workbench.agents.tools import score_rows
from workbench.controller.future import CallInfo, DataFuture, describe_output
from workbench.controller.protocols import concat
from workbench.controller.worker import MAX_RECORDS, TRACE_GROUP, resolve_input
from workbench.data.batch import PAD_KEY, Batch
from workbench.errors import DispatchError, WorkbenchError
from workbench.mesh import Mesh
from workbench.tracing import CallRecord, CallTags, add_span_source, current_tags, new_call_number, take_answers

SCORER_NAMESPACE = "workbench"
SCORER_PREFIX = "workbench:reward_scorer:"
LOAD_TIMEOUT = 120.0
"""Seconds a scoring process may take to load a reward function (its imports), apart from the time limit."""
MAX_MESSAGE = 64 * 1024
"""Bytes a scoring child's message may take (a score, or an error's text)."""
SCORER_POOL = "rule_reward"
"""The pool (and role) name of scoring spans in the trace."""


class RuleRewardError(WorkbenchError):
    """The reward function failed, timed out or returned a non-finite value."""


class RuleReward:
    def __init__(
        self,
        fn: Callable[[str, str], float],
        chunk_size: int = 64,
        timeout: float = 30.0,
        output_key: str = "scores",
        text_key: str = "response_text",
        truth_key: str = "ground_truth",
        processes: int = 2,
        sandbox: SandboxLimits | None = None,
    ):
        """fn(text, truth) -> float, applied to batch[text_key] and batch[truth_key] per row;
        timeout: seconds allowed for one chunk of chunk_size rows (the process running the
        function is killed when it passes); processes: long-lived scoring processes shared by
        every RuleReward of the session (chunks are spread over them); sandbox: run fn in a
        jailed tool sandbox with these limits (reward code you did not write: a reward function
        is a tool without a policy), its `seconds` per chunk in place of `timeout`. A jailed
        function may use the standard library and installed packages; one defined in a notebook
        or a file of your own is sent by value."""
        checks.real("RuleReward", "timeout", timeout, 0, low_open=True, fix="give the seconds allowed per chunk, > 0")
        checks.whole("RuleReward", "chunk_size", chunk_size, fix="use a whole number of rows >= 1 per chunk")
        checks.whole("RuleReward", "processes", processes, fix="use a whole number of scoring processes >= 1")
        self.fn, self.chunk_size, self.timeout, self.processes = fn, chunk_size, timeout, processes
        self.output_key, self.text_key, self.truth_key = output_key, text_key, truth_key
        self.name = getattr(fn, "__qualname__", repr(fn))
        self.sandbox = None
        if sandbox is not None:
            check_jail(sandbox)  # here, on the driver, before a scorer starts one
            # Room for a chunk's scores in the answer (a JSON number is at most ~24 characters), and
            # each chunk in a fresh process: a sample's code cannot reach a later chunk's scores.
            self.sandbox = dataclasses.replace(
                sandbox, output_chars=max(sandbox.output_chars, 32 * chunk_size), calls_per_process=1
            )
        if ray.is_initialized():
            scorer_pool(processes)  # start (or find) the scoring processes while groups start

    def compute_reward(self, batch: Batch | DataFuture) -> DataFuture:
        if isinstance(batch, Batch):
            missing = [k for k in (self.text_key, self.truth_key) if k not in batch]
            if missing:
                raise DispatchError(
                    f"rule reward {self.name}: the batch has no column(s) {missing}; columns: "
                    f"{batch.keys()} (responses are decoded into {self.text_key!r} by generate_sequences)"
                )
            pieces = [batch[i : i + self.chunk_size] for i in range(0, len(batch), self.chunk_size)]
        else:  # one piece per source rank, each pulled from the source by a scorer directly
            count = len(batch.collect_ranks)
            pieces = [batch.slice(i, count) for i in range(count)]
        spec = (
            # The standalone cloudpickle: ray's would have the jail import ray to load it.
            cloudpickle.dumps(self.fn),
            self.name,
            self.timeout,
            self.output_key,
            self.text_key,
            self.truth_key,
            self.chunk_size,
            self.sandbox,
        )
        scorers = scorer_pool(self.processes)
        number = new_call_number()
        results = [
            scorers[i % len(scorers)].score.remote(spec, piece, {"call": number}) for i, piece in enumerate(pieces)
        ]
        metas, outputs = [r[0] for r in results], [r[1] for r in results]
        ranks = list(range(len(pieces)))
        future: DataFuture[Batch] = DataFuture(
            CallInfo("rule_reward", self.name, ranks), outputs, metas, ranks, concat, Mesh(dp=len(pieces))
        )
        future.trace_tags = SPANS.tag_call(number, current_tags(), len(pieces))  # the step clock adds to these
        return future

    compute_cost = compute_reward  # a rule cost (output_key="costs") is called like a cost model

    def process_ids(self) -> list[tuple[int, int]]:
        """(scorer actor pid, child pid) of each scoring process this reward uses."""
        return ray.get([s.pids.remote() for s in scorer_pool(self.processes)])

    def __repr__(self) -> str:
        return f"RuleReward({self.name}, chunk_size={self.chunk_size}, timeout={self.timeout})"


# The scorer handles of the current Ray cluster. Held here because Ray ends a (non-detached)
# actor when its last handle goes: without this, every call would start fresh processes.
_scorers: dict[str, list] = {}


def scorer_pool(size: int) -> list:
    """The first `size` scorer actors of this Ray cluster, started on first use and then reused
    until the cluster shuts down or `stop_scorers()` is called."""
    key = _cluster_key()
    if key not in _scorers:  # a new cluster: handles of an earlier one are dead
        _scorers.clear()
    pool = _scorers.setdefault(key, [])
    while len(pool) < size:
        pool.append(
            RewardScorer.options(  # type: ignore[attr-defined]  # an ActorClass: mypy skips class decorators
                name=f"{SCORER_PREFIX}{len(pool)}", namespace=SCORER_NAMESPACE, get_if_exists=True
            ).remote()
        )
    return pool[:size]


def _cluster_key() -> str:
    context = ray.get_runtime_context()
    return f"{context.gcs_address}/{context.get_job_id()}"


def stop_scorers() -> None:
    """Kill the scorer processes of this Ray cluster (new ones start on the next call)."""
    for pool in _scorers.values():
        for actor in pool:
            ray.kill(actor, no_restart=True)
    _scorers.clear()
    SPANS.drains.clear()


# ---- spans in the trace: the driver side ---------------------------------------------------------
class ScorerSpans:
    """The scoring spans of every scorer of this Ray cluster, for the session's trace (a
    workbench.tracing.SpanSource), tagged with their calls' tags as HostSet tags a group's."""

    def __init__(self):
        self.call_tags = CallTags()
        self.drains: list = []
        """drain_records calls that have not answered yet (the next drain collects them)."""

    def tag_call(self, number: int, tags: dict, pieces: int) -> dict:
        """Keep a scoring call's tags until the spans of its `pieces` are drained."""
        return self.call_tags.keep(number, tags, pieces)

    def request_records(self) -> None:
        if ray.is_initialized():
            self.drains += [s.drain_records.remote() for s in _scorers.get(_cluster_key(), [])]

    def take_records(self, answers: dict) -> list[CallRecord]:
        records, self.drains = take_answers(self.drains, answers)
        for r in records:
            r.extra.update(self.call_tags.of(r.extra.get("call")))
            self.call_tags.settle(r.extra.get("call"))
        return records


SPANS = ScorerSpans()
add_span_source(SPANS)


# ---- the scoring processes ------------------------------------------------------------------------
# num_cpus=0: scoring is light, and pools may have reserved every CPU slot. drain_records runs
# in its own thread, so spans reach the driver while a slow function holds the scorer.
@ray.remote(num_cpus=0, concurrency_groups={TRACE_GROUP: 1})  # type: ignore[call-overload]  # not in Ray's stubs
class RewardScorer:
    """One long-lived scoring process: keeps a child that runs reward functions, and replaces
    the child only when it had to be killed (time limit) or died."""

    def __init__(self):
        self.child = None
        self.records: deque[CallRecord] = deque(maxlen=MAX_RECORDS)
        self.counts: dict[str, int] = {}
        self.index = int(ray.get_runtime_context().get_actor_name().rpartition(":")[2])  # its rank in the trace
        self._start_child()

    def _start_child(self) -> None:
        # spawn, not fork: this process has Ray's threads, which a fork would copy mid-lock.
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.child = ctx.Process(target=_child_loop, args=(child_conn,), daemon=True, name="workbench-reward")
        self.child.start()
        child_conn.close()

    def _kill_child(self) -> None:
        self.child.kill()
        self.child.join(5)
        self.conn.close()
        self.child = None

    def pids(self) -> tuple[int, int]:
        if self.child is None or not self.child.is_alive():
            self._start_child()
        return os.getpid(), self.child.pid

    @ray.method(concurrency_group=TRACE_GROUP)
    def drain_records(self) -> list[CallRecord]:
        """Hand over the spans recorded so far (popleft is atomic beside a call in flight)."""
        records = []
        while self.records:
            records.append(self.records.popleft())
        return records

    @ray.method(num_returns=2)
    def score(self, spec: tuple, rows, tags: dict | None = None):
        fn_bytes, name, timeout, output_key, text_key, truth_key, chunk_size, sandbox = spec
        start = time.time()
        rows = resolve_input(rows)
        fetched, out = time.time(), None
        try:
            texts, truths = list(rows[text_key]), list(rows[truth_key])
            uids = list(rows["uid"]) if "uid" in rows else list(range(len(rows)))
            scores: list[float] = []
            for first in range(0, len(rows), chunk_size):  # one deadline per chunk of chunk_size rows
                end = min(first + chunk_size, len(rows))
                chunk = (fn_bytes, name, texts[first:end], truths[first:end], uids[first:end])
                if sandbox is not None:
                    scores += self._score_jailed(sandbox, *chunk)
                else:
                    scores += self._score_chunk(timeout, *chunk)
            out = Batch({output_key: torch.tensor(scores, dtype=torch.float32)})
            if PAD_KEY in rows.tensors.keys():
                out.tensors[PAD_KEY] = rows.tensors[PAD_KEY]
            return describe_output(out), out
        finally:
            self._record(name, start, fetched, rows, out, tags or {})

    def _record(self, name: str, start: float, fetched: float, rows, out: Batch | None, tags: dict) -> None:
        """One span of a score call; out is None when the call failed."""
        sequence = self.counts[name] = self.counts.get(name, -1) + 1
        self.records.append(
            CallRecord(
                call_id=sequence,
                role=SCORER_POOL,
                method=name,
                rank=self.index,
                pool=SCORER_POOL,
                pid=os.getpid(),
                start=start,
                fetched=fetched,
                end=time.time(),
                bytes_in=describe_output(rows).nbytes,
                bytes_out=describe_output(out).nbytes,
                ok=out is not None,
                extra={**tags, "rows": len(rows)},
            )
        )

    def _score_jailed(self, sandbox: SandboxLimits, fn_bytes, name, texts, truths, uids) -> list[float]:
        """A chunk scored in this process's jailed sandbox for `sandbox` (workbench.agents)."""
        try:
            answer = sandbox_for(sandbox).call(score_rows, (fn_bytes, texts, truths), tool=name)
        except ToolError as err:
            raise RuleRewardError(
                f"rule reward {name} {err.detail} on a chunk of {len(texts)} rows (uid={uids[0]}..{uids[-1]}); "
                f"it runs in a jail (RuleReward(sandbox=...))"
            ) from None
        scores, row = answer.get("scores"), answer.get("row") if isinstance(answer, dict) else None
        if isinstance(scores, list) and len(scores) == len(texts) and all(type(x) in (int, float) for x in scores):
            return [float(score) for score in scores]
        if type(row) is not int or not 0 <= row < len(texts) or not isinstance(answer.get("returned", ""), str):
            raise RuleRewardError(f"rule reward {name} answered out of shape from its jail: {str(answer):.200}")
        where = f"on row uid={uids[row]} (response {texts[row]!r:.80})"
        if "returned" in answer:
            raise RuleRewardError(f"rule reward {name} returned {answer['returned']} {where}")
        raise RuleRewardError(f"rule reward {name} raised {where}: {str(answer.get('raised')):.4000}")

    def _score_chunk(self, timeout, fn_bytes, name, texts, truths, uids) -> list[float]:
        if self.child is None or not self.child.is_alive():
            self._start_child()
        self.conn.send((fn_bytes, texts, truths))
        # Loading the function (importing its modules, in a fresh child) is not scoring: it
        # gets its own, generous limit; the chunk's deadline starts once the function is loaded.
        self._receive(
            max(LOAD_TIMEOUT, timeout), name, f"while loading the function (limit {max(LOAD_TIMEOUT, timeout)} s)"
        )
        deadline = time.monotonic() + timeout
        scores: list[float] = []
        while len(scores) < len(texts):
            row = len(scores)
            where = f"on row uid={uids[row]} (response {texts[row]!r:.80})"
            kind, value = self._receive(deadline - time.monotonic(), name, where, timeout, len(texts))
            if kind == "raised":
                raise RuleRewardError(f"rule reward {name} raised {where}: {value}")
            if not math.isfinite(value):
                self._drain(len(texts) - row - 1, deadline)
                raise RuleRewardError(f"rule reward {name} returned {value} {where}")
            scores.append(value)
        return scores

    def _receive(self, seconds: float, name: str, where: str, timeout: float | None = None, rows: int = 0):
        """The child's next message, or kill the child and raise once `seconds` pass."""
        if not self.conn.poll(max(0.0, seconds)):
            self._kill_child()
            limit = f"more than {timeout} s on a chunk of {rows} rows" if timeout else "too long"
            raise RuleRewardError(
                f"rule reward {name} took {limit}; its process was killed {where}. "
                f"Make the function faster, or raise RuleReward(timeout=...)"
            )
        try:
            message = json.loads(self.conn.recv_bytes(MAX_MESSAGE))  # data, never a pickle: the child runs user code
        except (EOFError, OSError, ValueError, RecursionError):
            self.child.join(5)
            code = self.child.exitcode
            self._kill_child()
            raise RuleRewardError(f"rule reward {name} ended its process (exit code {code}) {where}") from None
        if not (isinstance(message, list) and len(message) == 2 and message[0] in ("loaded", "ok", "raised")):
            self._kill_child()
            raise RuleRewardError(f"rule reward {name}'s process sent a message out of shape {where}")
        if message[0] == "ok" and type(message[1]) not in (int, float):
            message = ["raised", f"returned {message[1]!r:.80}, not a number"]
        return message

    def _drain(self, remaining: int, deadline: float) -> None:
        """Read the rest of an abandoned chunk so the next one starts clean (or kill the child)."""
        for _ in range(remaining):
            if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                self._kill_child()
                return
            try:
                if json.loads(self.conn.recv_bytes(MAX_MESSAGE))[0] == "raised":
                    return
            except (EOFError, OSError, ValueError):
                self._kill_child()
                return


def _child_loop(conn) -> None:
    """The child: score chunks forever. It acknowledges each chunk once the function is loaded,
    then sends one message per row (so the parent knows which row a hang or crash was on). A
    function that raises ends its chunk."""
    torch.set_num_threads(1)
    loaded: bytes | None = None
    fn: Any = None  # the reward function, unpickled from the first chunk (set before any row is scored)
    while True:
        try:
            fn_bytes, texts, truths = conn.recv()
        except EOFError:
            return
        if fn_bytes != loaded:
            fn, loaded = cloudpickle.loads(fn_bytes), fn_bytes
        conn.send_bytes(b'["loaded", null]')
        for text, truth in zip(texts, truths):
            try:
                value = float(fn(text, truth))
            except Exception as err:
                conn.send_bytes(json.dumps(["raised", f"{err!r}\n{traceback.format_exc(limit=-3)}"[-8000:]]).encode())
                break
            conn.send_bytes(json.dumps(["ok", value]).encode())
