"""Rule-based rewards: plain Python functions (exact match, a unit-test sandbox, a verifier)
scored off the driver and called like a worker group (HybridFlow §5: non-neural reward modules).

    reward = RuleReward(arithmetic.score)            # fn(response_text, ground_truth) -> float
    scores = reward.compute_reward(generated)        # a DataFuture, like any group's call
    RuleReward(["rewards.py:correct", {"function": "rewards.py:form", "weight": 0.2}])

A function may also take the row's other columns (`fn(response, ground_truth, **row)`) or be
verl's `compute_score(data_source, solution_str, ground_truth, extra_info)`; several are
weighted into `scores`, each kept as its own column `reward/<name>` (workbench.data.rewards).

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
from collections import deque
from collections.abc import Callable

import cloudpickle
import ray
import torch

from workbench import checks
from workbench.agents.env import sandbox_for
from workbench.agents.sandbox import SandboxLimits, ToolError, check_jail
from workbench.agents.tools import score_rows
from workbench.controller.future import CallInfo, DataFuture, describe_output
from workbench.controller.protocols import concat
from workbench.controller.worker import MAX_RECORDS, TRACE_GROUP, node_address, resolve_input
from workbench.controller.worker_group import actor_state
from workbench.data.batch import PAD_KEY, Batch
from workbench.data.rewards import RewardFunction, RewardSet
from workbench.errors import DispatchError, WorkbenchError
from workbench.mesh import Mesh
from workbench.tracing import (
    CallRecord,
    CallTags,
    add_span_source,
    current_tags,
    new_call_number,
    take_answers,
)
from workbench.workers.reward_child import child_loop

SCORER_NAMESPACE = "workbench"
SCORER_PREFIX = "workbench:reward_scorer:"
LOAD_TIMEOUT = 120.0
"""Seconds a scoring process may take to load a reward function (its imports), apart from the time limit."""
MAX_MESSAGE = 64 * 1024
"""Bytes a scoring child's message may take (a score, or an error's text)."""
SCORER_POOL = "rule_reward"
"""The pool (and role) name of scoring spans in the trace."""
Scored = tuple[list[list[float]], list[list[int]]]
"""Rows scored: each function's value per row, and which functions fell back on each row."""


class RuleRewardError(WorkbenchError):
    """The reward function failed, timed out or returned a non-finite value."""


