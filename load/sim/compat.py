"""Routes peer routers probe on their workers, so SGLang's and vLLM's own routers can front the simulator.

Found by running each router against the simulator and reading its logs and the requests it sent:

* ``sglang-router`` (``smg launch``) discovers a worker's model with ``GET /server_info`` and
  ``GET /model_info`` (falling back to ``/get_server_info`` and ``/get_model_info`` on 404), then
  ``GET /v1/models``; without them it registers the worker for model ``unknown``. Health: ``GET /health``.
  It first probes each worker with an HTTP/2 preface (gRPC detection), which the simulator's HTTP/1.1
  server logs as a bad request and the router then talks HTTP/1.1. ``server_info`` reports the
  replica's SGLang ``disaggregation_mode``; in its PD mode (``--pd-disaggregation``) the router sends
  each request to a prefill and a decode worker at once (:mod:`load.sim.bootstrap`).
* ``vllm-router`` with ``--policy cache_aware`` sends every request first to
  ``POST /v1/chat/completions/render`` (or ``/v1/completions/render``) of **every** worker to get the
  prompt's token ids, falling back to ``POST /tokenize`` when that is missing; it also reads
  ``GET /version``.

The answers carry what those routers read (model path and name, context length, token ids), in the
shapes SGLang and vLLM give them; nothing here changes how the simulated engine serves requests.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Protocol

import orjson
from aiohttp import web

from load.sim import protocol as api
from load.sim.engine import EngineConfig

#: What ``GET /version`` reports: the vLLM release whose API the simulator follows.
VLLM_API_VERSION = "0.11.0"


class ServedModel(Protocol):
    """What a replica serves: the served model name, its Hugging Face style directory, the engine's shape."""

    @property
    def model(self) -> str: ...

    @property
    def model_dir(self) -> Path: ...

    @property
    def engine(self) -> EngineConfig: ...


class Replica(Protocol):
    """What the routes read from a replica (:class:`load.sim.server.SimReplica` is one): what it serves,
    and its own request reading, so a render answers the token ids serving the same body would use."""

    @property
    def config(self) -> ServedModel: ...

    @property
    def disaggregation_mode(self) -> str:
        """SGLang's ``--disaggregation-mode`` (``null``, ``prefill``, ``decode``)."""
        ...

    async def read_body(self, request: web.Request) -> dict[str, Any]:
        """The request's JSON body, checked (a :class:`~load.sim.protocol.SimError` when invalid or for
        another model)."""
        ...

    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        """The prompt token ids of a chat body (rendered with the chat template)."""
        ...

    def prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """The prompt token ids of a completion body."""
        ...


def compat_routes(replica: Replica) -> list[web.RouteDef]:
    """The extra routes of one replica."""

    def model_fields() -> dict[str, Any]:
        root = str(replica.config.model_dir)
        return {"model_path": root, "tokenizer_path": root, "served_model_name": replica.config.model}

    async def server_info(request: web.Request) -> web.Response:
        engine = replica.config.engine
        info = {
            **model_fields(),
            "model_id": replica.config.model,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "context_length": engine.max_model_len,
            "max_total_tokens": engine.num_blocks * engine.block_size,
            "page_size": engine.block_size,
            "max_running_requests": engine.max_num_seqs,
            "chunked_prefill_size": engine.max_num_batched_tokens,
            "disaggregation_mode": replica.disaggregation_mode,
            "is_embedding": False,
            "version": VLLM_API_VERSION,
        }
        return _json(info)

    async def model_info(request: web.Request) -> web.Response:
        return _json(
            {
                **model_fields(),
                "is_generation": True,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }
        )

    async def version(request: web.Request) -> web.Response:
        return _json({"version": VLLM_API_VERSION})

    async def render_chat(request: web.Request) -> web.Response:
        body = await replica.read_body(request)
        return _json(_rendered(replica.config.model, replica.chat_ids(body), body))

    async def render_completion(request: web.Request) -> web.Response:
        body = await replica.read_body(request)
        return _json(_rendered(replica.config.model, replica.prompt_ids(body), body))

    return [
        web.get("/server_info", server_info),
        web.get("/get_server_info", server_info),
        web.get("/model_info", model_info),
        web.get("/get_model_info", model_info),
        web.get("/version", version),
        web.post("/v1/chat/completions/render", render_chat),
        web.post("/v1/completions/render", render_completion),
    ]


def _rendered(model: str, token_ids: list[int], body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's render answer: the generate request the prompt becomes (``token_ids`` is what routers use)."""
    gen = api.parse_sampling({k: v for k, v in body.items() if k != "stream_options"}, chat=True)
    sampling: dict[str, Any] = {"max_tokens": gen.max_tokens} if gen.max_tokens is not None else {}
    return {
        "request_id": f"render-{uuid.uuid4().hex}",
        "model": model,
        "token_ids": token_ids,
        "features": None,
        "sampling_params": sampling,
        "stream": gen.stream,
    }


def _json(payload: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")
