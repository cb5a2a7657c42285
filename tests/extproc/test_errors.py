"""The OpenAI error ``type`` each status carries: OpenAI's own, as its API answers (an unknown model: 404
``invalid_request_error``, code ``model_not_found``; a bad key: 401 ``invalid_request_error``, code
``invalid_api_key``), so a client that branches on ``type`` sees what the OpenAI API would send."""

from __future__ import annotations

import orjson
import pytest

from extproc.errors import BadRequest, GatewayError, NotFound, PayloadTooLarge, Unauthorized


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (BadRequest("'messages' must be a non-empty array.", param="messages"), 400, None),
        (Unauthorized("Invalid API key.", code="invalid_api_key"), 401, "invalid_api_key"),
        (
            NotFound("The model `gpt-4` does not exist.", code="model_not_found", param="model"),
            404,
            "model_not_found",
        ),
        (NotFound("Use GET for /v1/models."), 404, None),
        (PayloadTooLarge("The request body is too large."), 413, None),
    ],
)
def test_client_errors_are_openais_invalid_request_error(
    error: GatewayError, status: int, code: str | None
) -> None:
    body = orjson.loads(error.body())["error"]
    assert (error.status, body["type"], body["code"]) == (status, "invalid_request_error", code)
