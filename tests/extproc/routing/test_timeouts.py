from __future__ import annotations

import pytest

from contracts.errors import ConfigError
from extproc.config import parse_config
from extproc.routing.timeouts import (
    FIRST_BYTE_TIMEOUT_HEADER,
    REQUEST_TIMEOUT_HEADER,
    Timeouts,
    TimeoutTable,
)

MODEL = {"name": "m", "gguf": "smollm2"}


def test_a_stream_gets_a_first_byte_bound_and_a_whole_answer_does_not() -> None:
    table = TimeoutTable(Timeouts(request_s=90, first_byte_s=2.5))
    assert table.headers("any", stream=True) == [
        (REQUEST_TIMEOUT_HEADER, "90000"),
        (FIRST_BYTE_TIMEOUT_HEADER, "2500"),
    ]
    # A non-streamed answer's first byte is its last: only the whole-response bound applies.
    assert table.headers("any", stream=False) == [(REQUEST_TIMEOUT_HEADER, "90000")]


def test_zero_disables_a_bound() -> None:
    assert TimeoutTable(Timeouts(request_s=0, first_byte_s=0)).headers("any", stream=True) == []
    assert TimeoutTable(Timeouts(request_s=0, first_byte_s=0.0001)).headers("m", stream=True) == [
        (FIRST_BYTE_TIMEOUT_HEADER, "1")  # never rounded to 0 (which Envoy reads as "no bound")
    ]


def test_config_defaults_and_per_model_bounds() -> None:
    default = parse_config({"models": [MODEL]})
    assert default.timeout_table() == TimeoutTable(Timeouts(1800.0, 30.0), {})
    cfg = parse_config(
        {
            "timeouts": {"request_s": 600, "first_byte_s": 10},
            "models": [{**MODEL, "first_byte_timeout_s": 2}, {"name": "other", "gguf": "smollm2"}],
        }
    )
    table = cfg.timeout_table()
    assert table.models == {"m": Timeouts(request_s=600, first_byte_s=2)}  # the rest from [timeouts]
    assert table.headers("other", stream=True) == [
        (REQUEST_TIMEOUT_HEADER, "600000"),
        (FIRST_BYTE_TIMEOUT_HEADER, "10000"),
    ]


@pytest.mark.parametrize(
    "raw",
    [
        {"timeouts": {"request_s": -1}},
        {"timeouts": {"first_byte_s": "soon"}},
        {"timeouts": {"first_byte": 3}},
        {"models": [{**MODEL, "request_timeout_s": -5}]},
        {"models": [{**MODEL, "idle_timeout_s": 0}]},
    ],
)
def test_bad_bounds_are_refused(raw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        parse_config(raw)


def test_every_forwarded_try_is_bounded_so_a_hung_peer_falls_back() -> None:
    """Forwarded to a peer (its ingress first, the local pick after it): a non-streamed try gets a
    per-try bound too (``request_s``), the whole twice that, so the local pick still has a full try."""
    table = TimeoutTable(Timeouts(request_s=90, first_byte_s=2.5))
    assert table.headers("any", stream=False, forwarded=True) == [
        (REQUEST_TIMEOUT_HEADER, "180000"),
        (FIRST_BYTE_TIMEOUT_HEADER, "90000"),
    ]
    assert table.headers("any", stream=True, forwarded=True) == table.headers("any", stream=True)
    assert (
        TimeoutTable(Timeouts(request_s=0, first_byte_s=0)).headers("m", stream=False, forwarded=True) == []
    )


def test_a_non_streamed_forwarded_try_takes_the_federations_bound() -> None:
    """``forward_s`` (``[federation] forward_first_byte_s``) bounds a non-streamed forwarded try, never
    above ``request_s``; the whole is ``request_s`` plus it, so the local pick keeps a full ``request_s``.
    A streamed forward keeps ``first_byte_s``."""
    table = TimeoutTable(Timeouts(request_s=90, first_byte_s=2.5))
    assert table.headers("any", stream=False, forwarded=True, forward_s=5) == [
        (REQUEST_TIMEOUT_HEADER, "95000"),
        (FIRST_BYTE_TIMEOUT_HEADER, "5000"),
    ]
    assert table.headers("any", stream=False, forwarded=True, forward_s=600) == [
        (REQUEST_TIMEOUT_HEADER, "180000"),
        (FIRST_BYTE_TIMEOUT_HEADER, "90000"),
    ]
    assert table.headers("any", stream=True, forwarded=True, forward_s=5) == table.headers("any", stream=True)
    unbounded = TimeoutTable(Timeouts(request_s=0, first_byte_s=0))
    assert unbounded.headers("m", stream=False, forwarded=True, forward_s=5) == [
        (FIRST_BYTE_TIMEOUT_HEADER, "5000")
    ]
    assert table.headers("any", stream=False, forward_s=5) == table.headers("any", stream=False)