class RuleReward:
    def __init__(
        self,
        fn: Callable[..., float] | str | RewardFunction | RewardSet | list,
        chunk_size: int = 64,
        timeout: float = 30.0,
        output_key: str = "scores",
        text_key: str = "response_text",
        truth_key: str = "ground_truth",
        processes: int = 2,
        sandbox: SandboxLimits | None = None,
    ):
        """fn(text, truth) -> float, applied to batch[text_key] and batch[truth_key] per row (or
        any reward function, reference or list of them: workbench.data.rewards.RewardSet.of);
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
        self.rewards = RewardSet.of(fn)
        self.chunk_size, self.timeout, self.processes = chunk_size, timeout, processes
        self.output_key, self.text_key, self.truth_key = output_key, text_key, truth_key
        self.name = "+".join(self.rewards.names)
        self.sandbox = None
        if sandbox is not None:
            check_jail(sandbox)  # here, on the driver, before a scorer starts one
            # Room for a chunk's scores in the answer (a JSON number is at most ~24 characters), and
            # each chunk in a fresh process: a sample's code cannot reach a later chunk's scores.
            self.sandbox = dataclasses.replace(
                sandbox,
                output_chars=max(sandbox.output_chars, 40 * chunk_size * len(self.rewards.functions)),
                calls_per_process=1,
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
            cloudpickle.dumps(self.rewards),
            self.name,
            [(f.name, f.weight, f.fallback) for f in self.rewards.functions],
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
                name=scorer_name(len(pool)), namespace=SCORER_NAMESPACE, get_if_exists=True
            ).remote()
        )
    return pool[:size]


def restart_dead_scorers(wait: float = 30.0) -> int:
    """Replace the scorer actors Ray reports dead (killed, or on a host that was lost) with
    fresh ones under their names (once Ray has released a dead one's name: up to `wait` s).
    How many were replaced."""
    replaced = 0
    for pool in _scorers.values():
        for index, actor in enumerate(pool):
            dead = actor._actor_id.hex()
            if actor_state(dead) != "DEAD":
                continue
            ray.kill(actor, no_restart=True)  # Ray keeps a dead actor's name until it is killed
            deadline = time.monotonic() + wait
            while pool[index]._actor_id.hex() == dead and time.monotonic() < deadline:
                pool[index] = RewardScorer.options(  # type: ignore[attr-defined]
                    name=scorer_name(index), namespace=SCORER_NAMESPACE, get_if_exists=True
                ).remote()
                time.sleep(0.2)
            replaced += pool[index]._actor_id.hex() != dead
    return replaced


def scorer_name(index: int) -> str:
    """The name of this driver's scorer `index`. Per driver (Ray job): the actors end with the
    driver that started them, so drivers attached to one cluster must not share them (one
    detaching would take the others' scorers with it)."""
    return f"{SCORER_PREFIX}{ray.get_runtime_context().get_job_id()}:{index}"


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
        self.child = ctx.Process(target=child_loop, args=(child_conn,), daemon=True, name="workbench-reward")
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
        fn_bytes, name, parts, timeout, output_key, text_key, truth_key, chunk_size, sandbox = spec
        start = time.time()
        rows = resolve_input(rows)
        fetched, out = time.time(), None
        try:
            texts, truths = list(rows[text_key]), list(rows[truth_key])
            uids = list(rows["uid"]) if "uid" in rows else list(range(len(rows)))
            # The row's other columns (data_source, extra_info, ...), for functions that take them.
            others = [k for k in rows.columns if k not in (text_key, truth_key)]
            columns = [{k: rows.columns[k][i] for k in others} for i in range(len(rows))]
            values: list[list[float]] = []
            failed: list[list[int]] = []
            for first in range(0, len(rows), chunk_size):  # one deadline per chunk of chunk_size rows
                end = min(first + chunk_size, len(rows))
                chunk = (
                    fn_bytes,
                    name,
                    parts,
                    texts[first:end],
                    truths[first:end],
                    columns[first:end],
                    uids[first:end],
                )
                got = self._score_jailed(sandbox, *chunk) if sandbox is not None else self._score_chunk(timeout, *chunk)
                values += got[0]
                failed += got[1]
            out = scored_batch(parts, values, failed, output_key)
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
                node=node_address(),
                start=start,
                fetched=fetched,
                end=time.time(),
                bytes_in=describe_output(rows).nbytes,
                bytes_out=describe_output(out).nbytes,
                ok=out is not None,
                extra={**tags, "rows": len(rows)},
            )
        )

    def _score_jailed(self, sandbox: SandboxLimits, fn_bytes, name, parts, texts, truths, columns, uids) -> Scored:
        """A chunk scored in this process's jailed sandbox for `sandbox` (workbench.agents)."""
        try:
            answer = sandbox_for(sandbox).call(score_rows, (fn_bytes, texts, truths, columns), tool=name)
        except ToolError as err:
            # Out of time or memory: the fallbacks score the chunk. Anything else (a function the jail
            # cannot load, an answer cut short, a jail that did not start) is a mistake to name.
            if err.kind in ("timeout", "memory") and all(fallback is not None for _, _, fallback in parts):
                return _fell_back(parts, len(texts))
            raise RuleRewardError(
                f"rule reward {name} {err.detail} on a chunk of {len(texts)} rows (uid={uids[0]}..{uids[-1]}); "
                f"it runs in a jail (RuleReward(sandbox=...))"
            ) from None
        if isinstance(answer, dict) and "values" in answer:
            rows = list(zip(answer["values"], answer.get("failed", ()), strict=False))
            if len(rows) == len(texts) and all(_in_shape(v, f, len(parts)) for v, f in rows):
                return [v for v, _ in rows], [f for _, f in rows]
        row = answer.get("row") if isinstance(answer, dict) else None
        if type(row) is not int or not 0 <= row < len(texts) or not isinstance(answer.get("raised"), str):
            raise RuleRewardError(f"rule reward {name} answered out of shape from its jail: {str(answer):.200}")
        raise RuleRewardError(
            f"rule reward {name} raised on row uid={uids[row]} (response {texts[row]!r:.80}): {answer['raised']:.4000}"
        )

    def _score_chunk(self, timeout, fn_bytes, name, parts, texts, truths, columns, uids) -> Scored:
        """The chunk's rows scored in the child, one deadline for the chunk. With a fallback for every
        function, a row that hangs or ends the process scores the fallbacks and the rest of the
        chunk goes on in a fresh child, with a deadline of its own."""
        values: list[list[float]] = []
        failed: list[list[int]] = []
        falls_back = all(fallback is not None for _, _, fallback in parts)
        while len(values) < len(texts):
            first = len(values)
            try:
                got = self._score_rows(
                    timeout, fn_bytes, name, parts, *(x[first:] for x in (texts, truths, columns, uids))
                )
            except _Stopped as stopped:
                if not falls_back:
                    raise stopped.error from None
                got = stopped.scored
                rest = _fell_back(parts, 1)  # the row it stopped on
                got = (got[0] + rest[0], got[1] + rest[1])
            values += got[0]
            failed += got[1]
        return values, failed

    def _score_rows(self, timeout, fn_bytes, name, parts, texts, truths, columns, uids) -> Scored:
        if self.child is None or not self.child.is_alive():
            self._start_child()
        self.conn.send((fn_bytes, texts, truths, columns))
        # Loading the function (importing its modules, in a fresh child) is not scoring: it
        # gets its own, generous limit; the chunk's deadline starts once the function is loaded.
        self._receive(
            max(LOAD_TIMEOUT, timeout), name, f"while loading the function (limit {max(LOAD_TIMEOUT, timeout)} s)"
        )
        deadline = time.monotonic() + timeout
        values: list[list[float]] = []
        failed: list[list[int]] = []
        while len(values) < len(texts):
            row = len(values)
            where = f"on row uid={uids[row]} (response {texts[row]!r:.80})"
            try:
                message = self._receive(deadline - time.monotonic(), name, where, timeout, len(texts), len(parts))
            except RuleRewardError as error:  # out of time or the process ended: the rows scored so far
                raise _Stopped(error, (values, failed)) from None
            if message[0] == "raised":
                raise RuleRewardError(f"rule reward {name} raised {where}: {message[1]}")
            values.append(message[1])
            failed.append(message[2])
        return values, failed

    def _receive(
        self, seconds: float, name: str, where: str, timeout: float | None = None, rows: int = 0, parts: int = 0
    ):
        """The child's next message, or kill the child and raise once `seconds` pass."""
        if not self.conn.poll(max(0.0, seconds)):
            self._kill_child()
            limit = f"more than {timeout} s on a chunk of {rows} rows" if timeout else "too long"
            raise RuleRewardError(
                f"rule reward {name} took {limit}; its process was killed {where}. "
                f"Make the function faster, or raise RuleReward(timeout=...) (data.reward_timeout), or give "
                f"the functions a fallback score"
            )
        try:
            message = json.loads(self.conn.recv_bytes(MAX_MESSAGE))  # data, never a pickle: the child runs user code
        except (EOFError, OSError, ValueError, RecursionError):
            self.child.join(5)
            code = self.child.exitcode
            self._kill_child()
            raise RuleRewardError(f"rule reward {name} ended its process (exit code {code}) {where}") from None
        shaped = (
            isinstance(message, list)
            and message
            and (
                (message[0] == "loaded" and len(message) == 2)
                or (message[0] == "raised" and len(message) == 2 and isinstance(message[1], str))
                or (message[0] == "ok" and len(message) == 3 and _in_shape(message[1], message[2], parts))
            )
        )
        if not shaped:
            self._kill_child()
            raise RuleRewardError(f"rule reward {name}'s process sent a message out of shape {where}")
        return message


