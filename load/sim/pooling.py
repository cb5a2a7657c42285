"""The routes a replica answers besides chat and completions: embeddings, the Responses API, score and
rerank. What a pooling model would answer, from the simulated generative replica: the point is that
kvgate routes these paths (by model, prefix-aware) and that an answer of the right shape comes back.

- ``POST /v1/embeddings``: OpenAI's shape (``data[i].embedding`` floats, or base64 of little-endian
  float32 with ``encoding_format: "base64"``; ``dimensions`` default 64; ``usage``). Vectors are
  deterministic per input (a hash of its token ids), unit length: not semantic.
- ``POST /v1/responses``: ``input`` (string or message items) and ``instructions`` become a chat,
  generated like ``/v1/chat/completions``; the answer is a Responses object (``output`` one
  ``message`` with ``output_text``, ``usage.input_tokens``/``output_tokens``). With ``stream: true`` the
  same answer comes as Responses stream events (``event: response.created`` ... ``response.completed``,
  OpenAI's SSE shape, the text in one ``response.output_text.delta``), all written once the answer is
  generated: the wire format is real, the time to the first event is the whole generation's.
- ``POST /score``, ``/v1/score`` (vLLM: ``queries``/``documents``, ``data_1``/``data_2`` or
  ``text_1``/``text_2``) and ``POST /rerank``, ``/v1/rerank``, ``/v2/rerank`` (``query``, ``documents``,
  ``top_n``): scores in [0, 1] from a hash of each pair, vLLM's response shapes.

Each input is prefilled by the engine (one output token, then dropped), so these requests take a
prompt's prefill time, load the replica and use and fill its prefix cache like any other.
"""

from __future__ import annotations

import base64
import math
import struct
import time
import uuid
import zlib
from collections.abc import Sequence
from typing import Any

import orjson
from aiohttp import web

from contracts.digest import pack_tokens
from load.sim import protocol as api
from load.sim.errors import invalid
from load.sim.serving import Identity, Serving

#: Default embedding size (floats).
DIMENSIONS = 64


class PoolingRoutes:
    """Embeddings, responses, score and rerank of one replica (module docstring)."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def embeddings(self, request: web.Request, body: dict[str, Any]) -> web.Response:
        inputs = _inputs(body.get("input"))
        dims = body.get("dimensions", DIMENSIONS)
        if not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= 4096:
            raise invalid("dimensions must be an integer between 1 and 4096", "dimensions", dims)
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise invalid("encoding_format must be 'float' or 'base64'", "encoding_format", fmt)
        identity = self.serving.identity(body)
        data, used = [], 0
        for i, item in enumerate(inputs):
            ids = self._ids(item)
            used += len(ids)
            await self._prefill(ids, identity)
            vector = _vector(ids, dims)
            embedding: Any = (
                vector if fmt == "float" else base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode()
            )
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        out = {
            "id": f"embd-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": body.get("model") or self.serving.model,
            "data": data,
            "usage": {"prompt_tokens": used, "total_tokens": used},
        }
        return _json(out)

    async def responses(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        chat: dict[str, Any] = {"model": body.get("model") or self.serving.model, "messages": _messages(body)}
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        for key in ("temperature", "top_p", "seed", "cache_salt"):
            if body.get(key) is not None:
                chat[key] = body[key]
        answer = await self.serving.chat(request, chat)
        assert isinstance(answer, web.Response) and answer.body is not None
        done = orjson.loads(answer.body)  # type: ignore[arg-type]
        text = done["choices"][0]["message"]["content"] or ""
        usage = done["usage"]
        out = {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "status": "completed",
            "model": chat["model"],
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "output": [
                {
                    "type": "message",
                    "id": f"msg_{uuid.uuid4().hex}",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ],
            "usage": {
                "input_tokens": usage["prompt_tokens"],
                "output_tokens": usage["completion_tokens"],
                "total_tokens": usage["total_tokens"],
            },
        }
        if not body.get("stream"):
            return _json(out)
        return await _response_events(request, out, text)

    async def score(self, request: web.Request, body: dict[str, Any]) -> web.Response:
        pairs = [("queries", "documents"), ("data_1", "data_2"), ("text_1", "text_2")]
        given = [(a, b) for a, b in pairs if a in body or b in body]
        if len(given) != 1:
            raise invalid("a score request needs queries and documents (or text_1 and text_2)", "queries")
        a, b = given[0]
        left, right = _texts(body.get(a), a), _texts(body.get(b), b)
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise invalid(f"{a} and {b} must be of the same length (or {a} a single text)", a)
        scored, used = await self._pairs(body, list(zip(left, right, strict=True)))
        created = int(time.time())
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scored)]
        out = {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": created,
            "model": body.get("model") or self.serving.model,
            "data": data,
            "usage": {"prompt_tokens": used, "total_tokens": used},
        }
        return _json(out)

    async def rerank(self, request: web.Request, body: dict[str, Any]) -> web.Response:
        query = body.get("query")
        if not isinstance(query, str) or not query:
            raise invalid("query must be a non-empty string", "query", query)
        raw = body.get("documents")
        if not isinstance(raw, list) or not raw:
            raise invalid("documents must be a non-empty list", "documents")
        docs = [d if isinstance(d, str) else d.get("text") if isinstance(d, dict) else None for d in raw]
        if not all(isinstance(d, str) for d in docs):
            raise invalid("documents must be strings or objects with a text", "documents")
        texts = [str(d) for d in docs]
        top_n = body.get("top_n", 0)
        if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
            raise invalid("top_n must be an integer >= 0", "top_n", top_n)
        scored, used = await self._pairs(body, [(query, d) for d in texts])
        order = sorted(range(len(texts)), key=lambda i: -scored[i])[: top_n or len(texts)]
        results = [{"index": i, "document": {"text": texts[i]}, "relevance_score": scored[i]} for i in order]
        out = {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": body.get("model") or self.serving.model,
            "usage": {"total_tokens": used},
            "results": results,
        }
        return _json(out)

    async def _pairs(self, body: dict[str, Any], pairs: Sequence[tuple[str, str]]) -> tuple[list[float], int]:
        """Each (query, document) prefilled as one prompt, query first (a cross-encoder's input)."""
        identity = self.serving.identity(body)
        scores, used = [], 0
        for query, doc in pairs:
            ids = self._ids(query) + self._ids(doc, special=False)
            used += len(ids)
            await self._prefill(ids, identity)
            scores.append((zlib.crc32(pack_tokens(ids)) % 10_000) / 10_000)
        return scores, used

    def _ids(self, item: str | list[int], special: bool = True) -> list[int]:
        serving = self.serving
        if isinstance(item, str):
            ids = serving.tokenizer.encode(item, add_special_tokens=special)
        else:
            ids = list(item)
            if max(ids) >= serving.tokenizer.vocab_size:
                raise invalid(f"Token id {max(ids)} is out of vocabulary")
        api.check_prompt_len(len(ids), serving.max_model_len - 1, text=isinstance(item, str))
        return ids

    async def _prefill(self, ids: list[int], identity: Identity) -> None:
        """Run ``ids`` through the engine's prefill (one output token, dropped)."""
        driver = self.serving.driver
        rid = f"pool-{uuid.uuid4().hex}"
        queue = driver.submit(rid, ids, [ids[-1]], seed=identity.seed, lora=identity.lora, salt=identity.salt)
        try:
            while not (await queue.get()).finished:
                pass
        finally:
            driver.abort(rid)


def _inputs(value: object) -> list[str | list[int]]:
    """Embeddings ``input``: a string, token ids, or a non-empty list of either."""
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and _token_ids(value):
        return [[int(t) for t in value]]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) and v for v in value):
            return [str(v) for v in value]
        if all(_token_ids(v) for v in value):
            return [[int(t) for t in v] for v in value]
    raise invalid("input must be a non-empty string, token ids, or a list of either", "input")


