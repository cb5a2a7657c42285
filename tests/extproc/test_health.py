"""The gateway's probes in memory: ``/health`` and ``/ready`` answered by the processor, never routed.

Envoy's messages and the readers of the answers come from ``tests/extproc/test_processor.py``; the router is
the same real :class:`Router` over a real :class:`Fleet` (three ``smol`` endpoints, one ``other``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from envoy.config.core.v3.base_pb2 import Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import json_format

from contracts.epp import JWT_NS
from contracts.events import EndpointId
from extproc.models.registry import ModelAssets
from extproc.processor import StreamProcessor
from extproc.routing.router import Route, Router, RoutingPolicy
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile
from tests.extproc.test_processor import (
    ACME_KEY,
    MODEL,
    OTHER,
    body,
    error,
    header_map,
    headers,
    in_flight,
    make_gate,
    make_router,
    metadata,
    processor,
    set_headers,
    trailers,
)

HEALTH = ("/health", "/liveness")
READY = ("/ready", "/readiness")
GPU = ("gpu", "h100")


@pytest.fixture(scope="module")
def assets(model_dir: str) -> ModelAssets:
    return ModelAssets.load(MODEL, Path(model_dir))


@pytest.fixture
def router(assets: ModelAssets) -> Router:
    return make_router(assets)


def answer(out: list[pb.ProcessingResponse]) -> tuple[int, bytes, dict[str, str], str]:
    """(status, raw body, headers, details) of the one ImmediateResponse in ``out``, marked so the bundled
    Envoy passes it through unchanged."""
    assert len(out) == 1 and out[0].WhichOneof("response") == "immediate_response", out
    assert json_format.MessageToDict(out[0].dynamic_metadata) == {"kvgate": {"rejected": True}}
    imm = out[0].immediate_response
    return imm.status.code, imm.body, set_headers(imm.headers), imm.details


def assert_ok(out: list[pb.ProcessingResponse]) -> None:
    """200 with an empty body and no content type, as vLLM's ``/health``."""
    assert answer(out) == (200, b"", {}, "kvgate_probe")


def assert_not_ready(out: list[pb.ProcessingResponse]) -> None:
    status, err, _ = error(out)
    assert (status, err["type"], err["code"]) == (503, "service_unavailable", "no_ready_endpoint")
    assert err["message"] == "No endpoint is ready to serve any model."


def probe(proc: StreamProcessor, path: str, method: str = "GET", **kw: Any) -> list[pb.ProcessingResponse]:
    return proc.handle(headers(path, method, end=True, **kw))


# --- liveness and readiness ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [*HEALTH, *READY, "/health?verbose=1", "/ready?x=1"])
@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize("value_form", [False, True])
def test_probes_answer_200_without_routing(router: Router, path: str, method: str, value_form: bool) -> None:
    proc = processor(router)
    hs = {":path": path, ":method": method, "x-request-id": "r1"}
    end = pb.HttpHeaders(headers=header_map(hs, value_form), end_of_stream=True)
    assert_ok(proc.handle(pb.ProcessingRequest(request_headers=end)))
    assert proc.decision is None and in_flight(router) == {}
    assert proc.handle(body(b"late")) == []  # answered: a late body is drained


@pytest.mark.parametrize("path", [*HEALTH, *READY])
@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
def test_probes_take_get_and_head_only(router: Router, path: str, method: str) -> None:
    status, err, _ = error(probe(processor(router), path, method))
    assert (status, err["type"], err["message"]) == (404, "invalid_request_error", f"Use GET for {path}.")


@pytest.mark.parametrize("path", ["/healthz", "/health/", "/v1/health", "/ready/x"])
def test_near_misses_are_unknown_paths(router: Router, path: str) -> None:
    status, err, _ = error(probe(processor(router), path))
    assert (status, err["message"][:13]) == (404, "Unknown path ")


def as_started(router: Router) -> None:
    pass


def all_unhealthy(router: Router) -> None:
    for s in router.fleet:
        s.healthy = False


def all_draining(router: Router) -> None:
    for s in router.fleet:
        s.draining = True


