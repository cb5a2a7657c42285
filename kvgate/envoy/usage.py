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
response, for ``previous_response_id`` affinity (:mod:`extproc.affinity`). A streamed Responses answer
(SSE) is read by :func:`stream_id_filter` instead: a Lua filter that looks for the id in the first events
only (``response.created`` carries it) and then lets the rest stream by untouched.
"""

from __future__ import annotations

from typing import Any

from contracts.epp import DECISION_NS, DECISION_RESPONSES_SCOPE, USAGE_CACHED, USAGE_NS, USAGE_RESPONSE_ID

_JSON_TO_METADATA = "type.googleapis.com/envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata"
_WITH_MATCHER = "type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher"
_RESPONSE_HEADER = "type.googleapis.com/envoy.type.matcher.v3.HttpResponseHeaderMatchInput"
_SKIP = "type.googleapis.com/envoy.extensions.filters.common.matcher.action.v3.SkipFilter"
_LUA = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua"
_REQUEST_HEADER = "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput"
RESPONSES_PATH = "/v1/responses"
#: Bytes of a streamed Responses answer searched for its id (``response.created`` is the first event).
STREAM_ID_WINDOW = 8192
#: The id of a streamed Responses answer: the first ``"id": "resp_..."`` (OpenAI's, vLLM's and SGLang's
#: prefix; the response object's first key in ``response.created``). Lua pattern.
STREAM_ID_PATTERN = '"id"%s*:%s*"(resp_[%w_%-%.]+)"'

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


_STREAM_ID_LUA = f"""
function envoy_on_response(handle)
  local decision = handle:streamInfo():dynamicMetadata():get("{DECISION_NS}")
  if decision == nil or decision["{DECISION_RESPONSES_SCOPE}"] == nil then
    return
  end
  local seen = ""
  for chunk in handle:bodyChunks() do
    seen = seen .. chunk:getBytes(0, math.min(chunk:length(), {STREAM_ID_WINDOW}))
    local id = string.match(seen, '{STREAM_ID_PATTERN}')
    if id ~= nil then
      handle:streamInfo():dynamicMetadata():set("{USAGE_NS}", "{USAGE_RESPONSE_ID}", id)
      return
    end
    if #seen >= {STREAM_ID_WINDOW} then
      return
    end
  end
end
"""


def stream_id_filter() -> dict[str, Any]:
    """A Lua filter (placed before the router) for streamed Responses API answers: the response id from
    the first events into ``kvgate.usage/response_id``, as :func:`usage_filter` does for JSON answers.
    Skipped by a matcher unless the request's path is ``/v1/responses`` and the answer is
    ``text/event-stream`` (so chat and completion streams never run Lua); inside, it acts only on requests
    the ext_proc marked as Responses API ones (``kvgate.decision/responses_scope``) and reads at most
    :data:`STREAM_ID_WINDOW` bytes: Lua's ``bodyChunks`` sees each chunk as it passes (nothing is
    buffered), and once the id is found (the first event) the rest of the stream passes untouched."""
    stream = {
        "single_predicate": {
            "input": {
                "name": "content-type",
                "typed_config": {"@type": _RESPONSE_HEADER, "header_name": "content-type"},
            },
            "value_match": {"prefix": "text/event-stream"},
        }
    }
    responses_api = {  # chat and completion streams never reach the Lua code
        "single_predicate": {
            "input": {"name": "path", "typed_config": {"@type": _REQUEST_HEADER, "header_name": ":path"}},
            "value_match": {"prefix": RESPONSES_PATH},
        }
    }
    return {
        "name": "kvgate.responses_stream_id",
        "typed_config": {
            "@type": _WITH_MATCHER,
            "extension_config": {
                "name": "envoy.filters.http.lua",
                "typed_config": {"@type": _LUA, "default_source_code": {"inline_string": _STREAM_ID_LUA}},
            },
            "xds_matcher": {
                "matcher_list": {
                    "matchers": [
                        {
                            "predicate": {
                                "not_matcher": {"and_matcher": {"predicate": [stream, responses_api]}}
                            },
                            "on_match": {"action": {"name": "skip", "typed_config": {"@type": _SKIP}}},
                        }
                    ]
                }
            },
        },
    }
