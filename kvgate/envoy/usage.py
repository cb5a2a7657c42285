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

Only ``application/json`` responses under 1 MB are read (non-streamed completions; the filter buffers
the body it reads, so larger or unsized ones are skipped by a matcher). A stream (``text/event-stream``)
is passed on untouched and carries no count: its usage sits in the last SSE chunk (with
``stream_options.include_usage``), which Envoy cannot parse, and reading it in the ext_proc would cost
one gRPC message per chunk of every stream. An engine that does not report the field (vLLM without
``--enable-prompt-tokens-details``) adds nothing: such requests are not compared.

The same filter reads the response's top-level ``id`` into ``kvgate.usage/response_id``: for a Responses
API request (``/v1/responses``) the completion log then tells the ext_procs which endpoint produced that
response, for ``previous_response_id`` affinity (:mod:`extproc.affinity`). Streams carry no id here either.
"""

from __future__ import annotations

from typing import Any

from contracts.epp import USAGE_CACHED, USAGE_NS, USAGE_RESPONSE_ID

_JSON_TO_METADATA = "type.googleapis.com/envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata"
_WITH_MATCHER = "type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher"
_RESPONSE_HEADER = "type.googleapis.com/envoy.type.matcher.v3.HttpResponseHeaderMatchInput"
_SKIP = "type.googleapis.com/envoy.extensions.filters.common.matcher.action.v3.SkipFilter"
#: Responses read: a ``content-length`` of at most 6 digits (under 1 MB). The filter buffers the body it
#: reads, and a body past the listener's buffer limit would fail the response (500; measured on 1.40 with
#: a 5 MB ``top_logprobs`` answer); a larger or chunked response passes untouched and is not compared.
MAX_LENGTH_DIGITS = 6


def usage_filter() -> dict[str, Any]:
    """The filter (placed before the router): ``usage.prompt_tokens_details.cached_tokens`` of a JSON
    response under 1 MB into ``kvgate.usage/cached_tokens`` (a number); nothing when absent, not JSON,
    larger or of unknown length (skipped by a matcher on the response's ``content-length``)."""
    selectors = [{"key": "usage"}, {"key": "prompt_tokens_details"}, {"key": USAGE_CACHED}]
    small = {
        "input": {
            "name": "content-length",
            "typed_config": {"@type": _RESPONSE_HEADER, "header_name": "content-length"},
        },
        "value_match": {"safe_regex": {"google_re2": {}, "regex": f"^[0-9]{{1,{MAX_LENGTH_DIGITS}}}$"}},
    }
    return {
        "name": "envoy.filters.http.json_to_metadata",
        "typed_config": {
            "@type": _WITH_MATCHER,
            "extension_config": {
                "name": "envoy.filters.http.json_to_metadata",
                "typed_config": {
                    "@type": _JSON_TO_METADATA,
                    "response_rules": {
                        "rules": [
                            {
                                "selectors": selectors,
                                "on_present": {
                                    "metadata_namespace": USAGE_NS,
                                    "key": USAGE_CACHED,
                                    "type": "NUMBER",
                                },
                            },
                            {  # the response's id: previous_response_id affinity (extproc/affinity)
                                "selectors": [{"key": "id"}],
                                "on_present": {
                                    "metadata_namespace": USAGE_NS,
                                    "key": USAGE_RESPONSE_ID,
                                    "type": "STRING",
                                },
                            },
                        ],
                        "allow_content_types": ["application/json"],
                    },
                },
            },
            "xds_matcher": {
                "matcher_list": {
                    "matchers": [
                        {
                            "predicate": {"not_matcher": {"single_predicate": small}},
                            "on_match": {"action": {"name": "skip", "typed_config": {"@type": _SKIP}}},
                        }
                    ]
                }
            },
        },
    }
