"""Fuzzing the request parser and the ext_proc request path in memory (issue 24 part 3).

Property: whatever body reaches a routed path, :func:`extproc.routing.request.parse_body` returns a
:class:`ParsedRequest` or raises the gateway's typed error (:class:`extproc.errors.GatewayError`, a 4xx),
and the :class:`StreamProcessor` (real Router, SmolLM2's chat template and tokenizer, with and without
the admission gate) answers every body with a routing decision or an OpenAI-style JSON error of a 4xx
(or a 429/503 it means), never the 500 of an exception that escaped the request path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from extproc.errors import GatewayError
from extproc.models.registry import ModelAssets
from extproc.routing.request import Kind, ParsedRequest, parse_body, route_kind
from extproc.routing.router import Router
from tests.extproc.test_processor import (
    ACME_KEY,
    MODEL,
    error,
    make_gate,
    make_router,
    processor,
    reply,
    route,
)
from tests.fuzz.strategies import FUZZ, ROUTED, json_values, mutated_body

#: Statuses the request path may answer with on its own (no engine touched).
CLIENT_STATUSES = {400, 401, 403, 404, 413, 429, 503}


@pytest.fixture(scope="module")
def assets(model_dir: str) -> ModelAssets:
    return ModelAssets.load(MODEL, Path(model_dir))


class _Escaped(logging.Handler):
    """Keeps the exceptions the processor logged as internal errors (to re-raise them in the test)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.errors: list[BaseException] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.errors.append(record.exc_info[1])


@pytest.fixture(scope="module")
def escaped() -> Iterator[_Escaped]:
    handler = _Escaped()
    logger = logging.getLogger("extproc.processor")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def _parse(kind: Kind, raw: bytes) -> ParsedRequest | None:
    try:
        return parse_body(kind, raw)
    except GatewayError as exc:
        assert 400 <= exc.status < 500, exc
        assert orjson.loads(exc.body())["error"]["message"]
        return None


@FUZZ
@given(kind=st.sampled_from(list(Kind)), raw=st.binary(max_size=256))
@example(kind=Kind.CHAT, raw=b"\xff{}")
@example(kind=Kind.CHAT, raw=b'{"model": "m", "messages": [{"role": "user"}], "n": 1e999}')
def test_parser_on_any_bytes(kind: Kind, raw: bytes) -> None:
    _parse(kind, raw)


@FUZZ
@given(kind=st.sampled_from(list(Kind)), value=json_values(16))
def test_parser_on_any_json(kind: Kind, value: Any) -> None:
    _parse(kind, orjson.dumps(value))


#: A routed path and a body for it.
cases = st.sampled_from(ROUTED).flatmap(lambda path: st.tuples(st.just(path), mutated_body(path, MODEL)))
#: Found by this fuzzer: a token id past 32 bits went through the parser and failed the digest chain
#: (OverflowError, a 500); now refused with a 400 like any other bad prompt.
HUGE_TOKEN_IDS = ("/v1/completions", {"model": MODEL, "prompt": [2**32] * 40})
HUGE_EMBEDDING_IDS = ("/v1/embeddings", {"model": MODEL, "input": [[2**40] * 20]})


@FUZZ
@given(case=cases)
@example(case=HUGE_TOKEN_IDS)
@example(case=HUGE_EMBEDDING_IDS)
def test_parser_on_mutated_bodies(case: tuple[str, dict[str, Any]]) -> None:
    path, body = case
    kind = route_kind(path)
    assert kind is not None
    _parse(kind, orjson.dumps(body))


def _through_processor(router: Router, escaped: _Escaped, payload: bytes, path: str, gated: bool) -> None:
    escaped.errors.clear()
    gate = make_gate() if gated else None
    proc = processor(router, gate)
    extra = ACME_KEY if gated else None
    out = route(proc, payload, path=path, extra=extra)
    if escaped.errors:
        raise escaped.errors[0]
    if out and out[0].WhichOneof("response") == "immediate_response":
        status, err, _ = error(out)
        assert status in CLIENT_STATUSES, err
        assert err["message"]
    else:
        reply(out)  # a decision: headers, then the body streamed back
    proc.close()


@FUZZ
@given(case=cases, gated=st.booleans())
@example(case=HUGE_TOKEN_IDS, gated=False)
@example(case=HUGE_EMBEDDING_IDS, gated=True)
def test_processor_answers_every_body(
    assets: ModelAssets, escaped: _Escaped, case: tuple[str, dict[str, Any]], gated: bool
) -> None:
    path, body = case
    _through_processor(make_router(assets), escaped, orjson.dumps(body), path, gated)


@FUZZ
@given(raw=st.binary(max_size=128), path=st.sampled_from(ROUTED))
def test_processor_answers_any_bytes(assets: ModelAssets, escaped: _Escaped, raw: bytes, path: str) -> None:
    _through_processor(make_router(assets), escaped, raw or b" ", path, False)