class _Stopped(Exception):
    """A chunk's child stopped (out of time, or its process ended) after scoring some rows."""

    def __init__(self, error: RuleRewardError, scored: Scored):
        self.error, self.scored = error, scored


def _in_shape(values, failed, parts: int) -> bool:
    """One row's answer: a finite number per function, and the indices of those that fell back."""
    return (
        isinstance(values, list)
        and len(values) == parts
        and all(type(v) in (int, float) and math.isfinite(v) for v in values)
        and isinstance(failed, list)
        and all(type(i) is int and 0 <= i < parts for i in failed)
    )


def _fell_back(parts, rows: int) -> Scored:
    """`rows` rows scored by every function's fallback."""
    return [[float(fallback) for _, _, fallback in parts] for _ in range(rows)], [list(range(len(parts)))] * rows


def scored_batch(parts, values: list[list[float]], failed: list[list[int]], output_key: str) -> Batch:
    """The scores (each row's weighted sum), and with several functions (or one weighted) each
    one's own value (`reward/<name>`, `cost/<name>` for costs); with fallbacks, how many fell
    back per row."""
    prefix = {"scores": "reward", "costs": "cost"}.get(output_key, output_key)
    total = [sum(weight * v for (_, weight, _), v in zip(parts, row)) for row in values]
    tensors = {output_key: torch.tensor(total, dtype=torch.float32)}
    if len(parts) > 1 or parts[0][1] != 1.0:  # each function's own value, unweighted
        for i, (name, _, _) in enumerate(parts):
            tensors[f"{prefix}/{name}"] = torch.tensor([row[i] for row in values], dtype=torch.float32)
    if any(fallback is not None for _, _, fallback in parts):
        tensors[f"{prefix}/fallbacks"] = torch.tensor([float(len(f)) for f in failed], dtype=torch.float32)
    return Batch(tensors)