def _token_ids(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )


def _texts(value: object, key: str) -> list[str]:
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return [str(v) for v in value]
    raise invalid(f"{key} must be a non-empty string or list of strings", key)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The Responses API's ``instructions`` and ``input`` as chat messages (text parts joined)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if isinstance(raw, str) and raw:
        return [*messages, {"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise invalid("input must be a non-empty string or list of items", "input")
    for item in raw:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            continue
        content = item.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise invalid("input items need a string content or text parts", "input")
        role = item.get("role")
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    if not messages:
        raise invalid("input holds no message", "input")
    return messages


def _vector(ids: Sequence[int], dims: int) -> list[float]:
    """A unit vector determined by ``ids``."""
    seed = zlib.crc32(pack_tokens(ids))
    raw = [math.sin(seed * 0.001 + i * 1.618) for i in range(dims)]
    norm = math.sqrt(sum(v * v for v in raw)) or 1.0
    return [v / norm for v in raw]


async def _response_events(request: web.Request, out: dict[str, Any], text: str) -> web.StreamResponse:
    """``out`` (a completed Responses object) as OpenAI's Responses stream events."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    item = out["output"][0]
    part = item["content"][0]
    started = {**out, "status": "in_progress", "output": [], "usage": None}
    ids = {"item_id": item["id"], "output_index": 0}
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": started}),
        ("response.in_progress", {"response": started}),
        (
            "response.output_item.added",
            {"output_index": 0, "item": {**item, "status": "in_progress", "content": []}},
        ),
        ("response.content_part.added", {**ids, "content_index": 0, "part": {**part, "text": ""}}),
        ("response.output_text.delta", {**ids, "content_index": 0, "delta": text}),
        ("response.output_text.done", {**ids, "content_index": 0, "text": text}),
        ("response.content_part.done", {**ids, "content_index": 0, "part": part}),
        ("response.output_item.done", {"output_index": 0, "item": item}),
        ("response.completed", {"response": out}),
    ]
    for number, (kind, fields) in enumerate(events):
        data = orjson.dumps({"type": kind, "sequence_number": number, **fields})
        await response.write(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")
    await response.write_eof()
    return response


def _json(out: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(out), content_type="application/json")
