"""Envoy's ``json_to_metadata`` filter reading the engine's reused prompt tokens from each JSON response.

The drift alarm (:mod:`extproc.drift`) compares, per request, the prompt tokens the ext_proc predicted
the engine held with the tokens the engine reports it reused
(``usage.prompt_tokens_details.cached_tokens``). The cheapest correct way for the ext_proc to learn the
second number: Envoy parses the response body itself (C++, once per response) into dynamic metadata
``kvgate.usage/cached_tokens``, and the completion log (:func:`kvgate.envoy.resilience.completion_loggers`),
which every ext_proc already receives for each routed request, carries it with the decision's own
metadata (model, endpoint, predicted tokens). The ext_proc's processing mode stays as it is
(``response_body_mode: NONE``): no response message crosses the ext_proc stream, no Python runs per
chunk.

Only ``application/json`` responses are read (non-streamed completions). A stream (``text/event-stream``)
is passed on untouched and carries no count: its usage sits in the last SSE chunk (with
``stream_options.include_usage``), which Envoy cannot parse, and reading it in the ext_proc would cost
one gRPC message per chunk of every stream. An engine that does not report the field (vLLM without
``--enable-prompt-tokens-details``) adds nothing: such requests are not compared.
"""

from __future__ import annotations

from typing import Any

from contracts.epp import USAGE_CACHED, USAGE_NS

_JSON_TO_METADATA = "type.googleapis.com/envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata"


def usage_filter() -> dict[str, Any]:
    """The filter (placed before the router): ``usage.prompt_tokens_details.cached_tokens`` of a JSON
    response into ``kvgate.usage/cached_tokens`` (a number); nothing when absent or not JSON."""
    selectors = [{"key": "usage"}, {"key": "prompt_tokens_details"}, {"key": USAGE_CACHED}]
    return {
        "name": "envoy.filters.http.json_to_metadata",
        "typed_config": {
            "@type": _JSON_TO_METADATA,
            "response_rules": {
                "rules": [
                    {
                        "selectors": selectors,
                        "on_present": {"metadata_namespace": USAGE_NS, "key": USAGE_CACHED, "type": "NUMBER"},
                    }
                ],
                "allow_content_types": ["application/json"],
            },
        },
    }
