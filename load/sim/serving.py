"""Chat and completion requests of one replica, end to end: validate, render, plan, run, answer.

:class:`Serving` is the part of a replica that speaks vLLM's generate API over aiohttp: it validates a
body (:mod:`load.sim.protocol`), renders and tokenizes the prompt, plans every choice up front
(:mod:`load.sim.output`), hands the token ids to the engine driver (``n`` choices of a prompt as one
request and its siblings, sharing the prefill) and writes the answer as vLLM does, whole or as SSE
chunks (:mod:`load.sim.responses`), one chunk per choice index as its tokens appear. A replica of a
prefill/decode pair also speaks vLLM's ``kv_transfer_params`` (:mod:`load.sim.handoff`), or, started with
SGLang's ``--disaggregation-mode``, SGLang's bootstrap fields (:mod:`load.sim.bootstrap`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from contracts.digest import Digest, chain_seed
from load.sim import protocol as api
from load.sim import responses as out
from load.sim.bootstrap import Bootstrap, Handshake, Prefilled, Rooms, read_bootstrap
from load.sim.driver import EngineDriver
from load.sim.engine import TokenEvent
from load.sim.errors import SimError, invalid, refused
from load.sim.fields import lax_int, opt, strict_str
from load.sim.handoff import NONE, Transfer, prefill_params, read_transfer
from load.sim.output import Plan, plan_choice
from load.sim.reset import RESET_AFTER, reset_connection
from load.sim.tokenizer import SimTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SglangPd:
    """SGLang's prefill/decode disaggregation (:mod:`load.sim.bootstrap`): ``mode`` (``null``, ``prefill``
    or ``decode``), and the two waits' bounds in seconds: a prefill request for its decode side to connect
    (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``), a decode request for its KV
    (``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``)."""

    mode: str = "null"
    bootstrap_timeout_s: float = 300.0
    waiting_timeout_s: float = 300.0


class _Tap(asyncio.Queue[TokenEvent]):
    """A request's token queue that calls ``on_first`` with the first event the engine delivers (the
    prompt is computed then)."""

    def __init__(self, on_first: Any) -> None:
        super().__init__()
        self._on_first = on_first

    def put_nowait(self, item: TokenEvent) -> None:
        if self._on_first is not None:
            on_first, self._on_first = self._on_first, None
            on_first(item)
        super().put_nowait(item)


@dataclass(frozen=True, slots=True)
class ToolParsing:
    """vLLM's ``--enable-auto-tool-choice`` and ``--tool-call-parser NAME``: tool calls are answered
    only with both (vLLM loads the parser only when auto tool choice is on)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")


@dataclass(slots=True)
class _Choice:
    """A choice being answered: its plan, index and what has been sent of it."""

    index: int
    plan: Plan
    prompt_index: int
    sent: int = 0  # tokens
    text_sent: int = 0  # characters (completions' logprob offsets)
    finished: bool = False
    echo: str = ""


@dataclass(frozen=True, slots=True)
class Identity:
    """What separates a request's KV blocks from others': its chain seed, adapter and cache salt."""

    seed: Digest | None
    lora: str | None
    salt: str | None


@dataclass(slots=True)
class _Request:
    """One generate request after validation: its choices keyed by engine request id."""

    rid: str
    chat: bool
    sampling: api.Sampling
    prompt_lens: list[int]
    choices: dict[str, _Choice] = field(default_factory=dict)
    role: str = "assistant"
    forced_tool: bool = False
    #: How sure the model is of its answer (``responses.confidence`` of the prompt): its logprobs.
    sure: str = "default"


