"""A client-chosen ``x-request-id`` is logged as data: never a second log line, a control character or a
kilobyte of text chosen by the client (issue 26, log injection)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.models.registry import ModelAssets
from extproc.processor import ProcessorConfig, StreamProcessor
from tests.extproc.test_processor import make_router

SAFE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@pytest.fixture(scope="module")
def assets(model_dir: str) -> ModelAssets:
    return ModelAssets.load("smol", Path(model_dir))


def rejected_log(assets: ModelAssets, request_id: str, caplog: pytest.LogCaptureFixture) -> tuple[str, str]:
    """The processor's ``request_id`` and its log line for a headers-only request to an unknown path."""
    proc = StreamProcessor(make_router(assets), ProcessorConfig(max_body_bytes=1 << 20), lambda: 0.0)
    hs = {":path": "/v1/nope", ":method": "GET", "x-request-id": request_id}
    msg = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()]),
            end_of_stream=True,
        )
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="extproc.processor"):
        out = proc.handle(msg)
    assert out[0].immediate_response.status.code == 404
    (record,) = [r for r in caplog.records if r.name == "extproc.processor"]
    return proc.request_id, record.getMessage()


@pytest.mark.parametrize(
    "forged",
    [
        "abc\nFORGED 200 ok",
        "abc\r\nrequest evil: rejected 200 ok",
        "id\x1b[31mred\x00nul",
        "x" * 1000,
        "sp ace",
        "",
    ],
)
def test_a_forged_request_id_is_logged_as_a_safe_token(
    assets: ModelAssets, caplog: pytest.LogCaptureFixture, forged: str
) -> None:
    request_id, line = rejected_log(assets, forged, caplog)
    assert SAFE.fullmatch(request_id), request_id
    assert request_id.startswith("invalid-")
    assert line == f"request {request_id}: rejected 404 invalid_request_error"
    assert "FORGED" not in line and "evil" not in line and "\n" not in line and "\x1b" not in line
    # The same forged id always maps to the same token (one request's lines stay correlated).
    assert rejected_log(assets, forged, caplog)[0] == request_id


@pytest.mark.parametrize("good", ["r1", "2f1c6d0e-9a4b-4c1e-8f3a-0b6f2d9e7c11", "a.b_c:d-e", "x" * 128])
def test_a_well_formed_request_id_is_logged_as_sent(
    assets: ModelAssets, caplog: pytest.LogCaptureFixture, good: str
) -> None:
    request_id, line = rejected_log(assets, good, caplog)
    assert request_id == good and line == f"request {good}: rejected 404 invalid_request_error"
