"""Trace spans reach the driver while work runs, none is lost, and each is tied to its call,
iteration and step."""

import time

import ray
import torch

from tests.controller.workers import EchoWorker
from workbench import Batch, tags
from workbench.clock import StepClock
from workbench.controller.worker_group import take_answers
from workbench.tracing import CallRecord, CallTags, add_span_source, load_records, remove_span_source, save_records


def rows(n):
    return Batch({"x": torch.arange(float(n))}, {"uid": [str(i) for i in range(n)]})


def test_trace_answers_beside_a_long_call_and_loses_no_span(session):
    group = session.group("busy", EchoWorker, session.pool("two", 2))
    for _ in range(3):
        group.double(rows(4)).get()
    long_call = group.sleep(8.0)
    group.double(rows(4))  # queued behind the long call
    # Drain repeatedly while the long call holds both ranks: the answers must not wait for it,
    # and the finished calls' spans are there.
    for _ in range(3):
        spans = [r for r in session.trace() if r.role == "busy"]
        ready, _ = ray.wait(long_call.outputs, num_returns=len(long_call.outputs), timeout=0)
        assert not ready, "trace() waited for the long call to finish"
    assert sorted((r.method, r.rank) for r in spans) == [("double", 0)] * 3 + [("double", 1)] * 3
    long_call.get()
    group.double(rows(4)).get()
    spans = [r for r in session.trace() if r.role == "busy"]
    # Every call on every rank exactly once: 5 doubles and one sleep, on 2 ranks.
    assert sorted((r.method, r.rank) for r in spans) == sorted(
        [("double", 0)] * 5 + [("double", 1)] * 5 + [("sleep", 0), ("sleep", 1)]
    )
    assert len({(r.extra["call"], r.rank) for r in spans}) == len(spans)


def test_spans_carry_their_call_and_tags(session):
    group = session.group("tagged", EchoWorker, session.pool("two", 2))
    with tags(step="probe", note="mine"):
        group.double(rows(4)).get()
    group.double(rows(4)).get()
    spans = [r for r in session.trace() if r.role == "tagged"]
    first, second = sorted({r.extra["call"] for r in spans})
    assert {(r.rank, r.extra.get("step"), r.extra.get("note")) for r in spans if r.extra["call"] == first} == {
        (0, "probe", "mine"),
        (1, "probe", "mine"),
    }
    assert all("step" not in r.extra for r in spans if r.extra["call"] == second)


def test_step_clock_tags_spans_with_iteration_and_step(session):
    group = session.group("clocked", EchoWorker, session.pool("two", 2))
    clock = StepClock()
    for _ in range(2):
        gen = clock.launch("gen", group.double(rows(4)))
        clock.launch("values", group.double(gen), gen)
        clock.report()
    spans = [r for r in session.trace() if r.role == "clocked"]
    assert sorted((r.extra["iteration"], r.extra["step"]) for r in spans) == [
        (1, "gen"),
        (1, "gen"),
        (1, "values"),
        (1, "values"),
        (2, "gen"),
        (2, "gen"),
        (2, "values"),
        (2, "values"),
    ]


def test_records_round_trip_through_json_lines(session, tmp_path):
    group = session.group("saved", EchoWorker, session.pool("two", 2))
    with tags(step="s"):
        group.double(rows(4)).get()
    spans = [r for r in session.trace() if r.role == "saved"]
    path = save_records(spans[:1], tmp_path / "trace.jsonl")
    save_records(spans[1:], path, append=True)
    with path.open("a") as f:
        f.write('{"call_id": 3, "role": "half-writ')  # a writer caught mid-line
    assert load_records(path) == spans


def test_a_span_recorded_inside_a_call_gets_the_call_tags(session):
    group = session.group("inner", EchoWorker, session.pool("one", 1))
    with tags(step="sync"):
        group.record_inner().get()
    spans = [r for r in session.trace() if r.role == "inner"]
    inner = [r for r in spans if r.method == "inner.span"]
    outer = [r for r in spans if r.method == "record_inner"]
    assert len(inner) == 1 and inner[0].extra["step"] == "sync" and inner[0].extra["call"] == outer[0].extra["call"]