class Serving:
    """The generate routes of one replica. ``model`` is the served name, ``max_model_len`` the context."""

    def __init__(
        self,
        model: str,
        max_model_len: int,
        tokenizer: SimTokenizer,
        driver: EngineDriver,
        tool_parsing: ToolParsing,
        role: str = "both",
        engine_id: str = "sim",
        pd: SglangPd | None = None,
        adapters: Sequence[str] = (),
    ) -> None:
        self.model = model
        #: LoRA adapters served by name (``--lora-modules``).
        self.adapters = tuple(adapters)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.driver = driver
        self.tool_parsing = tool_parsing
        #: ``both`` (no KV connector), ``prefill`` or ``decode`` (:mod:`load.sim.handoff`).
        self.role = role
        self.engine_id = engine_id
        #: ``(host, port)`` a decode replica fetches this replica's KV from (set once it listens).
        self.side_channel: tuple[str, int] = ("", 0)
        #: SGLang's disaggregation mode; a prefill replica's rooms, met by decode replicas through its
        #: bootstrap server; the client a decode replica reaches bootstrap servers with (made on first use).
        self.pd = pd or SglangPd()
        self.rooms = Rooms()
        self._bootstrap_client: aiohttp.ClientSession | None = None

    # -- prompts (also what /tokenize and the render routes use) ---------------------------------

    def chat_prompt(self, body: dict[str, Any]) -> tuple[api.ChatPrompt, api.Tools, list[int]]:
        """A chat body's messages, tools and prompt token ids, checked as vLLM's ``render_chat``."""
        tools = api.parse_tools(body)
        api.check_tool_support(
            tools,
            auto_tools=self.tool_parsing.enable_auto_tool_choice,
            parser=self.tool_parsing.tool_call_parser,
        )
        chat = api.parse_chat(body, tools.tools)
        return chat, tools, self.render(chat)

    def render(self, chat: api.ChatPrompt) -> list[int]:
        """Token ids of a chat, rendered with the chat template as vLLM does."""
        try:
            return self.tokenizer.chat_ids(
                chat.messages,
                add_special_tokens=chat.add_special_tokens,
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                tools=chat.tools,
                template_kwargs=chat.template_kwargs,
            )
        except ValueError as exc:  # a template error: vLLM answers jinja2 errors with a plain 400
            raise refused(str(exc)) from exc

    def prompt_ids(self, prompt: api.TextPrompt) -> list[int]:
        """A completion prompt's token ids: its text tokenized, or its ids as given; then the context
        length check (the renderer's) and the vocabulary check (the engine's input processor's)."""
        text = isinstance(prompt.prompt, str)
        if isinstance(prompt.prompt, str):
            ids = self.tokenizer.encode(prompt.prompt, add_special_tokens=prompt.add_special_tokens)
        else:
            ids = prompt.prompt
        api.check_prompt_len(len(ids), self.max_model_len, text=text)
        if ids and max(ids) >= self.tokenizer.vocab_size:
            raise invalid(f"Token id {max(ids)} is out of vocabulary")
        return ids

    # -- routes ------------------------------------------------------------------------------------

    async def chat(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        """``POST /v1/chat/completions``."""
        sampling = api.parse_sampling(body, chat=True)
        fmt = api.parse_response_format(body)
        chat, tools, prompt = self.chat_prompt(body)
        transfer = read_transfer(body, self.role)
        bootstrap = read_bootstrap(body, self.pd.mode)
        priority = self.priority_of(body)
        api.check_max_tokens(sampling, self.max_model_len)
        api.check_prompt_len(len(prompt), self.max_model_len, text=True)
        max_tokens = api.resolve_max_tokens(sampling.max_tokens, len(prompt), self.max_model_len)
        if self.pd.mode == "prefill":  # SGLang's prefill server stops after the first token
            max_tokens = 1
        # No max_tokens: a tool call or JSON answer runs to its end (vLLM's limit is the context's rest).
        structured = None if sampling.max_tokens is not None else self.max_model_len - len(prompt)
        role = "assistant" if chat.add_generation_prompt else chat.messages[-1]["role"]
        last = chat.messages[-1]
        echo = last["content"] if sampling.echo and last["role"] == role else ""
        req = _Request(
            f"chatcmpl-{uuid.uuid4().hex}",
            True,
            sampling,
            [len(prompt)],
            role=role,
            forced_tool=tools.mode in ("required", "named"),
            sure=out.confidence(_last_user_text(chat.messages)),
        )
        plans = [
            plan_choice(
                self.tokenizer,
                prompt,
                max_tokens,
                sampling,
                i,
                response_format=fmt,
                tools=tools,
                after_tool_result=last["role"] == "tool",
                structured_max_tokens=structured,
            )
            for i in range(sampling.n)
        ]
        self._add(req, 0, plans, echo)
        return await self._run(request, req, [prompt], transfer, bootstrap, priority, self.identity(body))

    async def completion(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        """``POST /v1/completions``: every prompt of a batch gets ``n`` choices, indexed
        ``prompt * n + i``."""
        sampling = api.parse_sampling(body, chat=False)
        prompts = api.parse_text_prompts(body)
        fmt = api.parse_response_format(body)
        if opt(body, "suffix", strict_str, None) is not None:
            raise refused("suffix is not currently supported")
        transfer = read_transfer(body, self.role)
        bootstrap = read_bootstrap(body, self.pd.mode)
        if bootstrap is not None and len(prompts) > 1:
            raise invalid("the simulator pairs one prompt per request in disaggregation mode", "prompt")
        priority = self.priority_of(body)
        api.check_max_tokens(sampling, self.max_model_len)
        ids = []
        for prompt in prompts:
            ids.append(self.prompt_ids(prompt))
            if not ids[-1]:  # vLLM's input processor; the engine holds no empty sequence
                raise invalid("The decoder prompt cannot be empty")
        req = _Request(f"cmpl-{uuid.uuid4().hex}", False, sampling, [len(p) for p in ids])
        texts = [
            p.prompt if isinstance(p.prompt, str) else self.tokenizer.decode(t)
            for p, t in zip(prompts, ids, strict=True)
        ]
        req.sure = out.confidence(" ".join(texts))
        for p, (prompt, tokens) in enumerate(zip(prompts, ids, strict=True)):
            max_tokens = api.resolve_max_tokens(sampling.max_tokens, len(tokens), self.max_model_len)
            if self.pd.mode == "prefill":
                max_tokens = 1
            text = prompt.prompt if isinstance(prompt.prompt, str) else self.tokenizer.decode(tokens)
            plans = [
                plan_choice(self.tokenizer, tokens, max_tokens, sampling, i, response_format=fmt)
                for i in range(sampling.n)
            ]
            self._add(req, p, plans, text if sampling.echo else "")
        return await self._run(request, req, ids, transfer, bootstrap, priority, self.identity(body))

    def identity(self, body: dict[str, Any]) -> Identity:
        """The request's LoRA adapter (``model`` naming one) and ``cache_salt``, and the chain seed of
        both (the base model's name with them, as vLLM's block hash and kvgate's router take them)."""
        model = body.get("model")
        lora = model if isinstance(model, str) and model in self.adapters else None
        raw = body.get("cache_salt")
        salt = raw if isinstance(raw, str) and raw else None
        return Identity(chain_seed(self.model, lora=lora, salt=salt), lora, salt)

    def _add(self, req: _Request, p: int, plans: Sequence[Plan], echo: str) -> None:
        n = len(plans)
        for i, plan in enumerate(plans):
            rid = f"{req.rid}-{p}" if i == 0 else f"{req.rid}-{p}-{i}"
            req.choices[rid] = _Choice(p * n + i, plan, p, echo=echo)

    def priority_of(self, body: dict[str, Any]) -> int:
        """The body's ``priority`` (vLLM's field, default 0, lower first); a non-zero one without the
        "priority" scheduling policy is refused, as vLLM refuses it."""
        value = body.get("priority")
        priority = 0 if value is None else lax_int(value, "priority")
        if priority and self.driver.engine.config.scheduling_policy != "priority":
            raise refused(f"Got priority {priority} but Priority scheduling is not enabled.")
        return priority

    async def _run(
        self,
        request: web.Request,
        req: _Request,
        prompts: list[list[int]],
        transfer: Transfer = NONE,
        bootstrap: Bootstrap | None = None,
        priority: int = 0,
        identity: Identity | None = None,
    ) -> web.StreamResponse:
        ident = identity or Identity(None, None, None)
        if bootstrap is not None and self.pd.mode == "prefill":
            return await self._prefill_room(request, req, prompts[0], bootstrap, priority, ident)
        remote = transfer.remote_prefill is not None or bootstrap is not None
        if transfer.remote_prefill is not None:
            await self._receive_kv(req.rid, prompts[0], transfer.remote_prefill)
        if bootstrap is not None:
            await self._receive_room(req.rid, prompts[0], bootstrap)
        return await self._generate(request, req, prompts, transfer, remote, priority=priority, ident=ident)

    async def _generate(
        self,
        request: web.Request,
        req: _Request,
        prompts: list[list[int]],
        transfer: Transfer = NONE,
        remote: bool = False,
        first: _Tap | None = None,
        priority: int = 0,
        ident: Identity | None = None,
    ) -> web.StreamResponse:
        """Run the request's prompts on the engine and answer (``remote``: the first prompt's KV came
        from a prefill replica; ``first``: the queue of the first prompt's tokens; ``priority``: the
        engine's scheduling priority; ``ident``: its adapter, cache salt and chain seed)."""
        if ident is None:
            ident = Identity(None, None, None)
        queue: asyncio.Queue[TokenEvent] | None = first
        ids = list(req.choices)
        for p, prompt in enumerate(prompts):
            group = [rid for rid in ids if req.choices[rid].prompt_index == p]
            siblings = [(rid, req.choices[rid].plan.token_ids) for rid in group[1:]]
            queue = self.driver.submit(
                group[0],
                prompt,
                req.choices[group[0]].plan.token_ids,
                siblings,
                queue,
                remote_prefill=remote and p == 0,
                priority=priority,
                seed=ident.seed,
                lora=ident.lora,
                salt=ident.salt,
            )
        assert queue is not None
        log.debug("%s: %d prompts, %d choices", req.rid, len(prompts), len(ids))
        try:
            if req.sampling.stream:
                return await self._stream(request, req, queue)
            handoff = prompts[0] if transfer.remote_decode else None
            return await self._whole(req, queue, handoff)
        finally:
            for rid in ids:
                self.driver.abort(rid)

    async def _prefill_room(
        self,
        request: web.Request,
        req: _Request,
        prompt: list[int],
        bootstrap: Bootstrap,
        priority: int = 0,
        ident: Identity | None = None,
    ) -> web.StreamResponse:
        """SGLang's prefill server: wait for the room's decode side, prefill, hand the KV over, answer
        with the one sampled token once the transfer is done (:mod:`load.sim.bootstrap`)."""
        room, engine = bootstrap.room, self.driver.engine
        try:
            try:
                handshake = await self.rooms.wait_decode(room, self.pd.bootstrap_timeout_s)
            except TimeoutError:
                raise SimError(
                    500,
                    f"Request {room} timed out after {self.pd.bootstrap_timeout_s:.1f}s in "
                    "KVPoll.Bootstrapping: no decode server connected",
                ) from None
            sent: list[Prefilled] = []

            def computed(event: TokenEvent) -> None:
                tokens = max(0, len(prompt) - 1 - handshake.cached_tokens)
                sent.append(Prefilled(self.engine_id, len(prompt), tokens))
                self.rooms.prefilled(room, sent[0])

            response = await self._generate(
                request, req, [prompt], first=_Tap(computed), priority=priority, ident=ident
            )
            if sent:  # the sender finishes when the KV has moved
                await asyncio.sleep(engine.timing.transfer_s(sent[0].tokens))
                engine.stats.remote_decodes += 1
                log.info(
                    "%s: prefilled %d prompt tokens for a remote decode (bootstrap room %d, decode %s)",
                    req.rid,
                    len(prompt),
                    room,
                    handshake.decode,
                )
            return response
        finally:
            self.rooms.release(room)

    async def _receive_room(self, rid: str, prompt: list[int], bootstrap: Bootstrap) -> None:
        """SGLang's decode server: connect to the room on the prefill replica's bootstrap server, wait for
        its KV, then for the transfer of the prompt tokens this replica lacks; 500 when the bootstrap
        server is unreachable, the prefill side failed, or no KV came within the waiting timeout."""
        engine = self.driver.engine
        handshake = {"decode": self.engine_id, "cached_tokens": engine.cached_prefix_tokens(prompt)}
        url = f"http://{bootstrap.address}/_sim/kv/{bootstrap.room}"
        if self._bootstrap_client is None:
            self._bootstrap_client = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(total=self.pd.waiting_timeout_s)
        try:
            async with self._bootstrap_client.post(url, json=handshake, timeout=timeout) as answer:
                doc = await answer.json(content_type=None)
                status = answer.status
        except aiohttp.ClientConnectionError:
            raise SimError(
                500, f"Could not fetch prefill parallel info from bootstrap_addr: {bootstrap.address}"
            ) from None
        except TimeoutError:
            raise SimError(
                500,
                f"Request {bootstrap.room} timed out after {self.pd.waiting_timeout_s:.1f}s in "
                "KVPoll.WaitingForInput",
            ) from None
        if status != 200 or not isinstance(doc, dict):
            reason = doc.get("error") if isinstance(doc, dict) else None
            raise SimError(500, f"KV transfer of bootstrap room {bootstrap.room} failed: {reason}")
        tokens = int(doc["tokens"])
        seconds = engine.timing.transfer_s(tokens)
        await asyncio.sleep(seconds)
        engine.stats.remote_prefill_seconds += seconds
        log.info(
            "%s: prefilled by engine %s (bootstrap room %d); KV of %d prompt tokens received in %.4f s",
            rid,
            doc["engine_id"],
            bootstrap.room,
            tokens,
            seconds,
        )

    async def connect_room(self, room: int, handshake: Handshake) -> dict[str, Any]:
        """The bootstrap server's side of :meth:`_receive_room` on a prefill replica: the room's KV, once
        computed (:class:`RoomFailed` otherwise)."""
        done = await self.rooms.connect(room, handshake)
        return {"engine_id": done.engine_id, "prompt_tokens": done.prompt_tokens, "tokens": done.tokens}

    async def aclose(self) -> None:
        if self._bootstrap_client is not None:
            await self._bootstrap_client.close()
            self._bootstrap_client = None

    async def _receive_kv(self, rid: str, prompt: list[int], params: dict[str, Any]) -> None:
        """Wait while the KV of the prompt tokens this replica lacks arrives from the prefill replica."""
        engine = self.driver.engine
        tokens = max(0, len(prompt) - 1 - engine.cached_prefix_tokens(prompt))
        seconds = engine.timing.transfer_s(tokens)
        await asyncio.sleep(seconds)
        engine.stats.remote_prefill_seconds += seconds
        log.info(
            "%s: prefilled by engine %s; KV of %d prompt tokens received in %.4f s",
            rid,
            params["remote_engine_id"],
            tokens,
            seconds,
        )

    async def _whole(
        self, req: _Request, queue: asyncio.Queue[Any], handoff: list[int] | None = None
    ) -> web.Response:
        """The whole answer; with ``handoff`` (the prompt of a prefill for a remote decode) it carries
        the ``kv_transfer_params`` the decode replica needs."""
        cached = [0] * len(req.prompt_lens)
        left = len(req.choices)
        while left:
            event = await queue.get()
            choice = req.choices[event.request_id]
            if choice.sent == 0 and choice.index % req.sampling.n == 0:
                cached[choice.prompt_index] = event.cached_tokens
            choice.sent += len(event.token_ids)
            left -= event.finished
        choices = sorted(req.choices.values(), key=lambda c: c.index)
        use = out.usage(sum(req.prompt_lens), sum(len(c.plan.token_ids) for c in choices), sum(cached))
        created = int(time.time())
        if req.chat:
            body = out.chat_response(
                req.rid, created, self.model, [self._chat_choice(req, c) for c in choices], use
            )
        else:
            body = out.completion_response(
                req.rid, created, self.model, [self._text_choice(req, c) for c in choices], use
            )
        if handoff is not None:
            engine = self.driver.engine
            engine.stats.remote_decodes += 1
            host, port = self.side_channel
            blocks = engine.prompt_blocks(handoff)
            body["kv_transfer_params"] = prefill_params(self.engine_id, req.rid, blocks, host, port)
            log.info("%s: prefilled %d prompt tokens for a remote decode", req.rid, len(handoff))
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    def _chat_choice(self, req: _Request, c: _Choice) -> dict[str, Any]:
        k = req.sampling.logprobs
        return {
            "index": c.index,
            "message": out.chat_message(c.plan, req.role, req.forced_tool, c.echo),
            "logprobs": (
                None if k is None else out.chat_logprobs(self.tokenizer, c.plan.token_ids, k, sure=req.sure)
            ),
            "finish_reason": c.plan.finish_reason,
            "stop_reason": c.plan.stop_reason,
            "token_ids": None,
        }

    def _text_choice(self, req: _Request, c: _Choice) -> dict[str, Any]:
        k = req.sampling.logprobs
        plan = c.plan
        logprobs = (
            None
            if k is None
            else out.completion_logprobs(
                self.tokenizer, plan.token_ids, plan.pieces, k, offset=len(c.echo), sure=req.sure
            )
        )
        return {
            "index": c.index,
            "text": c.echo + plan.text,
            "logprobs": logprobs,
            "finish_reason": plan.finish_reason,
            "stop_reason": plan.stop_reason,
            "token_ids": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
        }

    async def _stream(
        self, request: web.Request, req: _Request, queue: asyncio.Queue[Any]
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        response.headers["Cache-Control"] = "no-cache"
        await response.prepare(request)
        obj = "chat.completion.chunk" if req.chat else "text_completion"
        created, sampling = int(time.time()), req.sampling
        n_prompt = sum(req.prompt_lens)
        cached = 0
        left = len(req.choices)
        first = True
        reset_after = request.get(RESET_AFTER)  # /_sim/reset_next: a TCP reset after that many events
        events_sent = 0
        try:
            while left:
                events = [await queue.get()]
                while not queue.empty():
                    events.append(queue.get_nowait())
                if first:
                    cached = events[0].cached_tokens
                    if req.chat:
                        await self._chat_preamble(response, req, created, n_prompt)
                    first = False
                new: dict[str, list[int]] = {}
                for event in events:
                    new.setdefault(event.request_id, []).extend(event.token_ids)
                    left -= event.finished
                for rid, tokens in new.items():
                    choice = req.choices[rid]
                    body = self._delta(req, choice, len(tokens))
                    use = out.usage(n_prompt, choice.sent, cached) if sampling.continuous_usage else None
                    await _sse(response, out.chunk(req.rid, obj, created, self.model, body, use))
                    events_sent += 1
                    if reset_after is not None and events_sent >= reset_after:
                        reset_connection(request)
                        return response
            if sampling.include_usage:
                total = sum(c.sent for c in req.choices.values())
                await _sse(
                    response,
                    out.usage_chunk(req.rid, obj, created, self.model, out.usage(n_prompt, total, cached)),
                )
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            log.debug("%s: client went away", req.rid)
        return response

    async def _chat_preamble(
        self, response: web.StreamResponse, req: _Request, created: int, n_prompt: int
    ) -> None:
        """vLLM's first chunks: the role of every choice, then the echoed last message."""
        use = out.usage(n_prompt, 0, 0) if req.sampling.continuous_usage else None
        choices = sorted(req.choices.values(), key=lambda c: c.index)
        for c in choices:
            delta = {
                "index": c.index,
                "delta": {"role": req.role, "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            await _sse(response, out.chunk(req.rid, "chat.completion.chunk", created, self.model, delta, use))
        for c in choices:
            if c.echo:
                delta = {
                    "index": c.index,
                    "delta": {"content": c.echo},
                    "logprobs": None,
                    "finish_reason": None,
                }
                await _sse(
                    response, out.chunk(req.rid, "chat.completion.chunk", created, self.model, delta, use)
                )

    def _delta(self, req: _Request, c: _Choice, n: int) -> dict[str, Any]:
        """The streamed choice for ``c``'s next ``n`` tokens (its finish when they are its last)."""
        plan, start = c.plan, c.sent
        ids, pieces = plan.token_ids[start : start + n], plan.pieces[start : start + n]
        c.sent += n
        done = c.sent == len(plan.token_ids)
        k = req.sampling.logprobs
        body: dict[str, Any] = {"index": c.index}
        if req.chat:
            body["delta"] = self._chat_delta(plan, start, c.sent, "".join(pieces))
            body["logprobs"] = (
                None if k is None else out.chat_logprobs(self.tokenizer, ids, k, start, req.sure)
            )
        else:
            echo, joined = (c.echo if start == 0 else ""), "".join(pieces)
            body["text"] = echo + joined
            offset = c.text_sent + len(echo)
            body["logprobs"] = (
                None
                if k is None
                else out.completion_logprobs(self.tokenizer, ids, pieces, k, start, offset, req.sure)
            )
            c.text_sent = offset + len(joined)
        body["finish_reason"] = plan.finish_reason if done else None
        body["stop_reason"] = plan.stop_reason if done else None
        return body

    @staticmethod
    def _chat_delta(plan: Plan, start: int, end: int, text: str) -> dict[str, Any]:
        call = plan.tool_call
        if call is None:
            return {"content": text}
        # arguments stream in proportion to the call's tokens; the id, type and name come first
        total = len(plan.token_ids)
        args = call.arguments[len(call.arguments) * start // total : len(call.arguments) * end // total]
        delta: dict[str, Any] = {"index": 0, "function": {"arguments": args}}
        if start == 0:
            delta = {
                "id": call.id,
                "type": "function",
                "index": 0,
                "function": {"name": call.name, "arguments": args},
            }
        return {"tool_calls": [delta]}


async def _sse(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + orjson.dumps(payload) + b"\n\n")


def _last_user_text(messages: Sequence[dict[str, Any]]) -> str:
    """The text of the chat's last user message (its text parts joined), ``""`` without one."""
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            return ""
    return ""
