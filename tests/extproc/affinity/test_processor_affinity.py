"""previous_response_id affinity inside the stream state machine, in memory (a real Router and Fleet, a
fixed clock): the follow-up goes to the producer while it is routable, per tenant scope."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from contracts.epp import DECISION_RESPONSES_SCOPE
from extproc.affinity.core import HIT, OPEN_SCOPE, UNAVAILABLE, UNKNOWN, ResponseAffinity
from extproc.models.registry import ModelAssets
from extproc.processor import ProcessorConfig, StreamProcessor
from extproc.routing.router import Router
from tests.extproc.test_processor import LIMIT, MODEL, NOW, body, clock, headers, make_router, reply


@pytest.fixture(scope="module")
def smol(model_dir: str) -> ModelAssets:
    return ModelAssets.load(MODEL, Path(model_dir), max_model_len=1 << 20)


@pytest.fixture
def router(smol: ModelAssets) -> Router:
    return make_router(smol)


def ask(
    router: Router, affinity: ResponseAffinity, previous: str | None = None, text: str = "hi"
) -> tuple[str, dict]:
    """Route one /v1/responses request: the picked endpoint's id and the decision metadata."""
    proc = StreamProcessor(router, ProcessorConfig(max_body_bytes=LIMIT, affinity=affinity), clock)
    doc: dict[str, object] = {"model": MODEL, "input": text}
    if previous is not None:
        doc["previous_response_id"] = previous
    assert proc.handle(headers("/v1/responses")) == []
    got = reply(proc.handle(body(orjson.dumps(doc))))
    assert proc.decision is not None
    router.finish(proc.decision)
    return proc.decision.endpoints[0].id, got.decision


def test_a_follow_up_goes_to_the_endpoint_that_produced_the_response(router: Router) -> None:
    affinity = ResponseAffinity()
    _, decision = ask(router, affinity)
    assert decision[DECISION_RESPONSES_SCOPE] == OPEN_SCOPE  # its response id will be learned
    for producer in ("e0", "e1", "e2"):
        affinity.learn(OPEN_SCOPE, f"resp_{producer}", producer, NOW)
        for i in range(3):  # whatever the prompt, the producer
            assert ask(router, affinity, f"resp_{producer}", text=f"next {i}")[0] == producer
    assert affinity.outcomes[HIT] == 9


def test_unknown_ids_and_unroutable_producers_are_scored_as_usual(router: Router) -> None:
    affinity = ResponseAffinity()
    ask(router, affinity, "resp_nobody")
    assert affinity.outcomes[UNKNOWN] == 1
    affinity.learn(OPEN_SCOPE, "resp_x", "e1", NOW)
    state = next(s for s in router.fleet if s.id == "e1")
    state.ejected_until = NOW + 10  # a failed try ejected it
    assert ask(router, affinity, "resp_x")[0] != "e1"
    state.ejected_until = 0.0
    router.fleet.set_state(state.id, draining=True)
    assert ask(router, affinity, "resp_x")[0] != "e1"
    assert affinity.outcomes[UNAVAILABLE] == 2


def test_a_producer_of_another_model_is_never_picked(router: Router) -> None:
    """An id whose producer serves another model (a follow-up naming a model the producer does not serve,
    or an id guessed from another conversation) steers nothing: the request is scored among its model's
    endpoints, counted unavailable."""
    affinity = ResponseAffinity()
    affinity.learn(OPEN_SCOPE, "resp_other", "o", NOW)  # "o" serves another model only
    assert ask(router, affinity, "resp_other")[0] != "o"
    affinity.learn(OPEN_SCOPE, "resp_gone", "no-such-endpoint", NOW)  # left the fleet since
    assert ask(router, affinity, "resp_gone")[0] in {"e0", "e1", "e2"}
    assert affinity.outcomes[UNAVAILABLE] == 2


def test_another_scope_does_not_steer(router: Router) -> None:
    affinity = ResponseAffinity()
    affinity.learn("tenant:acme", "resp_acme", "e2", NOW)
    ask(router, affinity, "resp_acme")  # no tenant: the open scope, where the id is unknown
    assert affinity.outcomes == {HIT: 0, UNKNOWN: 1, UNAVAILABLE: 0}


def test_other_routes_carry_no_scope(router: Router) -> None:
    affinity = ResponseAffinity()
    proc = StreamProcessor(router, ProcessorConfig(max_body_bytes=LIMIT, affinity=affinity), clock)
    assert proc.handle(headers()) == []
    got = reply(
        proc.handle(body(orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]})))
    )
    assert DECISION_RESPONSES_SCOPE not in got.decision


def test_a_tenants_scope_comes_from_its_verified_key(router: Router) -> None:
    """Under [auth], acme's request is noted in acme's scope and steered by acme's entries only."""
    from tests.extproc.test_processor import ACME_KEY, make_gate

    affinity = ResponseAffinity()
    affinity.learn("tenant:acme", "resp_a", "e2", NOW)
    affinity.learn(OPEN_SCOPE, "resp_open", "e1", NOW)
    for previous, expected in (("resp_a", "e2"), ("resp_open", None)):
        config = ProcessorConfig(max_body_bytes=LIMIT, affinity=affinity)
        proc = StreamProcessor(router, config, clock, make_gate())
        assert proc.handle(headers("/v1/responses", extra=ACME_KEY)) == []
        doc = {"model": MODEL, "input": "hi", "max_output_tokens": 4, "previous_response_id": previous}
        got = reply(proc.handle(body(orjson.dumps(doc))))
        assert got.decision[DECISION_RESPONSES_SCOPE] == "tenant:acme"
        assert proc.decision is not None
        if expected is not None:
            assert proc.decision.endpoints[0].id == expected
        router.finish(proc.decision)
    assert affinity.outcomes == {HIT: 1, UNKNOWN: 1, UNAVAILABLE: 0}  # the open scope's id is not acme's
