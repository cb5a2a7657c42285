"""The ext_proc's saturation core in memory: the decision bound and the loop-lag window."""

from __future__ import annotations

import orjson
import pytest

from contracts.config import Section
from contracts.errors import ConfigError
from extproc.overload.gate import DecisionGate, LagMeter, OverloadConfig, parse_overload
from extproc.processor import overloaded


def arrive(gate: DecisionGate) -> bool:
    """A stream starts and its headers say a body follows: admitted, or shed (and released)."""
    gate.enter()
    if gate.admit():
        return True
    gate.release()
    return False


def test_the_bound_sheds_beyond_max_decisions_and_frees_on_release() -> None:
    gate = DecisionGate(2)
    assert [arrive(gate) for _ in range(4)] == [True, True, False, False]
    assert (gate.in_flight, gate.shed, gate.peak, gate.saturation) == (2, 2, 3, 1.0)
    gate.release()
    assert arrive(gate) and not arrive(gate)
    gate.release()
    gate.release()
    gate.release()  # never below zero
    assert gate.in_flight == 0 and gate.admitted == 3


def test_streams_that_started_but_were_not_read_yet_count() -> None:
    """Three streams started before any headers were read (the loop was busy): the first whose headers
    are read is shed (3 > 2) and released at once, the other two go on."""
    gate = DecisionGate(2)
    for _ in range(3):
        gate.enter()
    assert not gate.admit()
    gate.release()
    assert gate.admit() and gate.admit() and gate.in_flight == 2 and gate.shed == 1


def test_no_bound() -> None:
    gate = DecisionGate(0)
    assert all(arrive(gate) for _ in range(10_000)) and gate.saturation == 0.0


def test_lag_is_the_lateness_and_peak_the_window_max() -> None:
    meter = LagMeter(window_s=1.0)
    assert meter.record(due=0.05, woke=0.051) == pytest.approx(0.001)
    assert meter.record(due=0.10, woke=0.40) == pytest.approx(0.30)
    assert meter.record(due=0.45, woke=0.44) == 0.0  # early is no lag
    assert meter.peak == pytest.approx(0.30) and meter.last == 0.0
    meter.record(due=1.5, woke=1.502)  # the 0.30 wake is more than a second old
    assert meter.peak == pytest.approx(0.002)


def test_the_config_table() -> None:
    assert parse_overload(Section({}, "overload")) == OverloadConfig()
    assert parse_overload(Section({"max_decisions": 0}, "overload")).max_decisions == 0
    for bad in ({"max_decision": 3}, {"max_decisions": -1}, {"lag_interval_s": 20.0}):
        with pytest.raises(ConfigError):
            parse_overload(Section(bad, "overload"))


def test_the_shed_answer_is_503_with_retry_after_and_an_openai_error() -> None:
    """README.md, "Shed rule": 503, ``Retry-After: 1``, ``{"error": {"type": "service_unavailable", "code":
    "gateway_overloaded", ...}}``."""
    reply = overloaded().immediate_response
    assert reply.status.code == 503
    headers = {h.header.key: h.header.raw_value.decode() for h in reply.headers.set_headers}
    assert headers == {"content-type": "application/json", "retry-after": "1"}
    error = orjson.loads(reply.body)["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "gateway_overloaded")
    assert error["message"] and error["param"] is None