def test_the_session_keeps_only_the_newest_spans_up_to_its_limit(session):
    group = session.group("bounded", EchoWorker, session.pool("two", 2))
    limit, dropped = session.max_trace_records, session.dropped_records
    try:
        session.max_trace_records = 6
        for _ in range(5):  # 10 spans: the oldest 4 go
            group.double(rows(4)).get()
        spans = session.trace()
        assert len(spans) == len(session.records) == 6
        calls = sorted({r.extra["call"] for r in spans})
        assert len(calls) == 3 and sorted(r.rank for r in spans) == [0, 0, 0, 1, 1, 1]
        assert session.dropped_records >= dropped + 4
        group.double(rows(4)).get()
        newest = session.trace()
        assert len(newest) == 6 and sorted({r.extra["call"] for r in newest})[:2] == calls[1:]
    finally:
        session.max_trace_records = limit


def test_spans_since_hands_over_each_span_once_and_skips_dropped_ones(session):
    group = session.group("cursor", EchoWorker, session.pool("two", 2))
    _, cursor = session.spans_since()
    group.double(rows(4)).get()
    first, cursor = session.spans_since(cursor)
    assert sorted((r.role, r.rank) for r in first) == [("cursor", 0), ("cursor", 1)]
    again, same = session.spans_since(cursor)
    assert again == [] and same == cursor  # nothing new: nothing handed over twice
    limit = session.max_trace_records
    try:
        session.max_trace_records = 4
        for _ in range(4):  # 8 spans past the cursor, the session keeps 4
            group.double(rows(4)).get()
        kept, newer = session.spans_since(cursor)
        assert newer == cursor + 8 and len(kept) == 4
        assert {id(r) for r in kept} == {id(r) for r in session.trace()}  # the newest, as trace() holds
    finally:
        session.max_trace_records = limit


def test_call_tags_are_kept_only_until_every_rank_span_is_drained(session):
    group = session.group("tag_drop", EchoWorker, session.pool("two", 2))
    hostset = group.hostset
    with tags(step="probe"):
        for _ in range(3):
            group.double(rows(4)).get()
        group.record_inner().get()
    assert len(hostset.call_tags) == 4  # nothing drained yet: every call's tags are kept
    long_call = group.sleep(3.0)
    spans = [r for r in session.trace() if r.role == "tag_drop"]
    assert not long_call.done(), "trace() waited for the long call"
    assert len(spans) == 10 and all(r.extra["step"] == "probe" for r in spans)  # inner spans too
    assert len(hostset.call_tags) == 1  # only the call still in flight
    assert len(hostset.task_calls) == 2  # its two rank tasks, whose spans will name them
    long_call.get()
    session.trace()
    assert not hostset.call_tags and not hostset.task_calls


def test_call_tags_keep_at_most_their_limit_and_go_with_the_last_span():
    kept = CallTags(limit=2)
    for number in range(3):
        kept.keep(number, {"n": number}, spans=2)
    assert len(kept) == 2 and kept.of(0) == {} and kept.of(2) == {"n": 2}  # the oldest dropped
    kept.settle(2)
    assert kept.of(2) == {"n": 2}  # one span of two taken
    kept.settle(2)
    assert kept.of(2) == {} and len(kept) == 1
    kept.settle(0)  # dropped before its spans came: nothing to settle
    kept.settle(None)  # a span of no driver call


@ray.remote(num_cpus=0)
def late_answer(seconds: float, record: CallRecord) -> list[CallRecord]:
    time.sleep(seconds)
    return [record]


class LateSource:
    """A span source (as the rule-reward scorers are) whose one answer comes seconds late."""

    def __init__(self, record: CallRecord, seconds: float):
        self.drains: list = []
        self.record: CallRecord | None = record
        self.seconds = seconds

    def request_records(self) -> None:
        if self.record is not None:
            self.drains.append(late_answer.remote(self.seconds, self.record))
            self.record = None

    def take_records(self, answers: dict) -> list[CallRecord]:
        records, self.drains = take_answers(self.drains, answers)
        return records


def test_a_source_that_answers_late_keeps_its_spans_for_the_next_drain(session):
    group = session.group("beside_late", EchoWorker, session.pool("two", 2))
    _, cursor = session.spans_since()
    now = time.time()
    late = LateSource(CallRecord(-1, "scorer", "score", 0, "late", 0, now, now, now, 0, 0, True), seconds=4.0)
    add_span_source(late)
    try:
        group.double(rows(4)).get()
        first, cursor = session.spans_since(cursor, timeout=1.0)  # every source asked, one wait for all
        assert "scorer" not in {r.role for r in first} and late.drains  # not answered yet: still asked
        second, cursor = session.spans_since(cursor, timeout=30.0)
    finally:
        remove_span_source(late)
    assert not late.drains
    spans = [(r.role, r.rank) for r in first + second]
    assert sorted(spans) == [("beside_late", 0), ("beside_late", 1), ("scorer", 0)]  # each once, none lost