def smol_unhealthy(router: Router) -> None:
    for s in router.fleet:
        s.healthy = MODEL not in s.endpoint.models


def other_draining(router: Router) -> None:
    for s in router.fleet:
        s.draining = OTHER in s.endpoint.models


def no_endpoints(router: Router) -> None:
    for s in list(router.fleet):
        router.fleet.remove(s.id)


def smol_needs_a_label(router: Router) -> None:
    """``other`` down, and smol's route admits only endpoints labelled ``gpu=h100``: none is."""
    for s in router.fleet:
        s.healthy = OTHER not in s.endpoint.models
    profile = build_profile(DEFAULT_SCHEDULING)
    router.apply(RoutingPolicy(profile, {MODEL: Route((GPU,), profile)}))


def one_carries_the_label(router: Router) -> None:
    smol_needs_a_label(router)
    state = router.fleet.get(EndpointId("e1"))
    assert state is not None
    state.endpoint = dataclasses.replace(state.endpoint, labels=(GPU,))


def only_prefill_endpoints(router: Router) -> None:
    """Every endpoint prefill-only: none serves a request by itself (extproc/disagg)."""
    for s in router.fleet:
        s.endpoint = dataclasses.replace(s.endpoint, role="prefill")


@pytest.mark.parametrize(
    ("setup", "ready"),
    [
        (as_started, True),
        (only_prefill_endpoints, False),
        (all_unhealthy, False),
        (all_draining, False),
        (smol_unhealthy, True),  # `other` is still routable: ready for some model
        (other_draining, True),
        (no_endpoints, False),
        (smol_needs_a_label, False),
        (one_carries_the_label, True),
    ],
)
@pytest.mark.parametrize("path", READY)
def test_ready_while_some_endpoint_is_routable(
    router: Router, setup: Callable[[Router], None], ready: bool, path: str
) -> None:
    setup(router)
    out = probe(processor(router), path)
    if ready:
        assert_ok(out)
    else:
        assert_not_ready(out)
    for h in HEALTH:  # liveness never depends on the fleet
        assert_ok(probe(processor(router), h))


@pytest.mark.parametrize(
    ("method", "finish", "expected"),
    [
        # as /v1/models: a probe whose end of stream comes on a later message is answered then
        ("GET", [body(b"", end=True)], 200),
        ("HEAD", [body(b"", end=False), trailers()], 200),
        ("GET", [body(b"ignored", end=True)], 200),
        ("POST", [body(b"{}", end=True)], 404),
    ],
)
@pytest.mark.parametrize("path", ["/health", "/ready"])
def test_probes_with_a_body_phase(
    router: Router, method: str, finish: list[pb.ProcessingRequest], expected: int, path: str
) -> None:
    proc = processor(router)
    assert proc.handle(headers(path, method)) == []
    outs = [proc.handle(m) for m in finish]
    assert all(o == [] for o in outs[:-1])
    if expected == 200:
        assert_ok(outs[-1])  # the ImmediateResponse alone: no TrailersResponse
    else:
        assert error(outs[-1])[0] == 404
    assert proc.decision is None and in_flight(router) == {}


@pytest.mark.parametrize(
    ("extra", "meta"),
    [
        ({}, None),  # no credentials at all
        ({"authorization": "Bearer sk-kvg-not-a-key"}, None),  # a wrong key
        ({}, metadata(**{JWT_NS: {"jwt_status": {"message": "Jwt is expired"}}})),
        (ACME_KEY, None),
    ],
)
@pytest.mark.parametrize("path", ["/health", "/ready"])
@pytest.mark.parametrize("end", [True, False])
def test_probes_need_no_credentials(
    router: Router, extra: dict[str, str], meta: Metadata | None, path: str, end: bool
) -> None:
    proc = processor(router, make_gate())
    out = proc.handle(headers(path, "GET", end=end, extra=extra, meta=meta))
    if not end:
        assert out == []
        out = proc.handle(body(b"", end=True))
    assert_ok(out)
    assert proc.principal is None  # nobody was identified, nothing reserved
    # every other path still wants credentials
    assert error(processor(router, make_gate()).handle(headers("/v1/models", "GET", end=True)))[0] == 401
