"""The queue wait a cluster publishes in its summaries (``model_loads``, extproc/federation/README.md,
"Queue wait"): the prefill backlog at the least-waiting endpoint, drained at the fitted slope or, before a
fit, the configured prefill rate; nothing for an idle fleet, nothing for requests forwarded away."""

from __future__ import annotations

import pytest

from extproc.federation.shell import model_loads
from extproc.processor import ProcessorConfig, StreamProcessor
from tests.extproc.federation.test_processor_forward import (
    LONG,
    MODEL,
    chain_of,
    forwarder,
    request,
    router,
    warm_in_b,
)
from tests.extproc.test_processor import body, headers

RATE = 1 / 20_000  # the cluster's configured prefill_s_per_token


def test_an_idle_fleet_waits_nothing() -> None:
    assert model_loads(router(), 0.0, RATE)[MODEL].queue_wait_s == 0


def test_the_wait_is_the_backlog_at_the_configured_rate_until_a_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    r = router()
    (state,) = list(r.fleet)
    r.predictor.routed("x", state, 4094, 0.0)
    # the configured rate, not the predictor's prior (10,000 tokens/s would say 0.41 s)
    assert model_loads(r, 0.0, RATE)[MODEL].queue_wait_s == pytest.approx(4094 * RATE)
    assert model_loads(r, 0.1, RATE)[MODEL].queue_wait_s == pytest.approx((4094 - 2000) * RATE)
    assert model_loads(r, 0.25, RATE)[MODEL].queue_wait_s == 0  # its prefill is done: decoding
    monkeypatch.setattr(r.predictor, "fitted_slope", lambda endpoint: 1e-4)  # observations fit a line
    assert model_loads(r, 0.1, RATE)[MODEL].queue_wait_s == pytest.approx((4094 - 1000) * 1e-4)
    assert model_loads(r, 0.1, RATE)[MODEL].endpoints == 1


def test_a_forwarded_request_is_not_ahead_at_the_local_pick() -> None:
    fwd = forwarder()
    warm_in_b(fwd, chain_of(LONG))
    r = router()
    (state,) = list(r.fleet)
    proc = StreamProcessor(r, ProcessorConfig(max_body_bytes=1 << 20), lambda: 1000.0, federation=fwd)
    proc.handle(headers("/v1/completions"))
    proc.handle(body(request(LONG)))
    proc.after_send()
    assert proc.forward is not None
    assert r.predictor.ahead(state, 1000.0) == 0 and len(r.predictor) == 0
    assert model_loads(r, 1000.0, RATE)[MODEL].queue_wait_s == 0
    proc.close()
    local = StreamProcessor(r, ProcessorConfig(max_body_bytes=1 << 20), lambda: 1000.0, federation=fwd)
    local.handle(headers("/v1/completions"))
    local.handle(body(request("unshared " + LONG)))  # another chain: stays local, counts ahead
    local.after_send()
    assert local.forward is None and r.predictor.ahead(state, 1000.0) > 0
    local.close()
