"""What the fuzz tests share: the example budget and strategies for JSON values and OpenAI bodies.

``KVGATE_FUZZ_EXAMPLES`` sets how many examples each property runs (default :data:`CI_EXAMPLES`, small
enough that ``tests/fuzz`` stays under a CI-minute); a long campaign sets it to thousands::

    KVGATE_FUZZ_EXAMPLES=20000 python -m pytest -q tests/fuzz
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

CI_EXAMPLES = 60
EXAMPLES = int(os.environ.get("KVGATE_FUZZ_EXAMPLES", CI_EXAMPLES))

#: The settings of every fuzz property: the example budget, no deadline (a loaded CI machine), no
#: shrinking time limit beyond Hypothesis' own, and fixtures shared across examples are fine here (each
#: property builds fresh cores per example where state matters).
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)

#: Integers at and around the edges the code cares about (token ids, int64, u32, u64).
EDGES = (0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, -(2**63), 2**64 - 1)
edge_ints = st.sampled_from(EDGES) | st.integers(-(2**63), 2**64 - 1)
json_scalars = (
    st.none()
    | st.booleans()
    | edge_ints
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=16)
)


def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any JSON value (what ``orjson.loads`` can return)."""
    return st.recursive(
        json_scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=max_leaves,
    )


#: Every body field the gateway reads on some route (extproc/routing, admission, flow, burst, cascade),
#: and a few it passes through.
FIELDS = (
    "model",
    "messages",
    "prompt",
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "seed",
    "stop",
    "stop_token_ids",
    "bad_words",
    "stream_options",
    "top_logprobs",
    "logprobs",
    "prompt_logprobs",
    "response_format",
    "echo",
    "suffix",
    "use_beam_search",
    "tools",
    "tool_choice",
    "continue_final_message",
    "add_generation_prompt",
    "chat_template_kwargs",
    "cache_salt",
    "input",
    "instructions",
    "query",
    "documents",
    "queries",
    "data_1",
    "data_2",
    "text_1",
    "text_2",
    "top_n",
    "prompt_embeds",
    "priority",
    "user",
    "chat_template",
)

#: A valid body of each routed path, the base the mutations start from.
BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "hello", "max_tokens": 4},
    "/v1/embeddings": {"input": "hello"},
    "/v1/responses": {"input": "hello"},
    "/v1/score": {"text_1": "a", "text_2": ["b"]},
    "/v1/rerank": {"query": "a", "documents": ["b", {"text": "c"}]},
}
ROUTED = (*BASES, "/score", "/rerank", "/v2/rerank")

messages_values = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer"]) | json_values(3)},
        optional={
            "content": st.text(max_size=40)
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "input_text", "image_url", "refusal"]) | json_values()},
                    optional={"text": st.text(max_size=20) | json_values(2)},
                ),
                max_size=3,
            )
            | json_values(3),
            "tool_calls": json_values(6),
            "tool_call_id": json_values(2),
            "name": json_values(2),
            "reasoning": json_values(2),
        },
    ),
    min_size=0,
    max_size=4,
)


@st.composite
def mutated_body(draw: st.DrawFn, path: str, model: str) -> dict[str, Any]:
    """A valid body of ``path`` with some fields replaced by arbitrary JSON (or by near-valid values),
    some removed."""
    base = dict(BASES.get(path, BASES["/v1/chat/completions"] if "chat" in path else BASES["/v1/score"]))
    base["model"] = model
    changes = draw(
        st.dictionaries(
            st.sampled_from(FIELDS) | st.text(max_size=8),
            json_values(8) | st.just([]) | st.just(""),
            max_size=4,
        )
    )
    if draw(st.booleans()):
        changes["messages"] = draw(messages_values)
    if draw(st.integers(0, 3)) == 0:  # token ids, long enough to fill blocks, some past 32 bits
        ids = st.lists(st.integers(0, 60_000) | edge_ints, min_size=1, max_size=40)
        field = draw(st.sampled_from(["prompt", "input"]))
        changes[field] = draw(ids | st.lists(ids, min_size=1, max_size=2))
    for key in draw(st.lists(st.sampled_from(sorted(base)), max_size=2)):
        base.pop(key, None)
    body = {**base, **changes}
    if draw(st.integers(0, 4)) == 0:
        body["model"] = model  # most bodies keep a served model, so that they go further
    return body
