"""A value every vLLM engine refuses is answered by the gateway itself, in memory: the StreamProcessor
replies with an OpenAI-style 400 naming the field, and the request is never routed (no decision, nothing
in flight, the router never asked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from extproc.models.registry import ModelAssets
from extproc.routing.request import ParsedRequest
from extproc.routing.router import Decision, Router
from tests.extproc.test_processor import CHAT, MODEL, error, in_flight, make_router, processor, reply, route

COMPLETIONS = "/v1/completions"


class CountingRouter(Router):
    """A Router that counts the requests it is asked to route."""

    decided = 0

    def decide(self, request: ParsedRequest, **kw: Any) -> Decision:
        self.decided += 1
        return super().decide(request, **kw)


@pytest.fixture(scope="module")
def assets(model_dir: str) -> ModelAssets:
    return ModelAssets.load(MODEL, Path(model_dir))


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "hello"}]}),
        (COMPLETIONS, {"prompt": "hello"}),
    ],
)
@pytest.mark.parametrize(("max_tokens", "routed"), [(0, False), (1, True)])
def test_max_tokens_zero_is_answered_by_the_gateway(
    assets: ModelAssets, path: str, fields: dict[str, Any], max_tokens: int, routed: bool
) -> None:
    router = make_router(assets, CountingRouter)
    assert isinstance(router, CountingRouter)
    proc = processor(router)
    payload = orjson.dumps({"model": MODEL, **fields, "max_tokens": max_tokens})
    out = route(proc, payload, path=path)
    if routed:  # the same request with a limit vLLM takes is routed as usual
        assert reply(out).body == payload and router.decided == 1
        return
    status, err, headers = error(out)
    assert (status, err["type"], err["param"], err["code"]) == (
        400,
        "invalid_request_error",
        "max_tokens",
        None,
    )
    assert "'max_tokens' must be at least 1" in err["message"]
    assert headers["content-type"] == "application/json"
    assert router.decided == 0 and proc.decision is None and in_flight(router) == {}
