"""Several ext_procs' status documents combined (extproc/status/combine.py), in memory: two views of the
same fleet that differ the way two workers do (their own streams, queues and routing; one sees an
endpoint ejected; a feed lost at one; a policy value not yet heard), and how the text shows them."""

from __future__ import annotations

import dataclasses

import pytest

from extproc.status.combine import combine
from extproc.status.render import render_combined_text
from extproc.status.snapshot import DriftStatus, QueueStatus, Status, decode, encode
from tests.extproc.status.test_snapshot import M, take


def second_worker(status: Status) -> Status:
    """What another worker of the same host would serve beside :func:`take`'s view."""
    endpoints = []
    for e in status.endpoints:
        if e.id == "sim-0":  # routed once here, a stream open, an older engine reading
            e = dataclasses.replace(
                e, routed_recent=1.0, in_flight=2, outstanding=1, running=9.0, load=7.0, index_blocks=3
            )
        elif e.id == "sim-1":  # ejected here after a failed try (ejections are each worker's own)
            e = dataclasses.replace(e, routed_recent=0.0, state="ejected", ejected_for_s=3.0, draining=False)
        else:
            e = dataclasses.replace(e, routed_recent=0.0)
        endpoints.append(e)
    feeds = tuple(dataclasses.replace(f, connected=True, last_error="") for f in status.index.feeds)
    values = dict(status.policy.values)
    values["weights/prefix"] = 3.0
    return dataclasses.replace(
        status,
        at=status.at - 5,
        endpoints=tuple(endpoints),
        index=dataclasses.replace(status.index, feeds=feeds, blocks=5),
        policy=dataclasses.replace(status.policy, values=values),
        queues=(QueueStatus(M, 0, 4),),
        queued=4,
        drift=(DriftStatus(M, "sim-0", 3, 0.5, 0.5, True, 3, "responses"),),
    )


def test_two_workers_add_up_and_their_differences_are_named() -> None:
    a = take()
    a = dataclasses.replace(a, drift=(DriftStatus(M, "sim-0", 1, 1.0, 0.0, False, 1, "responses"),))
    b = second_worker(a)
    combined = combine([("w0", a), ("w1", b)])
    status = combined.status
    assert status is not None and decode(encode(status)) == status
    by_id = {e.id: e for e in status.endpoints}
    s0, s1 = by_id["sim-0"], by_id["sim-1"]
    assert (s0.in_flight, s0.outstanding) == (1 + 2, 2 + 1)  # each worker's own streams, summed
    # routed: 3 (sim-0) + 1 (sim-1) at w0, 1 (sim-0) at w1
    assert s0.routed_share == pytest.approx(4 / 5) and s1.routed_share == pytest.approx(1 / 5)
    assert s0.running == 3.0  # the newer view's reading (w1's is 5 s older)
    assert s0.load == 7.0 and s0.index_blocks == 4  # the largest
    assert s1.state == "draining" and s1.ejected_for_s == 3.0 and s1.draining  # the worst state
    assert status.queued == 3 + 4
    assert [(q.model, q.priority, q.queued) for q in status.queues] == [(M, 1, 1), (M, 0, 6)]
    assert status.index.blocks == max(a.index.blocks, 5)
    lost = next(f for f in status.index.feeds if f.address == "127.0.0.1:7002")
    assert not lost.connected and lost.last_error == "UNAVAILABLE: down"  # connected only if everywhere
    (drift,) = status.drift  # responses: every worker hears every completion, the fullest window
    assert (drift.samples, drift.observed, drift.tripped) == (3, 3, True)
    assert drift.ratio == pytest.approx(0.5)
    assert status.at == a.at and status.policy.values["weights/prefix"] == 5  # the first view's value
    notes = "\n".join(combined.disagreements)
    assert "endpoint sim-1: draining at w0, ejected at w1" in notes
    assert "feed 127.0.0.1:7002: lost at w0, connected at w1" in notes
    assert "policy weights/prefix: 5.0 at w0, 3.0 at w1" in notes
    assert [(v.source, v.in_flight, v.queued) for v in combined.views] == [("w0", 1, 3), ("w1", 2, 4)]


def test_a_view_that_failed_is_listed_and_an_endpoint_one_lacks_is_named() -> None:
    a = take()
    b = dataclasses.replace(a, endpoints=a.endpoints[:2])
    combined = combine([("w0", a), ("w1", b)], failed=[("w2", "unreachable")])
    assert combined.status is not None and len(combined.status.endpoints) == 3
    assert any(d == "endpoint sim-1: unknown to w1" for d in combined.disagreements)
    assert [v.error for v in combined.views] == ["", "", "unreachable"]
    text = render_combined_text(combined)
    assert text.startswith("2/3 ext_procs combined\n")
    assert "w2" in text and "unreachable" in text and "DISAGREE: endpoint sim-1: unknown to w1" in text
    assert "FLEET" in text and "POLICY" in text
    nobody = combine([], failed=[("w0", "unreachable")])
    assert nobody.status is None and render_combined_text(nobody).startswith("0/1 ext_procs combined")


def test_one_view_combined_is_that_view() -> None:
    a = take()
    combined = combine([("w0", a)])
    assert combined.status is not None and combined.disagreements == ()
    assert {e.id: e.routed_share for e in combined.status.endpoints} == {
        e.id: pytest.approx(e.routed_share) for e in a.endpoints
    }
    assert combined.status.queues == a.queues and combined.status.index.feeds == a.index.feeds


def test_drift_from_completions_is_not_counted_once_per_worker() -> None:
    """Every ext_proc hears every completion (one access-log stream per replica), so two workers'
    ``responses`` windows hold the same answers: combined, they are those answers once. The ``counters``
    alarm compares each worker's own routed requests: those add up."""
    a = dataclasses.replace(
        take(),
        drift=(
            DriftStatus(M, "sim-0", 1, 0.25, 0.75, False, 1, "counters"),
            DriftStatus(M, "sim-0", 20, 0.4, 0.6, True, 30, "responses"),
        ),
    )
    b = dataclasses.replace(
        a,
        at=a.at - 1,
        drift=(
            DriftStatus(M, "sim-0", 3, 0.5, 0.5, True, 4, "counters"),
            DriftStatus(M, "sim-0", 20, 0.4, 0.6, True, 30, "responses"),
        ),
    )
    status = combine([("w0", a), ("w1", b)]).status
    assert status is not None
    counters, responses = status.drift
    assert (responses.source, responses.samples, responses.observed) == ("responses", 20, 30)
    assert responses.ratio == pytest.approx(0.4) and responses.error == pytest.approx(0.6)
    assert responses.tripped
    assert (counters.source, counters.samples, counters.observed) == ("counters", 4, 5)
    assert counters.ratio == pytest.approx((1 * 0.25 + 3 * 0.5) / 4) and counters.tripped
    # a worker started later has heard fewer of the same completions: the fullest window stands
    late = dataclasses.replace(b, drift=(DriftStatus(M, "sim-0", 5, 1.0, 0.0, False, 5, "responses"),))
    status = combine([("w0", a), ("w1", late)]).status
    assert status is not None
    responses = next(d for d in status.drift if d.source == "responses")
    assert (responses.samples, responses.observed, responses.ratio) == (20, 30, pytest.approx(0.4))
