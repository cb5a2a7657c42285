"""The simulator's IO shell: per-replica vLLM-compatible HTTP servers, a fleet, and ``main``.

Each :class:`SimReplica` is an aiohttp app over its own :class:`~load.sim.engine.Engine`, pumped by an
:class:`EngineDriver` task, with its own Prometheus registry. :class:`SimFleet` hosts N replicas in one
event loop sharing one tokenizer; :func:`main` is ``kvgate sim`` (also ``python -m load.sim.server``).
Every response carries ``x-kvgate-replica: <id>``. Over TLS with client certificates required
(``--tls-client-ca``), every request must also come from an identity that may call an engine
(:data:`certs.roles.CALLERS`: ``envoy-edge``, ``extproc``, ``agent``); another gets 403 with an
OpenAI-style JSON error, whatever the route.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import logging
import os
import signal
import socket
import ssl
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics, generate_latest

from contracts.digest import chain_seed
from load.sim import protocol as api
from load.sim import responses
from load.sim.bootstrap import (
    BOOTSTRAP_TIMEOUT_ENV,
    DEFAULT_BOOTSTRAP_PORT,
    MODES,
    WAITING_TIMEOUT_ENV,
    Handshake,
    RoomFailed,
    env_timeout,
)
from load.sim.cache import CacheListener
from load.sim.compat import compat_routes
from load.sim.driver import EngineDriver
from load.sim.engine import SCHEDULING_POLICIES, Engine, EngineConfig
from load.sim.errors import SimError
from load.sim.fields import lax_bool, opt, strict_str
from load.sim.handoff import ROLES
from load.sim.kvevents import KvEventPublisher, KvEventsConfig, sink
from load.sim.metrics import dcgm_registry, replica_registry
from load.sim.pooling import PoolingRoutes
from load.sim.power import GPU_CLASSES, PowerModel
from load.sim.reset import RESET_AFTER, reset_connection
from load.sim.serving import Serving, SglangPd, ToolParsing
from load.sim.timing import TimingModel
from load.sim.tokenizer import SimTokenizer, load_tokenizer
from runtime.identity import ENGINE, peercert_uris, permits

log = logging.getLogger(__name__)

DCGM_PATH = "/dcgm/metrics"
"""Where a replica with a power model serves dcgm-exporter's format (its GPU's power, energy, clocks)."""

REPLICA_HEADER = "x-kvgate-replica"
MAX_BODY_BYTES = 32 * 1024 * 1024  # aiohttp's default of 1 MiB is below long-context prompts


@dataclass(frozen=True, slots=True)
class SimConfig:
    """What each replica serves: ``model`` is the served name, ``model_dir`` a Hugging Face style
    directory (tokenizer.json, tokenizer_config.json), ``chat_template`` a template file or template
    text overriding the tokenizer's, ``kv_events`` vLLM's ``--kv-events-config`` (replica ``i`` is
    data-parallel rank ``i``), ``role`` the replica's part in prefill/decode disaggregation (``both``: none;
    :mod:`load.sim.handoff`)."""

    model: str
    model_dir: Path
    chat_template: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    timing: TimingModel = field(default_factory=TimingModel)
    kv_events: KvEventsConfig | None = None
    tool_parsing: ToolParsing = field(default_factory=ToolParsing)
    role: str = "both"
    #: GPU power models (:mod:`load.sim.power`), replica ``i`` taking ``power[i % len(power)]``; with one, a
    #: replica serves dcgm-exporter's format at ``/dcgm/metrics``. Empty: no power simulated.
    power: tuple[PowerModel, ...] = ()
    #: SGLang's prefill/decode disaggregation (:mod:`load.sim.bootstrap`; ``mode`` ``null``: none), and a
    #: prefill replica's bootstrap port (replica ``i`` of a process takes ``bootstrap_port + i``; 0: any).
    sglang_pd: SglangPd = field(default_factory=SglangPd)
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    #: LoRA adapters served by name (vLLM ``--lora-modules``; slots: ``engine.max_loras``).
    lora_modules: tuple[str, ...] = ()
    #: As vLLM's ``--api-key``: every ``/v1`` request must carry ``Authorization: Bearer <api_key>``
    #: (401 otherwise); ``None``: none needed.
    api_key: str | None = None


class SimReplica:
    """One simulated vLLM replica: engine, driver, metrics, HTTP app and, when enabled, the KV event
    publisher of data-parallel rank ``rank``."""

    def __init__(
        self,
        replica_id: str,
        config: SimConfig,
        tokenizer: SimTokenizer,
        listener: CacheListener | None = None,
        rank: int = 0,
    ) -> None:
        self.id = replica_id
        self.config = config
        self.tokenizer = tokenizer
        kv = config.kv_events
        sglang = config.sglang_pd.mode != "null"
        self.kv_events = (
            KvEventPublisher(kv, rank, config.engine.block_size, sglang)
            if kv is not None and kv.enabled
            else None
        )
        self.rank = rank
        listener = sink(self.kv_events, listener)
        power = config.power[rank % len(config.power)] if config.power else None
        self.engine = Engine(config.engine, config.timing, chain_seed(config.model), listener, power)
        self.registry, observe_ttft = replica_registry(
            self.engine, config.model, sglang=sglang, lora=bool(config.lora_modules)
        )
        self.dcgm = None if power is None else dcgm_registry(self.engine, replica_id, time.monotonic)
        self.driver = EngineDriver(self.engine, observe_ttft)
        self.serving = Serving(
            config.model,
            config.engine.max_model_len,
            tokenizer,
            self.driver,
            config.tool_parsing,
            role=config.role,
            engine_id=replica_id,
            pd=config.sglang_pd,
            adapters=config.lora_modules,
        )
        #: Embeddings, responses, score and rerank (load/sim/pooling.py).
        self.pooling = PoolingRoutes(self.serving)
        #: Generate requests still to fail with a 500 (the ``/_sim/fail_next`` test hook), and still to be
        #: held that many seconds before they are served (``/_sim/delay_next``).
        self.fail_next = 0
        self.delay_next = (0, 0.0)
        #: Generate requests still to be answered with a TCP reset, and after how many SSE events
        #: (``/_sim/reset_next``, :mod:`load.sim.reset`).
        self.reset_next = (0, 0)
        #: ``/v1`` requests with the right key and without, and a SHA-256 of the last ``Authorization``
        #: seen (``/_sim/auth``: a test checks which credential arrived without the key being echoed).
        self.auth_seen = {"accepted": 0, "rejected": 0}
        self.last_authorization: str | None = None
        self.address = ""
        #: A prefill replica's bootstrap port once it listens (SGLang's PD mode), else ``None``.
        self.bootstrap_port: int | None = None
        self._bootstrap: web.AppRunner | None = None
        self._runner: web.AppRunner | None = None
        self._created = int(time.time())

    async def start(self, sock: socket.socket, ssl_context: ssl.SSLContext | None = None) -> None:
        """Serve on a bound socket (HTTPS with ``ssl_context``) and start the engine. When the context
        requires client certificates, only engine callers' identities are served (module docstring)."""
        if self.kv_events is not None:
            await self.kv_events.start()
        checked = ssl_context is not None and ssl_context.verify_mode == ssl.CERT_REQUIRED
        middlewares = [_engine_callers, self._errors] if checked else [self._errors]
        if self.config.api_key is not None:
            middlewares.insert(0, self._api_key)
        app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
        app.on_response_prepare.append(self._tag)
        app.add_routes(
            [
                web.post("/v1/chat/completions", self._chat),
                web.post("/v1/completions", self._completion),
                web.post("/v1/embeddings", self._pooled(self.pooling.embeddings)),
                web.post("/v1/responses", self._pooled(self.pooling.responses)),
                *(web.post(p, self._pooled(self.pooling.score)) for p in ("/score", "/v1/score")),
                *(
                    web.post(p, self._pooled(self.pooling.rerank))
                    for p in ("/rerank", "/v1/rerank", "/v2/rerank")
                ),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.post("/tokenize", self._tokenize),
                web.post("/detokenize", self._detokenize),
                web.post("/reset_prefix_cache", self._reset_prefix_cache),
                web.get("/metrics", self._metrics),
                web.post("/_sim/fail_next", self._fail_next),
                web.post("/_sim/delay_next", self._delay_next),
                web.post("/_sim/reset_next", self._reset_next),
                web.get("/_sim/auth", self._auth_seen),
                *compat_routes(self),
            ]
        )
        if self.kv_events is not None:
            app.router.add_post("/_sim/drop_next_kv_batches", self._drop_next_kv_batches)
        if self.dcgm is not None:
            app.router.add_get(DCGM_PATH, self._dcgm_metrics)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.1)
        await self._runner.setup()
        host, port = sock.getsockname()[:2]
        await web.SockSite(self._runner, sock, ssl_context=ssl_context).start()
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.serving.side_channel = (host, port)
        if self.config.sglang_pd.mode == "prefill":
            base = self.config.bootstrap_port
            await self._start_bootstrap(bind(host, base + self.rank if base else 0))
        self.driver.start()

    async def _start_bootstrap(self, sock: socket.socket) -> None:
        """SGLang's bootstrap server of a prefill replica (plain HTTP, as SGLang's): ``GET /health``,
        ``GET /route`` (its topology: one rank) and the simulator's KV hand-over, ``POST /_sim/kv/{room}``
        (:mod:`load.sim.bootstrap`)."""
        app = web.Application()
        app.add_routes(
            [
                web.get("/health", self._bootstrap_health),
                web.route("*", "/route", self._bootstrap_route),
                web.post("/_sim/kv/{room}", self._bootstrap_kv),
            ]
        )
        self._bootstrap = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.1)
        await self._bootstrap.setup()
        await web.SockSite(self._bootstrap, sock).start()
        self.bootstrap_port = sock.getsockname()[1]

    @property
    def disaggregation_mode(self) -> str:
        return self.config.sglang_pd.mode

    async def _bootstrap_health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _bootstrap_route(self, request: web.Request) -> web.Response:
        """SGLang's ``/route``: GET with ``prefill_dp_rank``, ``prefill_cp_rank``, ``target_tp_rank`` and
        ``target_pp_rank`` all -1 is the server's parallel info, with 0 the one rank's address."""
        if request.method != "GET":
            return web.Response(status=405, text="Method not allowed")
        keys = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        values = [request.query.get(k) for k in keys]
        if not all(values):
            return web.Response(status=400, text="Missing inputs for bootstrap server.")
        if all(v == "-1" for v in values):
            engine = self.config.engine
            info = {
                "attn_tp_size": 1,
                "attn_cp_size": 1,
                "dp_size": 1,
                "pp_size": 1,
                "page_size": engine.block_size,
                "kv_cache_dtype": "auto",
                "follow_bootstrap_room": True,
                "enable_dsa_cache_layer_split": False,
                "prefill_http_port": int(self.address.rpartition(":")[2]),
            }
            return _json(info)
        if not all(v == "0" for v in values):
            return web.Response(
                status=404, text=f"Bootstrap info not found for {dict(zip(keys, values, strict=True))}"
            )
        return _json(
            {"rank_ip": self.address.rpartition(":")[0].strip("[]"), "rank_port": self.bootstrap_port}
        )

    async def _bootstrap_kv(self, request: web.Request) -> web.Response:
        """A decode replica connects to a room and waits for its KV (the simulator's stand-in for SGLang's
        ZMQ/RDMA channel): 200 ``{engine_id, prompt_tokens, tokens}``, 409 when the prefill side failed."""
        try:
            room = int(request.match_info["room"])
            doc = await request.json()
            handshake = Handshake(str(doc["decode"]), int(doc["cached_tokens"]))
        except (ValueError, KeyError, TypeError):
            return web.Response(status=400, body=orjson.dumps({"error": "bad handshake"}))
        try:
            return _json(await self.serving.connect_room(room, handshake))
        except RoomFailed as exc:
            return web.Response(
                status=409, body=orjson.dumps({"error": str(exc)}), content_type="application/json"
            )

    async def aclose(self, drain_s: float = 5.0) -> None:
        """Stop listening, let in-flight requests finish for up to ``drain_s`` seconds, cancel the
        rest, then stop the engine."""
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()
            await self.driver.wait_idle(drain_s)
            await self._runner.cleanup()
            self._runner = None
        if self._bootstrap is not None:
            await self._bootstrap.cleanup()
            self._bootstrap = None
        await self.serving.aclose()
        await self.driver.aclose()
        if self.kv_events is not None:
            await self.kv_events.aclose()

    @web.middleware
    async def _api_key(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """As vLLM with ``--api-key``: a ``/v1`` request without ``Authorization: Bearer <key>`` gets 401."""
        if request.path.startswith("/v1"):
            given = request.headers.get("Authorization")
            self.last_authorization = None if given is None else hashlib.sha256(given.encode()).hexdigest()
            key = self.config.api_key
            if given is None or not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                self.auth_seen["rejected"] += 1
                return web.json_response({"error": "Unauthorized"}, status=401)
            self.auth_seen["accepted"] += 1
        response: web.StreamResponse = await handler(request)
        return response

    async def _auth_seen(self, request: web.Request) -> web.Response:
        return _json({**self.auth_seen, "last_authorization_sha256": self.last_authorization})

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except SimError as exc:
            return web.Response(status=exc.status, body=exc.body(), content_type="application/json")
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            err = SimError(exc.status, exc.reason)
            return web.Response(status=exc.status, body=err.body(), content_type="application/json")

    async def _tag(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[REPLICA_HEADER] = self.id

    async def read_body(self, request: web.Request) -> dict[str, Any]:
        """The request's JSON body, parsed and its ``model`` checked against the served name."""
        body = api.parse_body(await request.read())
        api.check_model(body, self.config.model, self.config.lora_modules)
        return body

    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        """The prompt token ids of a chat body, rendered with the chat template as vLLM does."""
        return self.serving.chat_prompt(body)[2]

    def prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """The prompt token ids of a completion body (its first prompt)."""
        return self.serving.prompt_ids(api.parse_text_prompts(body)[0])

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        await self._injected_fault()
        body = await self.read_body(request)
        if self._reset_now(request, body):
            return web.StreamResponse()
        return await self.serving.chat(request, body)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        await self._injected_fault()
        body = await self.read_body(request)
        if self._reset_now(request, body):
            return web.StreamResponse()
        return await self.serving.completion(request, body)

    def _reset_now(self, request: web.Request, body: dict[str, Any]) -> bool:
        """A request chosen by ``/_sim/reset_next``: reset its connection now (``True``: the handler
        returns without answering), or mark it to be reset after its ``after``-th SSE event."""
        n, after = self.reset_next
        if n <= 0:
            return False
        self.reset_next = (n - 1, after)
        if after > 0 and body.get("stream") is True:
            request[RESET_AFTER] = after
            return False
        reset_connection(request)
        return True

    def _pooled(
        self, handler: Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """A pooling route's handler with the body read and checked as chat's (faults injected too)."""

        async def route(request: web.Request) -> web.StreamResponse:
            await self._injected_fault()
            return await handler(request, await self.read_body(request))

        return route

    async def _injected_fault(self) -> None:
        if self.fail_next > 0:
            self.fail_next -= 1
            raise SimError(500, "injected failure (/_sim/fail_next)")
        n, seconds = self.delay_next
        if n > 0:
            self.delay_next = (n - 1, seconds)
            await asyncio.sleep(seconds)

    async def _delay_next(self, request: web.Request) -> web.Response:
        """Test hook: the next ``n`` chat or completion requests wait ``s`` seconds first."""
        try:
            n, seconds = int(request.query.get("n", "1")), float(request.query.get("s", "0"))
        except ValueError:
            n, seconds = -1, 0.0
        if n < 0 or not 0 <= seconds <= 3600:
            raise SimError(400, "'n' must be a non-negative integer and 's' seconds in [0, 3600]", param="n")
        self.delay_next = (n, seconds)
        return _json({"delaying": n, "seconds": seconds})

    async def _reset_next(self, request: web.Request) -> web.Response:
        """Test hook: the next ``n`` chat or completion requests get a TCP reset, before any response byte
        (``after=0``) or, for a stream, after its ``after``-th SSE event (:mod:`load.sim.reset`)."""
        try:
            n, after = int(request.query.get("n", "1")), int(request.query.get("after", "0"))
        except ValueError:
            n, after = -1, 0
        if n < 0 or after < 0:
            raise SimError(400, "'n' and 'after' must be non-negative integers", param="n")
        self.reset_next = (n, after)
        return _json({"resetting": n, "after": after})

    async def _fail_next(self, request: web.Request) -> web.Response:
        """Test hook: the next ``n`` chat or completion requests fail with a 500."""
        try:
            n = int(request.query.get("n", "1"))
        except ValueError:
            n = -1
        if n < 0:
            raise SimError(400, "'n' must be a non-negative integer", param="n")
        self.fail_next = n
        return _json({"failing": n})

    async def _models(self, request: web.Request) -> web.Response:
        root = str(self.config.model_dir)
        max_model_len = self.config.engine.max_model_len
        cards = responses.models_response(
            self.config.model, root, max_model_len, self._created, self.config.lora_modules
        )
        return _json(cards)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self.read_body(request)
        if "messages" in body:  # TokenizeChatRequest: tools are rendered, tool_choice is not read
            tools = api.parse_tools({k: v for k, v in body.items() if k != "tool_choice"})
            ids = self.serving.render(api.parse_chat(body, tools.tools))
        else:  # TokenizeCompletionRequest: ``prompt`` is a string
            prompt = strict_str(body.get("prompt"), "prompt")
            ids = self.tokenizer.encode(
                prompt, add_special_tokens=opt(body, "add_special_tokens", lax_bool, True)
            )
        strs = self.tokenizer.token_strs(ids) if opt(body, "return_token_strs", lax_bool, False) else None
        return _json(
            {
                "count": len(ids),
                "max_model_len": self.config.engine.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await self.read_body(request)
        return _json({"prompt": self.tokenizer.decode(api.parse_detokenize(body))})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.engine.cache.reset():
            raise SimError(409, "the prefix cache is in use by running requests")
        return web.Response(status=200)

    async def _drop_next_kv_batches(self, request: web.Request) -> web.Response:
        """Test hook: the next ``n`` KV event batches skip the PUB socket (replay still has them)."""
        assert self.kv_events is not None
        try:
            n = int(request.query.get("n", "1"))
        except ValueError:
            n = -1
        if n < 0:
            raise SimError(400, "'n' must be a non-negative integer", param="n")
        self.kv_events.drop_next(n)
        return _json({"dropping": n})

    async def _metrics(self, request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(self.registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def _dcgm_metrics(self, request: web.Request) -> web.Response:
        assert self.dcgm is not None
        response = web.Response(body=generate_latest(self.dcgm))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response


@web.middleware
async def _engine_callers(request: web.Request, handler: Any) -> web.StreamResponse:
    """403 unless the client certificate of the request's connection names a role that may call an
    engine (the handshake already verified it against the client CA)."""
    transport = request.transport
    peercert = None if transport is None else transport.get_extra_info("peercert")
    if not permits(ENGINE, peercert_uris(peercert)):
        err = SimError(403, "this client certificate's identity may not call the engine")
        return web.Response(status=403, body=err.body(), content_type="application/json")
    response: web.StreamResponse = await handler(request)
    return response


def _json(payload: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (0: an ephemeral port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class SimFleet:
    """N independent replicas in this event loop, on ``host`` at ``port``, ``port + 1``, ... (0: each
    an ephemeral port), with ids ``<prefix>-0``, ``<prefix>-1``, ...

    ``async with SimFleet(config, 4) as fleet: fleet.addresses`` -> ``["127.0.0.1:PORT", ...]``.
    """

    def __init__(
        self,
        config: SimConfig,
        replicas: int = 1,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        prefix: str = "sim",
        first: int = 0,
        listener_factory: Callable[[str], CacheListener | None] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        self.config = config
        self.replicas: list[SimReplica] = []
        self._n, self._host, self._port, self._prefix = replicas, host, port, prefix
        self._first = first
        self._listener_factory = listener_factory
        self._ssl_context = ssl_context

    @property
    def addresses(self) -> list[str]:
        """``host:port`` of each replica, in id order."""
        return [r.address for r in self.replicas]

    def describe(self) -> list[dict[str, Any]]:
        """``[{"id", "address", "model"}]``, plus ``kv_events`` and ``kv_events_replay`` (the bound
        ``tcp://host:port`` or ``ipc://PATH``; replay ``""`` without a replay endpoint) when KV events are
        enabled, and
        ``bootstrap_port`` (an integer) on an SGLang-mode prefill replica: what ``--ready-file`` holds."""
        records: list[dict[str, Any]] = []
        for r in self.replicas:
            record: dict[str, Any] = {"id": r.id, "address": r.address, "model": self.config.model}
            if r.kv_events is not None:
                record["kv_events"] = r.kv_events.address
                record["kv_events_replay"] = r.kv_events.replay_address
            if r.bootstrap_port is not None:
                record["bootstrap_port"] = r.bootstrap_port
            records.append(record)
        return records

    async def start(self) -> None:
        """Load the tokenizer (once per process) and start every replica."""
        tokenizer = await asyncio.to_thread(load_tokenizer, self.config.model_dir, self.config.chat_template)
        try:
            for i in range(self._n):
                replica_id = f"{self._prefix}-{self._first + i}"
                listener = self._listener_factory(replica_id) if self._listener_factory else None
                replica = SimReplica(replica_id, self.config, tokenizer, listener, rank=i)
                self.replicas.append(replica)
                sock = bind(self._host, self._port + i if self._port else 0)
                await replica.start(sock, self._ssl_context)
        except BaseException:
            await self.aclose()
            raise
        log.info("simulating %d replicas of %s: %s", self._n, self.config.model, " ".join(self.addresses))

    async def aclose(self, drain_s: float = 5.0) -> None:
        """Stop every replica, letting in-flight requests finish for up to ``drain_s`` seconds."""
        await asyncio.gather(*(r.aclose(drain_s) for r in self.replicas))

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def write_ready_file(path: Path, records: list[dict[str, object]]) -> None:
    """Write ``records`` as JSON to ``path`` atomically (temp file in the same directory, then rename)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(orjson.dumps(records))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def server_tls(cert: Path | None, key: Path | None, client_ca: Path | None) -> ssl.SSLContext | None:
    """The replicas' TLS context: ``None`` (plain HTTP) without ``cert``; with ``client_ca``, clients
    must present a certificate chaining to it (``CERT_REQUIRED``), and its identity must be an engine
    caller's (checked on each request, :meth:`SimReplica.start`). ``ssl.SSLError`` (an ``OSError``)
    when the files do not load."""
    if cert is None or key is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    if client_ca is not None:
        ctx.load_verify_locations(cafile=client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def build_parser() -> argparse.ArgumentParser:
    """The ``kvgate sim`` command line."""
    p = argparse.ArgumentParser(prog="kvgate sim", description="Simulated vLLM replicas (no GPU).")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--model-dir", required=True, type=Path, help="Hugging Face style tokenizer directory")
    p.add_argument("--chat-template", help="chat template file (or template text) overriding the tokenizer's")
    p.add_argument("--replicas", type=int, default=1, help="replicas hosted by this process (default 1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="first port; replica i uses port+i (0: ephemeral)")
    p.add_argument("--replica-prefix", default="sim", help="replica ids are PREFIX-0, PREFIX-1, ...")
    p.add_argument(
        "--first-replica", type=int, default=0, metavar="N", help="replica ids start at PREFIX-N (default 0)"
    )
    p.add_argument("--ready-file", type=Path, help="write [{id, address, model}] here once all listen")
    e, t = EngineConfig(), TimingModel()
    p.add_argument("--block-size", type=int, default=e.block_size, help="tokens per KV block")
    p.add_argument("--kv-blocks", type=int, default=e.num_blocks, help="KV cache capacity in blocks")
    p.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs, help="max running requests")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens, help="tokens per step"
    )
    p.add_argument(
        "--max-model-len", type=int, default=e.max_model_len, help="prompt + output limit (tokens)"
    )
    p.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false")
    p.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=e.scheduling_policy,
        help="as vLLM: fcfs, or priority (the request's 'priority' field, lower first)",
    )
    p.add_argument(
        "--priority-preemption",
        action="store_true",
        help="(with --scheduling-policy priority) a waiting request preempts a running one of lower priority "
        "when the batch is full, as SGLang's --enable-priority-scheduling does",
    )
    p.add_argument(
        "--priority-preemption-threshold",
        type=int,
        default=e.priority_preemption_threshold,
        help="preempt only when the priorities differ by more than this (SGLang's default: 10)",
    )
    p.add_argument("--time-scale", type=float, default=t.time_scale, help="multiplies every step duration")
    p.add_argument("--step-base-ms", type=float, default=t.base_s * 1e3, help="fixed cost of a step (ms)")
    p.add_argument(
        "--decode-ms-per-seq", type=float, default=t.decode_s_per_seq * 1e3, help="ms per decoding seq"
    )
    p.add_argument(
        "--prefill-tokens-per-s", type=float, default=1 / t.prefill_s_per_token, help="prefill speed"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="as vLLM: /v1 requests must carry 'Authorization: Bearer KEY' (401 otherwise; "
        "default $VLLM_API_KEY)",
    )
    p.add_argument("--tls-cert", type=Path, help="serve HTTPS with this PEM certificate (needs --tls-key)")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca",
        type=Path,
        help="require client certificates that chain to this PEM CA bundle; only the identities "
        "spiffe://kvgate.local/{envoy-edge,extproc,agent}[-SUFFIX] are served (others: 403)",
    )
    p.add_argument(
        "--kv-events-config",
        metavar="JSON",
        help="as vLLM: publish KV cache events, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' '
        "(replica i uses port+i; ipc:///PATH endpoints bind Unix sockets, replica i's at PATH_dp<i>)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='as vLLM: answer tool_choice "auto" (and, with a parser, "required" and named) with tool calls',
    )
    p.add_argument("--tool-call-parser", metavar="NAME", help="as vLLM; needed by --enable-auto-tool-choice")
    p.add_argument(
        "--role",
        choices=ROLES,
        default="both",
        help="part in prefill/decode disaggregation: prefill and decode speak vLLM's kv_transfer_params",
    )
    p.add_argument(
        "--disaggregation-mode",
        choices=MODES,
        default="null",
        help="as SGLang: a prefill or decode server of SGLang's PD protocol (bootstrap_host/port/room; "
        f"waits bounded by ${BOOTSTRAP_TIMEOUT_ENV} and ${WAITING_TIMEOUT_ENV}, seconds, default 300)",
    )
    p.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        default=DEFAULT_BOOTSTRAP_PORT,
        help="as SGLang: a prefill server's bootstrap server port (replica i: port+i; 0: ephemeral)",
    )
    p.add_argument(
        "--kv-bytes-per-token", type=float, default=t.kv_bytes_per_token, help="KV bytes per token moved"
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=t.link_bytes_per_s * 8 / 1e9,
        help="prefill-to-decode link speed (Gbit/s) for KV transfers",
    )
    p.add_argument(
        "--gpu",
        help="simulate each replica's GPU power (load/sim/power.py): comma-separated classes, cycled over "
        f"replicas ({', '.join(GPU_CLASSES)}); serves dcgm-exporter's format at {DCGM_PATH}",
    )
    p.add_argument(
        "--power-cap-w",
        help="power caps in W, comma-separated, cycled over replicas (0: none); implies --gpu h100",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME",
        help="as vLLM: LoRA adapters served by name (a NAME=PATH form is accepted, the path ignored)",
    )
    p.add_argument("--max-loras", type=int, default=e.max_loras, help="as vLLM: adapters in GPU slots")
    p.add_argument(
        "--lora-load-ms", type=float, default=t.lora_load_s * 1e3, help="cost of loading an adapter (ms)"
    )
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Build and validate the config; raises ``ValueError``."""
    if args.prefill_tokens_per_s <= 0:
        raise ValueError("--prefill-tokens-per-s must be positive")
    if args.link_gbps <= 0:
        raise ValueError("--link-gbps must be positive")
    if args.disaggregation_mode != "null" and args.role != "both":
        raise ValueError(
            "--role (vLLM's kv_transfer_params) and --disaggregation-mode (SGLang's) exclude each other"
        )
    if not 0 <= args.disaggregation_bootstrap_port < 65536:
        raise ValueError("--disaggregation-bootstrap-port must be a port number")
    sglang_pd = SglangPd(
        args.disaggregation_mode, env_timeout(BOOTSTRAP_TIMEOUT_ENV), env_timeout(WAITING_TIMEOUT_ENV)
    )
    engine = EngineConfig(
        block_size=args.block_size,
        num_blocks=args.kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.prefix_caching,
        scheduling_policy=args.scheduling_policy,
        priority_preemption=args.priority_preemption,
        priority_preemption_threshold=args.priority_preemption_threshold,
        max_loras=args.max_loras,
    )
    timing = TimingModel(
        base_s=args.step_base_ms / 1e3,
        decode_s_per_seq=args.decode_ms_per_seq / 1e3,
        prefill_s_per_token=1 / args.prefill_tokens_per_s,
        time_scale=args.time_scale,
        kv_bytes_per_token=args.kv_bytes_per_token,
        link_bytes_per_s=args.link_gbps * 1e9 / 8,
        lora_load_s=args.lora_load_ms / 1e3,
    )
    kv_events = None if args.kv_events_config is None else KvEventsConfig.from_json(args.kv_events_config)
    tools = ToolParsing(args.enable_auto_tool_choice, args.tool_call_parser)
    power = power_models(args.gpu, args.power_cap_w)
    return SimConfig(
        args.model,
        args.model_dir,
        args.chat_template,
        engine,
        timing,
        kv_events,
        tools,
        role=args.role,
        power=power,
        sglang_pd=sglang_pd,
        bootstrap_port=args.disaggregation_bootstrap_port,
        lora_modules=tuple(m.split("=", 1)[0] for m in args.lora_modules),
        api_key=args.api_key,
    )


def power_models(gpus: str | None, caps: str | None) -> tuple[PowerModel, ...]:
    """``--gpu h100,a100`` and ``--power-cap-w 450,0`` (0: no cap) as power models, the shorter list
    cycled; neither: none. Raises ``ValueError``."""
    if gpus is None and caps is None:
        return ()
    names = (gpus or "h100").split(",")
    watts = [float(w) for w in (caps or "0").split(",")]
    unknown = [n for n in names if n not in GPU_CLASSES]
    if unknown:
        raise ValueError(f"--gpu: unknown {', '.join(unknown)}; known: {', '.join(GPU_CLASSES)}")
    n = max(len(names), len(watts))
    return tuple(
        PowerModel(GPU_CLASSES[names[i % len(names)]], watts[i % len(watts)] or None) for i in range(n)
    )


async def serve(config: SimConfig, args: argparse.Namespace) -> None:
    """Run a fleet until SIGINT/SIGTERM: the first drains, a second stops at once."""
    loop = asyncio.get_running_loop()
    signals = asyncio.Queue[int]()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    fleet = SimFleet(
        config,
        args.replicas,
        host=args.host,
        port=args.port,
        prefix=args.replica_prefix,
        first=args.first_replica,
        ssl_context=server_tls(args.tls_cert, args.tls_key, args.tls_client_ca),
    )
    await fleet.start()
    try:
        records = [{**r, "pid": os.getpid()} for r in fleet.describe()]
        if args.ready_file is not None:
            write_ready_file(args.ready_file, records)
        sys.stdout.write(orjson.dumps(records).decode() + "\n")
        sys.stdout.flush()
        log.info("stopping on signal %d", await signals.get())
    finally:
        closing = asyncio.create_task(fleet.aclose())
        forced = asyncio.create_task(signals.get())
        await asyncio.wait({closing, forced}, return_when=asyncio.FIRST_COMPLETED)
        for task in (closing, forced):
            task.cancel()
        await asyncio.gather(closing, forced, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    """``kvgate sim``: serve simulated replicas until a signal. 0 on a clean stop, 1 when the replicas
    cannot start (port in use, unreadable model directory or template), 2 on bad arguments."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
        if args.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        if (args.tls_cert is None) != (args.tls_key is None) or (args.tls_client_ca and not args.tls_cert):
            raise ValueError("--tls-cert and --tls-key go together; --tls-client-ca needs them")
    except ValueError as exc:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    disable_created_metrics()  # type: ignore[no-untyped-call]  # as vLLM: no *_created samples
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "PyTorch was not found": expected
    try:
        asyncio.run(serve(config, args))
    except (OSError, ValueError) as exc:
        log.error("cannot serve: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
