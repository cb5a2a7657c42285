"""The ext_proc stream state machine (Endpoint Picker Protocol v1), sans IO.

One :class:`StreamProcessor` per Envoy HTTP stream. :meth:`StreamProcessor.handle` takes each
``ProcessingRequest`` and returns the ``ProcessingResponse`` messages to send, in order; the gRPC shell
(:mod:`extproc.server`) only pumps messages. Protocol (REFERENCE.md section 3):

* request headers: held until the body's end (FULL_DUPLEX_STREAMED); a body-less request is answered
  at once (``GET /v1/models`` from the fleet, the probes below; anything else is an error);
* request body chunks: buffered up to ``max_body_bytes`` (then 413); at end of stream the request is
  parsed once and scheduled, then the headers reply (destination header, ``envoy.lb`` metadata, corrected
  content-length, route cache cleared) and the body streamed back in chunks of at most 62,000 bytes;
* BUFFERED body mode instead (Envoy's ``ProtocolConfiguration`` on the first message says so; the bundled
  config uses it with ``--fail-open``, the only mode in which Envoy can go on without its processor): the
  headers are answered at once with no change, the body comes whole, and its answer carries the same
  header mutation, metadata and body (a body reply's header mutation applies in this mode only);
* a request its model's route disaggregates (:mod:`extproc.disagg`): after the decision the replies wait
  while the shell sends the prefill half itself (:attr:`StreamProcessor.handoff`; Envoy's message timeout
  extended past its bound); :meth:`StreamProcessor.handed_off` then sends the request to its decode
  endpoint with the prefill engine's ``kv_transfer_params``, or whole (aggregated) when the prefill failed;
* a request for a cascade's virtual model (:mod:`extproc.cascade`): each gated step is routed KV-aware
  among its model's endpoints and sent by the shell (:attr:`StreamProcessor.cascade_step`, Envoy's message
  timeout extended past its bound); :meth:`StreamProcessor.stepped` then answers the client itself with
  that step's answer (an ImmediateResponse, ``x-kvgate-cascade-step``) when the gate passes (a ``replay``
  cascade's streaming request that passed on its first tokens is routed to the same step again, through
  Envoy), else routes the client's body to the next step (the last one goes through Envoy as any request);
  ``GET /v1/models`` also lists each virtual model whose steps are all served;
* response headers: the served endpoint is read back and the internal upstream header removed;
* response body: passed on unchanged (sent back chunk by chunk in FULL_DUPLEX_STREAMED response body
  mode, where the gateway forwards only what the processor returns; else an empty answer);
* the response's end as the stream shows it (headers or a body chunk with ``end_of_stream``, trailers;
  or the stream's end, when the gateway sends the response body here, so the stream lasts as long as
  the response): the request's completion, reported to the router as the completion log reports it (a
  third-party gateway has no such log; the bundled Envoy sends no response body, its log ends requests);
* stream end: :meth:`close` releases the request's in-flight slot.

The gateway answers its probes itself, GET or HEAD, without credentials and without touching an engine:
``/health`` and ``/liveness`` 200 with an empty body (vLLM's ``/health``; that the answer came at all means
Envoy and the ext_proc are up), ``/ready`` and ``/readiness`` 200 while some endpoint is routable for some
model (healthy, not draining, admitted by the model's route), else 503 with an OpenAI JSON error. If the
ext_proc is down Envoy fails closed: 503 for both. The headers reply of a routed request also carries the
decision in dynamic metadata ``kvgate.decision`` (model, endpoint id, matched and prompt blocks, decision
microseconds: :mod:`contracts.epp`) for Envoy's access log.

With a :class:`~extproc.admission.gate.Gate` (an ``[auth]`` section), the caller is identified at the request
headers (Envoy-verified JWT claims from dynamic metadata, or an API key; 401/403 before any body is
buffered), and after parsing the request is admitted against its tenant's model scope and token budget
(403/429). The headers reply then also sets the tenant header (Envoy's per-tenant rate limit keys on it)
and removes the credential so engines never see it. The token reservation is settled at the end: from
the engine's ``usage`` in the response body when Envoy sends it (``settle = "usage"``), otherwise at the
reserved amount; a response that is not 2xx refunds it.

Every failure becomes an ImmediateResponse with an OpenAI-style JSON error (this is the one boundary
that formats :class:`~extproc.errors.GatewayError`); an unexpected exception is a 500 with a generic
message and a logged traceback, never a pass-through.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum, auto

import orjson
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf import json_format
from google.protobuf.duration_pb2 import Duration
from google.protobuf.struct_pb2 import Struct

from contracts.epp import (
    ANSWERED_KEY,
    CASCADE_STEP_HEADER,
    CONFORMANCE_HEADER,
    CONFORMANCE_SERVED,
    DECISION_BLOCKS,
    DECISION_CASCADE_STEP,
    DECISION_ENDPOINT,
    DECISION_MATCHED,
    DECISION_MATCHED_TOKENS,
    DECISION_MODEL,
    DECISION_NS,
    DECISION_RESPONSES_SCOPE,
    DECISION_TENANT,
    DECISION_US,
    DESTINATION,
    EXTPROC_ATTRIBUTES,
    JWT_NS,
    JWT_PAYLOAD,
    JWT_STATUS,
    LB_NS,
    MAX_CHUNK,
    MODEL_HEADER,
    MODEL_REWRITE,
    PRIMARY,
    REJECTED_KEY,
    REJECTED_NS,
    SERVED,
    SOURCE_ADDRESS,
    SUBSET_KEY,
    SUBSET_NS,
    TENANT_HEADER,
    UPSTREAM_HEADER,
)
from contracts.federation import (
    CLIENT_SALT_HEADER,
    FORWARD_STREAMED,
    HOP_HEADER,
    REFUSED_HEADER,
    SALTED_HEADER,
    UNTRUSTED,
)
from contracts.tracing import Timeline
from extproc.admission.gate import Gate, Principal, Ticket, max_output_tokens
from extproc.admission.isolation import is_tenant_salt, isolates, reserved, tenant_salt
from extproc.admission.usage import UsageReader
from extproc.affinity.core import HIT, UNAVAILABLE, UNKNOWN, ResponseAffinity, scope_of
from extproc.burst.core import (
    BURST_HEADER,
    BURST_KINDS,
    CLIENT_CREDENTIALS,
    Burster,
    burst_body,
    wants_burst,
)
from extproc.cascade.answer import SSE, listed_with
from extproc.cascade.plan import Answered, Cascader, Refused, Replayed, Run
from extproc.disagg.errors import HandoffFailed
from extproc.disagg.pairing import Pairing
from extproc.disagg.plan import Disaggregator, Handoff, Verdict
from extproc.errors import (
    BadRequest,
    Forbidden,
    GatewayError,
    NotFound,
    PayloadTooLarge,
    TooManyRequests,
    Unauthorized,
    Unavailable,
)
from extproc.federation.forwarding import PEER_ATTRIBUTE, Forward, Forwarder
from extproc.federation.trust import CLIENT, Inbound
from extproc.fleet import EndpointState
from extproc.flow.control import (
    DEADLINE_HEADER,
    DEFAULT_FLOW,
    DEFAULT_OUTPUT_TOKENS,
    FAIRNESS_HEADER,
    FAIRNESS_HEADER_OLD,
    OBJECTIVE_HEADER,
    OBJECTIVE_HEADER_OLD,
    SLO_TTFT_HEADER,
    TTFT_DEADLINE_UPSTREAM,
    FlowControl,
    FlowRequest,
    Room,
    body_priority,
    room,
    saturated,
)
from extproc.flow.policy import FlowPolicy
from extproc.flow.queue import Entry
from extproc.routing.request import (
    GENERATIVE_KINDS,
    MODELS_PATH,
    Kind,
    ParsedRequest,
    parse_body,
    rewrite_model,
    route_kind,
    unknown_path,
    with_cache_salt,
    without_handoff,
)
from extproc.routing.router import (
    OFFLOAD_REST_CHARS,
    PREFILL_ROLE,
    Decision,
    Router,
    Tokens,
    Unattainable,
)
from extproc.routing.timeouts import TimeoutTable
from extproc.upstream.request import SubRequest

log = logging.getLogger(__name__)
#: A client's ``x-request-id`` logged as sent (:attr:`StreamProcessor.request_id`).
_SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
BUFFERED = ProcessingMode.BUFFERED
#: The response body mode of the bundled config: no response body crosses the ext_proc stream.
NO_BODY = ProcessingMode.NONE
#: The body mode in which the gateway forwards only what the processor sends back.
FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED

#: Liveness probes (vLLM's ``/health``; ``/liveness`` as sglang-router and vllm-router name it): always 200.
HEALTH_PATHS = frozenset({"/health", "/liveness"})
#: Readiness probes (``/readiness`` as sglang-router and vllm-router name it): 200 while something is
#: routable, else 503.
READY_PATHS = frozenset({"/ready", "/readiness"})
#: Seconds a held request's Envoy message timeout reaches past its latest shedding time.
HOLD_SLACK_S = 5.0


class Phase(Enum):
    HEADERS = auto()
    BODY = auto()
    ROUTED = auto()
    DONE = auto()


@dataclass(frozen=True, slots=True)
class ProcessorConfig:
    """``max_body_bytes``: larger bodies get 413; ``offload_bytes``: bodies from this size on are parsed,
    rendered and tokenized by :meth:`StreamProcessor.prepare` in a worker thread (``None``: never);
    ``offload_rest_chars``: a lazily tokenized prompt with at least this many characters left to tokenize
    after its answer has that rest settled in a worker thread before its commit
    (:meth:`StreamProcessor.settles_off_loop`; ``None``: never), fewer on the event loop; ``timeouts``:
    the engine-side bounds set on each routed request, per model; ``hold_timeout_s``: while flow control
    holds a request, extend Envoy's message timeout up to this (Envoy's ``max_message_timeout``; ``None``:
    send no extension)."""

    max_body_bytes: int
    conformance: bool = False
    offload_bytes: int | None = 32 * 1024
    offload_rest_chars: int | None = OFFLOAD_REST_CHARS
    timeouts: TimeoutTable = field(default_factory=TimeoutTable)
    hold_timeout_s: float | None = None
    #: Hosted endpoints overflow may burst to (:mod:`extproc.burst`; ``None``: none configured).
    burst: Burster | None = None
    #: ``previous_response_id`` affinity of the Responses API (:mod:`extproc.affinity`; ``None``: off).
    affinity: ResponseAffinity | None = None


@dataclass(frozen=True, slots=True)
class _Prepared:
    """The pure part of routing a body: the parsed (and model-rewritten) request, the body to forward, the
    prompt's tokens, and how long it took (seconds of the processor's clock)."""

    request: ParsedRequest
    body: bytes
    tokens: Tokens
    seconds: float
    #: The request's way through a cascade (``None``: the model is not virtual).
    run: Run | None = None


class StreamProcessor:
    """Drives one ext_proc stream; not thread-safe, one per stream.

    A large body's parse, chat-template render and tokenization (milliseconds, up to hundreds for a prompt
    near a long context) need none of the router's mutable state, so the shell may run them off its event
    loop: when :meth:`preparable` says so for a message, it calls :meth:`prepare` with it in a worker thread,
    then :meth:`handle` with the same message on the loop, which then only schedules. Likewise for the
    prompt a cascade's body goes on to another step with (:meth:`judged`, :meth:`prepare_step`,
    :meth:`restep`).
    """

    def __init__(
        self,
        router: Router,
        config: ProcessorConfig,
        clock: Callable[[], float],
        gate: Gate | None = None,
        flow: FlowControl[StreamProcessor] | None = None,
        disagg: Disaggregator | None = None,
        cascade: Cascader | None = None,
        federation: Forwarder | None = None,
    ) -> None:
        self._router = router
        self._disagg = disagg
        self._cascade = cascade
        #: A request for a cascade's virtual model: its way through the steps (``None``: not virtual).
        self.run: Run | None = None
        #: A gated cascade step the shell must send (then :meth:`stepped`).
        self.cascade_step: SubRequest | None = None
        #: The gated step's answer returned to the client, once the gate passed.
        self.answered: Answered | None = None
        #: A gated step in flight: (prepared, started).
        self._stepping: tuple[_Prepared, float] | None = None
        #: Where :meth:`judged` sends the client's body on to: (request, body, started), until :meth:`restep`.
        self._next: tuple[ParsedRequest, bytes, float] | None = None
        #: Envoy's message timeout was extended for this request (:meth:`_extension`: only the first
        #: extension counts).
        self._extended = False
        #: Cross-cluster forwarding (:mod:`extproc.federation`; ``None``: no ``[federation]``).
        self._federation = federation
        #: Who sent the request (a linked cluster's verified identity, else a client).
        self._came: Inbound = CLIENT
        #: The request could go to a peer (:meth:`Forwarder.may_forward`, at its headers): its lazy
        #: prompt's window is hashed where the prompt is tokenized (:meth:`_whole_window`).
        self._forwardable = False
        #: Where the request is forwarded (``None``: served in this cluster).
        self.forward: Forward | None = None
        self._noted = False
        #: The disaggregation verdict of the decided request (``None``: its model is served aggregated).
        self.pd: Verdict | None = None
        #: The verdict of a request refused after it (an SGLang decode pick, no prefill fit: 503), for the
        #: shell to count as any verdict, then clear.
        self.pd_refused: Verdict | None = None
        #: The prefill half the shell must send (:meth:`handed_off` or :meth:`prefill_done` after it).
        self.handoff: SubRequest | None = None
        #: How the handoff ended: ``disaggregated``, or the reason it fell back to aggregated.
        self.handoff_outcome: str | None = None
        self._pairing: Pairing | None = None
        #: A vLLM handoff's replies waiting for its prefill: (prepared, started, decided).
        self._pending: tuple[_Prepared, float, float] | None = None
        self._config = config
        self._clock = clock
        self._gate = gate
        self._flow = flow
        #: Queued by flow control, waiting for :meth:`resume` or :meth:`shed` (``None``: not held).
        self.held: Entry[StreamProcessor] | None = None
        #: Sheddable requests this one pushed out of a full queue (the shell answers them 429).
        self.evicted: tuple[Entry[StreamProcessor], ...] = ()
        #: The code of flow control's refusal at arrival (``queue_full``, ``slo_unattainable``), if any.
        self.refused: str | None = None
        #: Routed by :meth:`resume` but its replies not yet taken by the shell (it clears this once they
        #: are): a stream that closes so never reached Envoy, so :meth:`close` undoes the routing.
        self.undelivered = False
        #: The routing replies were built (:meth:`_replies`): the decided request goes to Envoy's upstream.
        self._replied = False
        #: Decided, then answered by the gateway itself (an error: :meth:`_reject`): as :attr:`undelivered`.
        self._answered_here = False
        self._waiting: tuple[_Prepared, float] | None = None
        self._deadline: float | None = None
        #: The request's flow-control band (``None``: not offered to flow control).
        self._priority: int | None = None
        self._arrived = 0.0
        self.principal: Principal | None = None
        #: A Responses API request's affinity scope (:mod:`extproc.affinity`), once routed.
        self._responses_scope: str | None = None
        #: The body carries the tenant's cache salt (:mod:`extproc.admission.isolation`).
        self._isolated = False
        #: The client's own cache salt this gateway mixed with the tenant's (a forward tells the peer).
        self._client_salt: str | None = None
        self.ticket: Ticket | None = None
        self._usage: UsageReader | None = None
        self._phase = Phase.HEADERS
        #: Envoy sends the whole body in one message and waits for the headers reply before it (BUFFERED
        #: body mode: the bundled config with ``--fail-open``), instead of streaming it (FULL_DUPLEX).
        self._buffered = False
        #: How the gateway sends the response body (its ``ProtocolConfiguration``; ``NONE``: not at all, as
        #: the bundled config, or not said).
        self._response_body_mode: int = NO_BODY
        #: The request's completion was reported to the router from this stream (:meth:`_response_end`).
        self._ended = False
        self._headers: dict[str, str] = {}
        #: The id the router keeps this stream's request under when not its ``x-request-id`` (absent, or
        #: another stream's request already holds it: :meth:`_router_id`).
        self._anonymous: str | None = None
        self._subset: frozenset[str] | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        #: What :meth:`prepare` made of the body (or the error it met), for :meth:`handle` to use; likewise
        #: :meth:`prepare_step` for :meth:`restep`.
        self._prepared: _Prepared | Exception | None = None
        self.decision: Decision | None = None
        #: A traced request's phases (the shell sets it before the body comes; ``None``: not traced, and
        #: nothing is recorded).
        self.timeline: Timeline | None = None
        self._held_at = 0

    @property
    def kind(self) -> Kind | None:
        """The request's kind, from its path (``None``: not a routed path, or no headers yet)."""
        return route_kind(self._headers.get(":path", "/"))

    @property
    def receiving(self) -> bool:
        """Whether the request's body is still coming: its decision is not made yet."""
        return self._phase is Phase.BODY

    @property
    def request_id(self) -> str:
        """The request's ``x-request-id`` as it may appear in a log line: as sent when it is 1 to 128 of
        ``A-Z a-z 0-9 . _ : -`` (Envoy's UUIDs, most clients' ids), ``-`` when absent, else
        ``invalid-`` and the first 16 hex digits of its SHA-256 (the same for every line of the
        request), so a client's id never writes a newline, a control character or a fake log line."""
        raw = self._headers.get("x-request-id")
        if raw is None:
            return "-"
        if _SAFE_REQUEST_ID.fullmatch(raw):
            return raw
        digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()
        return f"invalid-{digest[:16]}"

    def _router_id(self) -> str:
        """The id the router keeps the decided request under until its completion
        (:meth:`Router.completed`): :attr:`request_id`, or for a request without ``x-request-id`` an
        unguessable one of its own (``-`` and 16 hex digits), so requests without an id never share one
        (each is outstanding at its endpoint until its own end). Likewise when another stream's request
        still holds its ``x-request-id`` (a gateway that keeps the clients' ids; the bundled Envoy writes
        a fresh one for each request): the id, ``-`` and 16 hex digits, this stream's own; its end
        completes it (a completion log entry naming the id ends the other stream's request)."""
        if self._anonymous is not None:
            return self._anonymous
        if "x-request-id" not in self._headers:
            self._anonymous = f"-{secrets.token_hex(8)}"
        elif self._router.routing(self.request_id) and (
            self.decision is None or self.decision.request_id != self.request_id
        ):
            self._anonymous = f"{self.request_id}-{secrets.token_hex(8)}"
        else:
            return self.request_id
        return self._anonymous

    def handle(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The responses for one message from Envoy, in order."""
        try:
            return self._dispatch(msg)
        except GatewayError as exc:
            return [self._reject(exc)]
        except Exception:
            log.exception("request %s: internal error in ext_proc", self.request_id)
            return [self._reject(_Internal("The gateway failed to process the request."))]

    def preparable(self, msg: pb.ProcessingRequest) -> bool:
        """Whether ``msg`` ends a body of at least ``offload_bytes`` (within the limit) for a routed path:
        then :meth:`prepare` may run first, in a worker thread."""
        limit = self._config.offload_bytes
        if (
            limit is None
            or self._phase is not Phase.BODY
            or route_kind(self._headers.get(":path", "/")) is None
        ):
            return False
        which = msg.WhichOneof("request")
        if which == "request_body" and msg.request_body.end_of_stream:
            size = self._size + len(msg.request_body.body)
        elif which == "request_trailers":
            size = self._size
        else:
            return False
        return limit <= size <= self._config.max_body_bytes

    def prepare(self, msg: pb.ProcessingRequest) -> None:
        """Parse, rewrite, render and tokenize the body ``msg`` ends (:meth:`preparable`), keeping the result
        or the error for :meth:`handle`. Safe in a worker thread while the event loop runs other streams:
        it reads this stream's buffered chunks, the router's models and policy and the disaggregation
        policy, and changes nothing else; the caller does not touch this processor until it returns."""
        last = msg.request_body.body if msg.WhichOneof("request") == "request_body" else b""
        try:
            self._prepared = self._prepare(b"".join([*self._chunks, last]))
        except Exception as exc:  # re-raised by handle, which formats it as any other failure
            self._prepared = exc

    def settles_off_loop(self) -> bool:
        """Whether the decided request's rest of the window (``Decision.rest``, not yet recorded) holds
        at least ``offload_rest_chars`` characters left to tokenize: then the shell runs
        ``decision.rest.settle()`` in a worker thread before :meth:`after_send`, which then records it on
        the loop as it would have (the same index record and history memo state). Less is left on the
        loop, where a thread hop would cost more than the tokenizing."""
        limit = self._config.offload_rest_chars
        decision = self.decision
        if limit is None or decision is None or decision.recorded or decision.served is None:
            return False
        rest = decision.rest
        return rest is not None and rest.chars_left >= limit

    def after_send(self) -> None:
        """Called by the shell once the replies to a message are on their way: deferred bookkeeping (none
        for a request that reaches no engine: :attr:`undelivered`, or one answered here after decide)."""
        if self.undelivered or self._answered_here:
            return
        if self.decision is not None and not self.decision.recorded:
            self._router.commit(self.decision, self._clock())
        if self._federation is not None and self.forward is None and not self._noted:
            decision = self.decision
            if decision is not None and decision.recorded and decision.rest is None:
                self._noted = True
                self._federation.note(decision.model, decision.digests)

    def close(self) -> None:
        """The stream ended: release the request's in-flight slot and settle its tokens, whatever happened
        (refunded when no engine got the request)."""
        if self._pairing is not None and (self._pending is not None or self.handoff is not None):
            # The client left during the prefill, or before the shell sent SGLang's prefill half beside
            # the request (it takes :attr:`handoff` when it does; then only that half's end releases it).
            self._pairing.release()
            self._pending = self.handoff = None
        if self.decision is not None and (self.undelivered or self._answered_here):
            # Routed from the queue as the client left, or answered by the gateway after decide: no engine
            # sees it (no completion log) and nothing is cached there; release what decide took, record
            # nothing in the index.
            self._router.completed(self.decision.request_id, self._clock())
        elif self.decision is not None:
            # The bookkeeping after_send defers, when the stream ended first (Envoy may close it once the
            # answer is out, before the shell's generator resumes to call after_send).
            self.after_send()
            if self._response_body_mode != NO_BODY:
                # The gateway sends the response body here, so the stream lasts as long as the response:
                # its end is the request's (a client that left, an upstream reset), reported or not.
                self._response_end()
        if self.decision is not None:
            self._router.finish(self.decision)
            if self._stepping is not None:  # the client left during a cascade step (no completion log)
                self._router.completed(self.decision.request_id, self._clock())
                self._stepping = self.cascade_step = None
        if self.held is not None or self.undelivered or self._answered_here:
            # No engine got it (held until the client left, decided but never sent, or answered here):
            # its reservation is refunded in full. A settled ticket is never refunded or charged again.
            self._refund()
        else:
            self._settle()
        self._phase = Phase.DONE

    def _dispatch(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        which = msg.WhichOneof("request")
        if which == "request_headers":
            return self._on_request_headers(msg)
        if which == "request_body":
            return self._on_request_body(msg.request_body.body, msg.request_body.end_of_stream)
        if which == "request_trailers":
            if self._phase is Phase.HEADERS:
                raise _Internal("Request trailers before the request headers.")
            out = self._on_request_body(b"", True) if self._phase is Phase.BODY else []
            if out and out[0].HasField("immediate_response"):
                return out  # answered (GET /v1/models): nothing follows an immediate response
            return [*out, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if which == "response_headers":
            out = self._on_response_headers(msg)
            if msg.response_headers.end_of_stream:  # a response without a body: it ended here
                self._response_end()
            return out
        if which == "response_body":
            if self._usage is not None:
                self._usage.feed(msg.response_body.body, msg.response_body.end_of_stream)
                if self._usage.ended:
                    self._settle()
            if msg.response_body.end_of_stream:
                self._response_end()
            if self._response_body_mode == FULL_DUPLEX:  # the gateway keeps nothing: send it back
                return _response_chunks(msg.response_body.body, msg.response_body.end_of_stream)
            return [pb.ProcessingResponse(response_body=pb.BodyResponse())]
        if which == "response_trailers":
            self._response_end()
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        raise BadRequest("Unexpected ext_proc message.")

    def _on_request_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self._phase is not Phase.HEADERS:
            raise _Internal("Request headers received twice.")
        self._arrived = self._clock()
        protocol = msg.protocol_config
        self._buffered = protocol.request_body_mode == BUFFERED
        self._response_body_mode = protocol.response_body_mode
        for h in msg.request_headers.headers.headers:
            self._headers[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
        self._subset = _subset_hint(msg)
        if self._federation is not None:
            self._came = self._federation.inbound(_attribute(msg, PEER_ATTRIBUTE), self._headers)
            if self._came.unlinked is not None:  # a cluster no link names (any more): its fallback serves it
                raise Unauthorized("This cluster has no link to the forwarding cluster.", code=UNTRUSTED)
            self._forwardable = self._federation.may_forward(self._came)
        path = self._headers.get(":path", "/")
        if self._gate is not None and self._federation is not None and self._came.forwarded:
            # a linked cluster's hop: its asserted tenant (no credentials travel across clusters)
            self.principal = self._federation.principal(self._came, self._gate.tenants)
        elif self._gate is not None and not _is_probe(path):  # probes need no credentials (as vLLM's)
            claims, failure = _jwt_metadata(msg)
            self.principal = self._gate.identify(
                self._headers.get("authorization"),
                claims,
                failure,
                address=_client_address(msg),
                now=self._clock(),
            )
        if route_kind(path) is not None and self._headers.get(":method", "POST") != "POST":
            # an engine answers anything but POST there with 405: refused before a decision is spent
            raise NotFound(f"Use POST for {path.split('?', 1)[0][:200]}.")
        if not msg.request_headers.end_of_stream:
            self._phase = Phase.BODY
            # Buffered: Envoy holds the body until the headers are answered; the routing headers then
            # come with the body's answer (a body reply's header mutation applies in this mode only).
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())] if self._buffered else []
        self._phase = Phase.DONE
        if route_kind(path) is not None:
            raise BadRequest("The request body is empty; expected a JSON object.")
        return self._answer(path)

    def _on_request_body(self, chunk: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        if self._phase is not Phase.BODY:
            if self._phase is Phase.DONE:  # already answered (e.g. 413): drain silently
                return []
            raise _Internal("Request body outside the body phase.")
        self._size += len(chunk)
        if self._size > self._config.max_body_bytes:
            self._phase = Phase.DONE
            self._chunks.clear()
            raise PayloadTooLarge(
                f"The request body exceeds the gateway's limit of {self._config.max_body_bytes} bytes."
            )
        if chunk:
            self._chunks.append(chunk)
        if not end_of_stream:
            return []
        self._phase = Phase.DONE
        return self._route()

    def _prepare(self, body: bytes) -> _Prepared:
        """Parse the body of a routed path, apply the model rewrite, render and tokenize the prompt."""
        started = self._clock()
        timeline = self.timeline
        if timeline is not None:
            timeline.skip()
        kind = route_kind(self._headers.get(":path", "/"))
        assert kind is not None, "only routed paths are prepared"
        # A client never chooses where an engine fetches KV: its own handoff fields are dropped here, once,
        # so every route (aggregated, paired, cascade, burst, federation, migration) sends the rest.
        request, body = without_handoff(parse_body(kind, body), body)
        rewrite = self._headers.get(MODEL_REWRITE)
        if rewrite:
            request, body = rewrite_model(request, rewrite)
        principal, gate = self.principal, self._gate
        if self._came.salted and principal is not None:  # the forwarding cluster's tenant salt stays
            came = self._came
            if (  # not the asserted tenant's salt (another tenant's, or none): refused for the fallback
                came.tenant is None
                or not is_tenant_salt(request.cache_salt)
                or tenant_salt(came.tenant, came.client_salt) != request.cache_salt
            ):
                raise Forbidden(
                    "x-kvgate-kv-salted: the body must carry the asserted tenant's gateway cache salt.",
                    code="bad_tenant_salt",
                )
            self._isolated = True
        elif principal is not None and gate is not None and isolates(gate.config, principal.tenant):
            # the tenant's own KV: its salt replaces the client's, so routing and engines follow it
            self._client_salt = request.cache_salt
            request, body = with_cache_salt(request, tenant_salt(principal.tenant.id, request.cache_salt))
            self._isolated = True
        elif principal is not None and reserved(request.cache_salt):  # it could be an isolated tenant's
            raise BadRequest(
                "cache_salt: values starting with 'kvgate-' are reserved for the gateway's tenant isolation",
                code="reserved_cache_salt",
                param="cache_salt",
            )
        run = None
        if self._cascade is not None:  # a virtual model: routed (and tokenized) as its first step
            try:
                run = self._cascade.start(
                    request.model,
                    request.body,
                    chat=kind is Kind.CHAT,
                    now=self._arrived,
                    generative=kind in GENERATIVE_KINDS,
                )
            except Refused as exc:  # a request the cascade cannot serve as asked (its kind, echo)
                raise BadRequest(str(exc), param=exc.param) from None
            if run is not None:
                request, body = rewrite_model(request, run.model)
        if timeline is not None:
            timeline.mark("parse")
        window = self._whole_window(request, run)
        tokens = self._router.tokens(
            request, exact_count=self._gate is not None, timeline=timeline, window=window
        )
        return _Prepared(request, body, tokens, self._clock() - started, run)

    def _whole_window(self, request: ParsedRequest, run: Run | None) -> bool:
        """Whether ``request``'s window is tokenized and hashed whole where it is prepared (in the worker
        thread for a large body), not after the decision on the event loop: a request disaggregation may
        plan (:meth:`_paired`: the plan counts its uncached tokens exactly), or one federation may forward
        (:meth:`_forwarded` hashes the window before its verdict) that goes to no gated cascade step first."""
        return self._paired(request, run) or (self._forwardable and not (run is not None and run.gated))

    def _paired(self, request: ParsedRequest, run: Run | None) -> bool:
        """Whether ``request`` may be paired with a prefill half (:mod:`extproc.disagg`): chat or
        completions, no gated cascade step, its model's serving spec not aggregated."""
        return (
            self._disagg is not None
            and request.kind in GENERATIVE_KINDS
            and not (run is not None and run.gated)
            and self._disagg.pairs(request.model)
        )

    def _route(self) -> list[pb.ProcessingResponse]:
        """Route the buffered body: prepared already (:meth:`prepare`), or prepared now; the body is joined
        once, by whichever prepares it. With flow control, a request with no room yet is held
        (:attr:`held`) and routed by :meth:`resume` when the shell dispatches it."""
        chunks, self._chunks = self._chunks, []
        path = self._headers.get(":path", "/")
        if route_kind(path) is None:
            return self._answer(path)
        prepared, self._prepared = self._prepared, None
        if isinstance(prepared, Exception):
            raise prepared
        started = self._clock()
        if prepared is None:
            prepared = self._prepare(b"".join(chunks))
        else:
            started -= prepared.seconds  # the decision's time includes the preparation done beforehand
        if self._gate is not None and self.principal is not None:
            # A cascade is admitted by its virtual model's name (the one the tenant asked for).
            asked = prepared.request
            if prepared.run is not None:
                asked = dataclasses.replace(asked, model=prepared.run.virtual)
            self.ticket = self._gate.admit(self.principal, asked, prepared.tokens.count, self._clock())
        flow = self._flow
        if flow is not None:
            try:
                request = self._flow_request(flow.policy, prepared)
                now = self._clock()
                space = flow_room(flow.policy, self._router, request.model, now, request.priority)
                deadline = request.deadline
                goes = flow.goes(request, space, now)
                if not goes and self._config.burst is not None and prepared.run is None:
                    burst = self._burst(self._config.burst, flow.policy, prepared, deadline, now)
                    if burst is not None:  # the local fleet cannot take it in time: a hosted endpoint does
                        return burst
                if deadline is not None and deadline > now and not goes:
                    self._check_deadline(prepared, deadline - now, now)  # it would wait: can it make it?
                # The waiting room holds only a model the router knows (else its 404 at once, no queue).
                known = space is not Room.NONE or self._router.knows(request.model)
                offer = flow.offer(request, self, space, now, known)
            except GatewayError as exc:
                self._refund()
                if isinstance(exc, TooManyRequests):
                    self.refused = exc.code
                raise
            self._deadline = request.deadline
            self._priority = request.priority
            self.evicted = offer.evicted
            if offer.held is not None:
                self.held = offer.held
                if self.timeline is not None:
                    self._held_at = self.timeline.now()
                self._waiting = (prepared, started)
                return self._hold_reply(offer.held)
        return self._decide(prepared, started)

    def _burst(
        self, burster: Burster, policy: FlowPolicy, prepared: _Prepared, deadline: float | None, now: float
    ) -> list[pb.ProcessingResponse] | None:
        """The replies that send a request flow control would not let go at once to its model's burst
        endpoint, when the rule of :func:`extproc.burst.core.wants_burst` says so and the endpoint's
        budget has a token; ``None``: it stays local (queued, or refused, as without burst)."""
        request = prepared.request
        target = burster.target(request.model)
        if target is None or policy.burst_per_minute <= 0:
            return None
        if request.kind.value not in BURST_KINDS:  # responses, score, rerank: as without burst
            return None
        budget_s = None if deadline is None else deadline - now
        miss = False
        if budget_s is not None:
            try:
                self._router.check_deadline(request, prepared.tokens, budget_s, now)
            except Unattainable:
                miss = True
        if not wants_burst(True, budget_s, miss) or not burster.take(target, policy.burst_per_minute, now):
            return None
        # Fields that bill or reach the gateway's account are dropped (the tenant salt is this fleet's).
        body = orjson.dumps(burst_body(request.kind.value, request.body, target.models[request.model]))
        self._phase = Phase.ROUTED
        set_headers = [
            (BURST_HEADER, target.header_value),
            ("content-length", str(len(body))),
            *self._config.timeouts.headers(request.model, request.stream),
        ]
        principal = self.principal
        if principal is not None:  # Envoy's per-tenant rate limit counts it; the burst route removes it
            set_headers.append((TENANT_HEADER, principal.tenant.id))
        # Envoy removes them too (route config) and its credential injector overwrites Authorization:
        # no client credential reaches a hosted endpoint, with or without [auth].
        out, metadata = self._sending(set_headers, CLIENT_CREDENTIALS, body)
        noted = metadata.fields[DECISION_NS].struct_value.fields
        noted[DECISION_MODEL].string_value = request.model
        if principal is not None:
            noted[DECISION_TENANT].string_value = principal.tenant.id
        # No endpoint id: the completion log (which follows it) is for local engines only.
        log.info("request %s: burst to %s (%s)", self.request_id, target.name, request.model)
        return out

    def resume(self) -> list[pb.ProcessingResponse]:
        """Route a held request now (flow control dispatched it: the shell calls this once, on the event
        loop, with the fleet's state as it is now)."""
        waiting, self._waiting, self.held = self._waiting, None, None
        assert waiting is not None, "resume() only after a hold"
        self.undelivered = True
        if self.timeline is not None:
            self.timeline.add("queue_wait", self._held_at, self.timeline.now())
        try:
            return self._decide(*waiting)
        except GatewayError as exc:
            return [self._reject(exc)]
        except Exception:
            log.exception("request %s: internal error in ext_proc", self.request_id)
            return [self._reject(_Internal("The gateway failed to process the request."))]

    def shed(self, error: GatewayError) -> list[pb.ProcessingResponse]:
        """Answer a held request that leaves the queue unrouted (it expired, or was evicted) with ``error``;
        its token reservation is refunded."""
        self._waiting, self.held = None, None
        self._refund()
        return [self._reject(error)]

    def _hold_reply(self, entry: Entry[StreamProcessor]) -> list[pb.ProcessingResponse]:
        """While held, Envoy must not time the ext_proc out: extend its message timeout past the longest
        wait (``hold_timeout_s``: Envoy's ``max_message_timeout`` caps it; ``None``: nothing is sent)."""
        assert self._waiting is not None
        return self._extension(max(0.0, entry.expires - self._clock()), self._waiting[0])

    def _extension(
        self, wait_s: float, prepared: _Prepared, least_s: float = 0.0
    ) -> list[pb.ProcessingResponse]:
        """Extend Envoy's message timeout while the ext_proc waits ``wait_s`` (a hold, a gated step, a
        prefill half) before it answers the body message, up to ``hold_timeout_s`` (Envoy's
        ``max_message_timeout``; ``None``: nothing is sent). Envoy takes one extension per message and
        ignores the rest (``ProcessorState::restartMessageTimer``: ``new_timeout_received_``, reset when
        the next message is sent), so the first one covers whatever may still follow it: every gated
        cascade step left and a prefill half (:meth:`_after_s`; at least ``least_s``), plus
        :data:`HOLD_SLACK_S`; later waits send nothing."""
        cap = self._config.hold_timeout_s
        if cap is None or self._extended:
            return []
        self._extended = True
        seconds = min(cap, max(1.0, wait_s + max(least_s, self._after_s(prepared)) + HOLD_SLACK_S))
        return [pb.ProcessingResponse(override_message_timeout=_duration(seconds))]

    def _after_s(self, prepared: _Prepared) -> float:
        """The longest the ext_proc may still wait on a request after a hold (and within any gated step):
        each gated cascade step left at its ``timeout_s``, then the longest prefill half of the models it
        may end on (``prefill_timeout_s``)."""
        run, models = prepared.run, [prepared.request.model]
        gated = 0.0
        if run is not None:
            steps = run.spec.steps
            models = list(steps[run.step :])
            if run.gated:
                gated = run.spec.timeout_s * (len(steps) - 1 - run.step)
        prefill = self._disagg.policy.prefill_bound(models) if self._disagg is not None else 0.0
        return gated + prefill

    def _flow_request(self, policy: FlowPolicy, prepared: _Prepared) -> FlowRequest:
        """Flow control's view of the request: its objective's priority (header, checked against the
        tenant's allowed objectives; else the tenant's priority; else 0), its flow (under auth the tenant,
        else the fairness-id header, else one shared flow), its fair-share cost and its TTFT deadline
        (``x-kvgate-deadline-ms``, else ``x-llm-d-slo-ttft-ms``, else the objective's ``ttft_ms``; from the
        request's arrival)."""
        headers = self._headers
        tenant = self.principal.tenant if self.principal is not None else None
        name = headers.get(OBJECTIVE_HEADER) or headers.get(OBJECTIVE_HEADER_OLD)
        objective = None
        if name:
            objective = policy.objectives.get(name)
            if objective is None:
                raise BadRequest(
                    f"Unknown inference objective `{name}`.", code="unknown_objective", param=OBJECTIVE_HEADER
                )
            if tenant is not None and not tenant.allows_objective(name):
                raise Forbidden(
                    f"Tenant `{tenant.id}` may not use objective `{name}`.",
                    code="objective_not_allowed",
                    param=OBJECTIVE_HEADER,
                )
        priority = (
            objective.priority if objective is not None else tenant.priority if tenant is not None else 0
        )
        if tenant is not None:
            flow = tenant.id
        else:
            flow = headers.get(FAIRNESS_HEADER) or headers.get(FAIRNESS_HEADER_OLD) or DEFAULT_FLOW
        ttft_ms = _positive_ms(headers, SLO_TTFT_HEADER)
        if ttft_ms is None and objective is not None:
            ttft_ms = objective.ttft_ms
        deadline_ms = _positive_ms(headers, DEADLINE_HEADER)
        if deadline_ms is None:
            deadline_ms = ttft_ms
        request, tokens = prepared.request, prepared.tokens
        if policy.fairness == "requests":
            cost = 1.0
        else:
            output = max_output_tokens(request)
            cost = float(tokens.count + (output if output is not None else DEFAULT_OUTPUT_TOKENS))
        deadline = None if deadline_ms is None else self._arrived + deadline_ms / 1000.0
        return FlowRequest(request.model, priority, flow, cost, len(prepared.body), deadline)

    def _check_deadline(self, prepared: _Prepared, budget_s: float, now: float) -> None:
        """A request about to be queued with ``budget_s`` seconds of its TTFT deadline left: 429
        ``slo_unattainable`` at once if, routed right now, every endpoint is confidently predicted to
        miss it (waiting can only make it later)."""
        request = prepared.request
        try:
            self._router.check_deadline(request, prepared.tokens, budget_s, now)
        except Unattainable as exc:
            raise self._unattainable(request.model, exc) from None

    def _unattainable(self, model: str, exc: Unattainable) -> TooManyRequests:
        assert self._flow is not None
        self.refused = "slo_unattainable"
        return TooManyRequests(
            f"No endpoint for model `{model}` is predicted to send the first token within "
            f"the request's TTFT deadline (best {exc.predicted_s * 1000:.0f} ms, "
            f"{max(0.0, exc.budget_s) * 1000:.0f} ms left); retry later.",
            code="slo_unattainable",
            retry_after_s=self._flow.policy.retry_after_s,
        )

    def _admit(self, model: str) -> Callable[[EndpointState], bool] | None:
        """Flow control's filter for the router: endpoints of ``model`` not saturated for the request's
        band (its headroom left free; ``None``: flow control off, or its policy can never hold a
        request)."""
        flow = self._flow
        if flow is None or not flow.policy.holds:
            return None
        policy = flow.policy
        priority = self._priority

        def has_room(state: EndpointState) -> bool:
            endpoint = state.endpoint
            headroom = policy.headroom_at(priority, endpoint.priority_order)
            return not saturated(policy.saturation_for(model, endpoint.role), state, headroom)

        return has_room

    def _decide(self, prepared: _Prepared, started: float) -> list[pb.ProcessingResponse]:
        """Schedule the prepared request and build the replies that send it to its pick."""
        request, body, tokens = prepared.request, prepared.body, prepared.tokens
        pinned = None
        if self._config.conformance and CONFORMANCE_HEADER in self._headers:
            pinned = [p.strip() for p in self._headers[CONFORMANCE_HEADER].split(",") if p.strip()]
        now = self._clock()
        budget = None if self._deadline is None else self._deadline - now
        if self.timeline is not None:
            self.timeline.skip()
        prefer = self._affine(request, now)
        paired = self._paired(request, prepared.run)
        try:
            self.decision = self._router.decide(
                request,
                request_id=self._router_id(),
                now=now,
                subset=self._subset,
                pinned=pinned,
                tokens=tokens,
                admit=self._admit(request.model),
                ttft_budget_s=budget,
                timeline=self.timeline,
                prefer=prefer,
                paired=paired,
            )
        except Exception as exc:  # a 429/503/404 or a gateway fault: nothing was used, refund
            self._refund()
            if isinstance(exc, Unattainable) and self._flow is not None:
                raise self._unattainable(request.model, exc) from None
            raise
        decided = self._clock()
        if prefer is not None and self._config.affinity is not None:
            hit = self.decision.endpoints[0].id == prefer
            self._config.affinity.count(HIT if hit else UNAVAILABLE)
        self._phase = Phase.ROUTED
        self.run = prepared.run
        if self.run is not None and self.run.gated:
            return self._step(prepared, started)
        if self._federation is not None:
            self.forward = self._forwarded(self._federation, len(body), decided)
            if self.forward is not None:
                return self._replies(request.stream, body, started, decided)
        handoff = None
        if self._disagg is not None and request.kind in GENERATIVE_KINDS:  # P/D: chat and completions
            self.pd = self._disagg.plan(
                self.decision, decided, self._subset, pinned, admit=self._admit(request.model)
            )
            handoff = self.pd.handoff if self.pd is not None else None
            if self.pd is not None and handoff is None and not self.pd.alone:
                # an SGLang decode server, and no prefill fit
                self._router.finish(self.decision)
                self._router.completed(self.decision.request_id, self._clock())  # no engine gets it
                self.pd_refused = self.pd  # counted by the shell all the same (no decision is left)
                self.decision = self.pd = None
                self._refund()
                message = "No prefill endpoint is ready to pair with the decode endpoint."
                raise Unavailable(message, code="no_prefill_endpoint")
        # The band goes on to engines that schedule by priority; a client's own priority never does
        # (request.body is the body as sent: every rewrite (model, escalation, salt) replaces both). A
        # paired request's body goes to its prefill endpoint too.
        to_engine = self._flow.policy.engine_priority if self._flow is not None else None
        declared = [s.endpoint.priority_order for s in self.decision.endpoints]
        if handoff is not None:
            declared.append(handoff.prefill.endpoint.priority_order)
        sent = body_priority(to_engine, self._priority, declared, "priority" in request.body)
        if sent.value is not None:
            body = orjson.dumps({**request.body, "priority": sent.value})
        elif sent.drop:
            body = orjson.dumps({k: v for k, v in request.body.items() if k != "priority"})
        if handoff is not None:
            return self._pair(handoff, prepared, body, started, decided)
        return self._replies(request.stream, body, started, decided)

    def _affine(self, request: ParsedRequest, now: float) -> str | None:
        """A Responses API request's affinity (:mod:`extproc.affinity`): its scope is noted for the
        completion log (the response id is learned there); with ``previous_response_id``, the endpoint that
        produced that response in the same scope, else ``None`` (counted ``unknown``)."""
        affinity = self._config.affinity
        if affinity is None or request.kind is not Kind.RESPONSES:
            return None
        self._responses_scope = scope_of(self.principal.tenant.id if self.principal is not None else None)
        previous = request.body.get("previous_response_id")
        if not isinstance(previous, str) or not previous:
            return None
        endpoint = affinity.lookup(self._responses_scope, previous, now)
        if endpoint is None:
            affinity.count(UNKNOWN)
        return endpoint

    def _forwarded(self, federation: Forwarder, body_bytes: int, now: float) -> Forward | None:
        """Whether the decided request goes to a peer cluster instead (:mod:`extproc.federation`): the
        pick's lead is the local lead; a lazy prompt's whole window is hashed first when a peer could win
        (already where it was prepared, when :meth:`Forwarder.may_forward` said so at its headers).
        A forwarded request is not recorded at the local pick and not counted ahead there in the TTFT
        predictor (it computes nothing here)."""
        decision = self.decision
        assert decision is not None
        block_size = self._router.policy.block_size
        lead = decision.matched_blocks
        if not federation.worth_hashing(self._came, decision.prompt_blocks, lead, block_size):
            return None
        rest = decision.rest
        if rest is not None:
            rest.finish()
        digests = rest.digests if rest is not None else decision.digests
        forward = federation.route(
            decision.model, digests, lead, block_size, body_bytes, self._came, now, self._subset
        )
        if forward is not None:
            decision.recorded = True
            self._router.predictor.forget(decision.request_id)
        return forward

    def _replies(
        self, stream: bool, body: bytes, started: float, decided: float, sent: float | None = None
    ) -> list[pb.ProcessingResponse]:
        """The replies that send the decided request, with ``body``, to its pick (or, forwarded, to the
        peer's ingress first and the pick as its fallback); ``sent``: when they go, if later than
        ``decided`` (after a prefill half), for the TTFT deadline left."""
        decision = self.decision
        assert decision is not None, "replies only after a decision"
        destination = decision.destination
        if self.forward is not None:
            destination = f"{self.forward.ingress},{destination}"
        pick = decision.endpoints[0]
        set_headers = [
            (DESTINATION, destination),
            ("content-length", str(len(body))),
            (MODEL_HEADER, decision.model),
            *self._timeouts(decision.model, stream),
        ]
        if self.forward is not None:
            set_headers.append((HOP_HEADER, self.forward.hop))
            if self._isolated:  # the peer keeps this tenant salt rather than salting again, once it checked
                set_headers.append((SALTED_HEADER, "1"))  # it is the asserted tenant's (the client's salt)
                if self._client_salt:
                    set_headers.append((CLIENT_SALT_HEADER, self._client_salt.encode().hex()))
        if self._deadline is not None:
            left_ms = max(1, round((self._deadline - (decided if sent is None else sent)) * 1000))
            set_headers.append((TTFT_DEADLINE_UPSTREAM, str(left_ms)))
        remove_headers: tuple[str, ...] = ()
        if self.principal is not None:
            set_headers.append((TENANT_HEADER, self.principal.tenant.id))
            remove_headers = ("authorization",)  # the gateway consumed it; engines never see it
        if self._came.salted:  # checked here: this fleet's engines never see the client's own salt
            remove_headers = (*remove_headers, CLIENT_SALT_HEADER)
        out, metadata = self._sending(set_headers, remove_headers, body)
        # Field by field: Struct.update walks a dict in Python, several times slower.
        lb = metadata.fields[LB_NS].struct_value.fields
        lb[DESTINATION].string_value = destination
        lb[PRIMARY].string_value = pick.address
        noted = metadata.fields[DECISION_NS].struct_value.fields
        noted[DECISION_MODEL].string_value = decision.model
        if self.principal is not None:  # the access log's tenant
            noted[DECISION_TENANT].string_value = self.principal.tenant.id
        noted[DECISION_ENDPOINT].string_value = pick.id
        noted[DECISION_MATCHED].number_value = decision.matched_blocks
        noted[DECISION_BLOCKS].number_value = decision.prompt_blocks
        noted[DECISION_US].number_value = round((decided - started) * 1e6)
        noted[DECISION_MATCHED_TOKENS].number_value = decision.matched_blocks * self._router.policy.block_size
        if self.run is not None:  # a cascade request (escalated or replayed): Envoy names its step
            noted[DECISION_CASCADE_STEP].string_value = str(self.run.number)
        if self._responses_scope is not None:  # its response id is learned from the completion log
            noted[DECISION_RESPONSES_SCOPE].string_value = self._responses_scope
        if self.forward is not None and stream:  # the peer's health judges its first byte
            noted[FORWARD_STREAMED].string_value = "1"
        self._replied = True
        return out

    def _timeouts(self, model: str, stream: bool) -> list[tuple[str, str]]:
        """Envoy's bounds for the decided request: forwarded, every try is bounded, a non-streamed one by
        the federation's ``forward_first_byte_s`` (a hung peer falls back to the local pick by then)."""
        if self.forward is None or self._federation is None:
            return self._config.timeouts.headers(model, stream)
        forward_s = self._federation.federation.config.forward_first_byte_s
        return self._config.timeouts.headers(model, stream, forwarded=True, forward_s=forward_s)

    def _sending(
        self, set_headers: Iterable[tuple[str, str]], remove_headers: Iterable[str], body: bytes
    ) -> tuple[list[pb.ProcessingResponse], Struct]:
        """The replies that send the request on with ``set_headers`` set, ``remove_headers`` removed and
        ``body``: one body reply in buffered mode, else the headers reply and the body streamed back in
        chunks; and the dynamic metadata of the reply that routes, for the caller to fill. Built in place:
        a sub-message passed to a constructor is copied (about 4x the time for a routing reply)."""
        first = pb.ProcessingResponse()
        if self._buffered:
            common = first.request_body.response
            common.body_mutation.body = body
        else:
            common = first.request_headers.response
        common.clear_route_cache = True
        _mutate(common.header_mutation, set_headers, remove_headers)
        out = [first]
        if not self._buffered:
            if not body:
                out.append(_body_chunk(b"", True))
            for off in range(0, len(body), MAX_CHUNK):
                out.append(_body_chunk(body[off : off + MAX_CHUNK], off + MAX_CHUNK >= len(body)))
        return out, first.dynamic_metadata

    def _step(self, prepared: _Prepared, started: float) -> list[pb.ProcessingResponse]:
        """A gated cascade step (:mod:`extproc.cascade`): its body, for the shell to send to the pick
        (:attr:`cascade_step`); the replies wait for it (:meth:`stepped`), Envoy's message timeout
        extended past its bound meanwhile."""
        run, decision = prepared.run, self.decision
        assert run is not None and decision is not None
        headers = {"x-request-id": self.request_id} if "x-request-id" in self._headers else {}
        path = self._headers.get(":path", "/")
        address = decision.endpoints[0].address
        body = run.body()
        self.cascade_step = SubRequest(address, path, body, run.spec.timeout_s, headers, stream=run.streamed)
        self._stepping = (prepared, started)
        return self._extension(0.0, prepared)  # this step and what may follow it (_after_s)

    def step_line(self, line: bytes) -> bool:
        """One line of a streamed cascade step's answer (:attr:`SubRequest.stream`); false: stop reading,
        the gate failed on its first tokens (then :meth:`stepped` as for any end)."""
        assert self.run is not None, "step_line() only during a cascade step"
        return self.run.feed(line)

    def stepped(self, answer: bytes | None, failure: str | None = None) -> list[pb.ProcessingResponse]:
        """The gated cascade step ended: ``answer`` its engine's 2xx body (a streamed step: ``None``, its
        lines went to :meth:`step_line`), else ``failure`` (``timeout``, ``unreachable``, ``status``).
        The step's endpoint is released; the gate passes the answer to the client (an
        ImmediateResponse), or the client's body goes to the next step. :meth:`judged`, then
        :meth:`restep` when it returns ``None`` (the shell runs :meth:`prepare_step` between them in a
        worker thread for a large body)."""
        out = self.judged(answer, failure)
        return out if out is not None else self.restep()

    def judged(self, answer: bytes | None, failure: str | None = None) -> list[pb.ProcessingResponse] | None:
        """:meth:`stepped` up to the gate's verdict: the replies when the cascade ends here (the answer, or
        an error); ``None`` when the client's body goes on to another step (the next, or the same again
        through Envoy: a replay): then :meth:`restep`, after :meth:`prepare_step` in a worker thread when
        :meth:`step_preparable`."""
        pending, self._stepping, self.cascade_step = self._stepping, None, None
        assert pending is not None and self.run is not None, "stepped() only after a cascade step"
        prepared, started = pending
        run, decision, now = self.run, self.decision, self._clock()
        if decision is not None:  # the sub-request never went through Envoy: no completion log for it
            self._router.commit(decision, now)
            self._router.finish(decision)
            self._router.completed(decision.request_id, now)
            self.decision = None
        try:
            answered = run.judge(answer, failure)
            if self._cascade is not None:
                self._cascade.learn(run)
            if isinstance(answered, Replayed):  # passed on its first tokens: the step again, via Envoy
                # The same prompt as the step just committed: the render and history memos answer it.
                seeded = dataclasses.replace(prepared.request, body=run.replay_body())
                self._next = (*rewrite_model(seeded, run.model), started)
                return None
            if answered is not None:
                self.answered = answered
                self._phase = Phase.DONE
                return [_answer_reply(answered)]
            self._next = (*rewrite_model(prepared.request, run.escalate()), started)
            return None
        except GatewayError as exc:
            return [self._reject(exc)]
        except Exception:
            log.exception("request %s: internal error in ext_proc", self.request_id)
            return [self._reject(_Internal("The gateway failed to process the request."))]

    def step_preparable(self) -> bool:
        """Whether the body :meth:`judged` sends on to another step is at least ``offload_bytes``: then
        :meth:`prepare_step` may run first, in a worker thread."""
        limit = self._config.offload_bytes
        return self._next is not None and limit is not None and len(self._next[1]) >= limit

    def prepare_step(self) -> None:
        """Render and tokenize the prompt of the step :meth:`judged` sends the body on to, keeping the result
        or the error for :meth:`restep`. Safe in a worker thread while the event loop runs other streams,
        as :meth:`prepare` is: it reads the router's models and policy and the disaggregation policy, and
        changes nothing else."""
        assert self._next is not None and self.run is not None, "prepare_step() only after judged()"
        request, body, _ = self._next
        try:
            tokens = self._router.tokens(
                request, exact_count=self._gate is not None, window=self._whole_window(request, self.run)
            )
            self._prepared = _Prepared(request, body, tokens, 0.0, self.run)
        except Exception as exc:  # re-raised by restep, which formats it as any other failure
            self._prepared = exc

    def restep(self) -> list[pb.ProcessingResponse]:
        """Route the client's body to the step :meth:`judged` chose: prepared already
        (:meth:`prepare_step`), or prepared now."""
        assert self._next is not None, "restep() only after judged() returned None"
        try:
            if self._prepared is None:
                self.prepare_step()
            prepared, self._prepared = self._prepared, None
            started = self._next[2]
            self._next = None
            if isinstance(prepared, Exception):
                raise prepared
            assert prepared is not None
            return self._decide(prepared, started)
        except GatewayError as exc:
            return [self._reject(exc)]
        except Exception:
            log.exception("request %s: internal error in ext_proc", self.request_id)
            return [self._reject(_Internal("The gateway failed to process the request."))]

    def _pair(
        self, pair: Handoff, prepared: _Prepared, body: bytes, started: float, decided: float
    ) -> list[pb.ProcessingResponse]:
        """A disaggregated request (:mod:`extproc.disagg.pairing`) with ``body`` (the client's, as every
        engine gets it: the priority rewrite done): its prefill half for the shell to send
        (:attr:`handoff`). vLLM's protocol: the replies wait for it (:meth:`handed_off`), Envoy's message
        timeout extended past its bound meanwhile; SGLang's: they go at once, the prefill beside them."""
        assert self._disagg is not None
        request_id = self.request_id if "x-request-id" in self._headers else None
        path = self._headers.get(":path", "/")
        try:
            pairing = Pairing(self._disagg, pair, body, path, request_id, self.request_id)
        except HandoffFailed as exc:  # validated before routing: cannot happen, never worth an error
            self.handoff_outcome = exc.reason
            return self._replies(prepared.request.stream, body, started, decided)
        self._pairing, self.handoff = pairing, pairing.prefill
        if pairing.decode_now is not None:
            # SGLang: the halves run together, the prefill's end may come after the answer: recorded now
            self._disagg.prefilled(pair, decided)
            return self._replies(prepared.request.stream, pairing.decode_now, started, decided)
        self._pending = (prepared, started, decided)
        return self._extension(0.0, prepared, pair.timeout_s)

    def prefill_done(self, failure: str | None) -> None:
        """A prefill half sent beside the request (SGLang) ended: ``failure`` its reason, or ``None``."""
        if self._pairing is not None:
            self._pairing.beside_done(failure, now=self._clock())
            self.handoff_outcome = self._pairing.outcome

    def handed_off(self, answer: bytes | None, failure: str | None = None) -> list[pb.ProcessingResponse]:
        """The prefill half ended: ``answer`` the prefill engine's 2xx body, else ``failure`` (a reason:
        ``timeout``, ``unreachable``, ``status``). The decode endpoint gets the body that fetches the
        prompt's KV, or the client's (served aggregated) when the prefill gave nothing usable."""
        pending, self._pending, self.handoff = self._pending, None, None
        pairing = self._pairing
        assert pending is not None and pairing is not None, "handed_off() only after a handoff"
        prepared, started, decided = pending
        try:
            body = pairing.finish(answer, failure, now=self._clock())
            self.handoff_outcome = pairing.outcome
            # The TTFT deadline the decode engine is told is what is left now, after the prefill's wait.
            return self._replies(prepared.request.stream, body, started, decided, self._clock())
        except GatewayError as exc:
            return [self._reject(exc)]
        except Exception:
            log.exception("request %s: internal error in ext_proc", self.request_id)
            return [self._reject(_Internal("The gateway failed to process the request."))]

    def _answer(self, path: str) -> list[pb.ProcessingResponse]:
        """A request for a path the gateway answers itself (``/v1/models``, the probes), else 404."""
        base = path.split("?", 1)[0]
        if base == MODELS_PATH:
            return self._models()
        if _is_probe(base):
            return self._probe(base)
        raise unknown_path(path)

    def _probe(self, path: str) -> list[pb.ProcessingResponse]:
        """``/health`` (200, empty body) or ``/ready`` (200, empty body, while :func:`routable`; else 503
        with an OpenAI JSON error, not logged: a probe of a gateway still starting is no fault), for GET
        and HEAD; else 404."""
        if self._headers.get(":method", "GET") not in ("GET", "HEAD"):
            raise NotFound(f"Use GET for {path}.")
        if path in READY_PATHS and not routable(self._router):
            down = Unavailable("No endpoint is ready to serve any model.", code="no_ready_endpoint")
            return [_immediate(down.status, down.body(), f"kvgate_{down.error_type}")]
        return [_immediate(200, b"", "kvgate_probe")]

    def _models(self) -> list[pb.ProcessingResponse]:
        """``/v1/models``, whether or not the request came with a body: the list (of the models the caller's
        tenant may use) for GET and HEAD, else 404."""
        if self._headers.get(":method", "GET") not in ("GET", "HEAD"):
            raise NotFound("Use GET for /v1/models.")
        allowed = self.principal.tenant.allows if self.principal is not None else None
        body = self._router.models_body(allowed)
        if self._cascade is not None and self._cascade.policy.cascades:  # virtual models too
            virtual = self._cascade.listed(self._router.fleet.models())
            body = listed_with(body, [m for m in virtual if allowed is None or allowed(m)])
        return [_immediate(200, body, "kvgate_models")]

    def _on_response_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        served = _served_from_metadata(msg)
        response: dict[str, str] = {}
        for h in msg.response_headers.headers.headers:
            response[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
        upstream = response.get(UPSTREAM_HEADER)
        served = served or upstream
        if self.ticket is not None and self._gate is not None:
            self._track_usage(response, self._gate, self.ticket)
        set_headers = []
        forwarded = self.forward is not None and served == self.forward.ingress  # a peer's, not ours
        if self.decision is not None and served and not forwarded:
            self._router.served(self.decision, served, self._clock())
            if self._config.conformance:
                set_headers.append(_header(CONFORMANCE_SERVED, served))
        mutation = pb.HeaderMutation(set_headers=set_headers, remove_headers=[UPSTREAM_HEADER])
        return [
            pb.ProcessingResponse(
                response_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation))
            )
        ]

    def _response_end(self) -> None:
        """The response ended as this stream saw it: the request's completion, as the completion log
        reports it (a gateway other than the bundled Envoy has none), reported to the router once; the
        router counts a request once however many report it (the log's entry may come too)."""
        decision = self.decision
        if decision is not None and not self._ended:
            self._ended = True
            self._router.completed(decision.request_id, self._clock())

    def _track_usage(self, response: dict[str, str], gate: Gate, ticket: Ticket) -> None:
        """At the response headers: refund a failed request, or start reading the body's usage."""
        if not response.get(":status", "").startswith("2"):
            self._refund()
        elif gate.wants_usage(ticket) and response.get("content-encoding", "identity") == "identity":
            sse = response.get("content-type", "").startswith("text/event-stream")
            self._usage = UsageReader(sse=sse)

    def _refund(self) -> None:
        if self.ticket is not None and self._gate is not None:
            self._gate.cancel(self.ticket, self._clock())

    def _settle(self) -> None:
        ticket, gate = self.ticket, self._gate
        if ticket is None or gate is None or ticket.settled:
            return
        usage = self._usage.result() if self._usage is not None else None
        charged = gate.settle(ticket, usage, self._clock())
        log.debug(
            "request %s: tenant %s charged %d tokens (%d reserved, usage %s)",
            self.request_id,
            ticket.tenant.id,
            charged,
            ticket.reserved,
            "exact" if usage is not None and usage.exact else "estimated" if usage else "unknown",
        )

    def _reject(self, exc: GatewayError) -> pb.ProcessingResponse:
        self._phase = Phase.DONE
        if self.decision is not None and not self._replied:
            # Decided but answered here instead (an error after decide): no engine gets it and Envoy
            # logs no completion for a local reply, so close() releases what decide took and records
            # nothing in the index, as for a request routed from the queue as its client left.
            self._answered_here = True
        tenant = f" tenant {self.principal.tenant.id}" if self.principal is not None else ""
        if exc.status >= 500:
            log.warning("request %s: %d %s", self.request_id, exc.status, exc.code or exc.error_type)
        else:
            reason = exc.code or exc.error_type
            log.info("request %s:%s rejected %d %s", self.request_id, tenant, exc.status, reason)
        extra = []
        if isinstance(exc, TooManyRequests) and exc.retry_after_s is not None:
            extra.append(_header("retry-after", str(exc.retry_after_s)))
        if self._came.federated and exc.status in (401, 403, 429):  # the forwarding cluster serves it
            extra.append(_header(REFUSED_HEADER, exc.code or exc.error_type))
        return _immediate(exc.status, exc.body(), f"kvgate_{exc.error_type}", extra)


def _duration(seconds: float) -> Duration:
    return Duration(seconds=int(seconds), nanos=int((seconds % 1) * 1e9))


class _Internal(GatewayError):
    status = 500
    error_type = "server_error"


def _header(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(
        header=HeaderValue(key=key, raw_value=value.encode()),
        append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _mutate(
    mutation: pb.HeaderMutation, set_headers: Iterable[tuple[str, str]], remove_headers: Iterable[str]
) -> None:
    """Fill ``mutation`` in place (as :func:`_header` each, without copying sub-messages)."""
    added = mutation.set_headers
    for key, value in set_headers:
        option = added.add(append_action=_OVERWRITE)
        option.header.key = key
        option.header.raw_value = value.encode()
    mutation.remove_headers.extend(remove_headers)


_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _body_chunk(data: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    reply = pb.ProcessingResponse()
    streamed = reply.request_body.response.body_mutation.streamed_response
    streamed.body = data
    streamed.end_of_stream = end_of_stream
    return reply


def _response_chunks(data: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
    """A response body chunk sent back unchanged (FULL_DUPLEX_STREAMED), in chunks of at most
    :data:`MAX_CHUNK` bytes as the request body is, ``end_of_stream`` (as sent) on the last."""
    out = []
    for off in range(0, max(len(data), 1), MAX_CHUNK):
        reply = pb.ProcessingResponse()
        streamed = reply.response_body.response.body_mutation.streamed_response
        streamed.body = data[off : off + MAX_CHUNK]
        streamed.end_of_stream = end_of_stream and off + MAX_CHUNK >= len(data)
        out.append(reply)
    return out


def _immediate(
    status: int, body: bytes, details: str, extra: list[HeaderValueOption] | None = None
) -> pb.ProcessingResponse:
    """An answer from the gateway itself: ``body`` is JSON (typed as such), or empty (no content type)."""
    typed = [_header("content-type", "application/json")] if body else []
    headers = pb.HeaderMutation(set_headers=[*typed, *(extra or [])])
    marker = Struct()
    marker.update({REJECTED_NS: {REJECTED_KEY: True}})
    return pb.ProcessingResponse(
        dynamic_metadata=marker,
        immediate_response=pb.ImmediateResponse(
            status=HttpStatus(code=status),
            headers=headers,
            body=body,
            details=details,
        ),
    )


#: Seconds an overloaded gateway asks clients to wait (``Retry-After``).
OVERLOAD_RETRY_AFTER_S = 1


@functools.cache
def overloaded() -> pb.ProcessingResponse:
    """The answer to a request shed because the ext_proc's decisions are at their bound
    (:mod:`extproc.overload`): 503 ``gateway_overloaded`` with an OpenAI JSON body and ``Retry-After``.
    Built once, without reading any request (3 us a shed to send it, against 83 us to build it each
    time, measured); never mutate it."""
    error = Unavailable("The gateway is overloaded; retry shortly.", code="gateway_overloaded")
    retry = [_header("retry-after", str(OVERLOAD_RETRY_AFTER_S))]
    return _immediate(error.status, error.body(), "kvgate_overloaded", retry)


def _answer_reply(answered: Answered) -> pb.ProcessingResponse:
    """A cascade step's answer returned by the gateway itself: 200 with its body (JSON or an SSE stream),
    ``x-kvgate-cascade-step``, and the ``kvgate.answered`` marker so Envoy keeps the body and its type."""
    kind = "sse" if answered.content_type == SSE else "json"
    headers = pb.HeaderMutation(
        set_headers=[
            _header("content-type", answered.content_type),
            _header(CASCADE_STEP_HEADER, str(answered.step)),
        ]
    )
    marker = Struct()
    marker.update({REJECTED_NS: {ANSWERED_KEY: kind}})
    return pb.ProcessingResponse(
        dynamic_metadata=marker,
        immediate_response=pb.ImmediateResponse(
            status=HttpStatus(code=200), headers=headers, body=answered.body, details="kvgate_cascade"
        ),
    )


def serving(router: Router, model: str) -> list[EndpointState]:
    """The fleet's endpoints serving ``model`` that its route admits (health not checked; prefill-only
    endpoints are not among them: the router never sends a request there, :mod:`extproc.disagg`)."""
    route = router.policy.routes.get(model)
    return [
        s
        for s in router.fleet
        if model in s.endpoint.models
        and (route is None or route.admits(s))
        and s.endpoint.role != PREFILL_ROLE
    ]


def flow_room(
    policy: FlowPolicy, router: Router, model: str, now: float, priority: int | None = None
) -> Room:
    """``model``'s room under ``policy`` for a request of band ``priority``
    (:func:`extproc.flow.control.room`; ``None``: the full limits), skipped (``OPEN``) when the policy can
    never hold a request."""
    if not policy.holds:
        return Room.OPEN
    return room(policy, model, serving(router, model), now, priority)


def _positive_ms(headers: dict[str, str], name: str) -> float | None:
    """A header's milliseconds (a positive finite number), ``None`` when absent; else 400."""
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise BadRequest(
            f"Header {name} must be a positive number of milliseconds.", code="invalid_header", param=name
        )
    return value


def _is_probe(path: str) -> bool:
    base = path.split("?", 1)[0]
    return base in HEALTH_PATHS or base in READY_PATHS


def routable(router: Router) -> bool:
    """Whether some endpoint can be picked for some model it serves: healthy, not draining, and admitted
    by that model's route (its labels), as the ``healthy`` filter and :meth:`Router.decide` see it (a
    prefill-only endpoint serves no request by itself)."""
    routes = router.policy.routes
    for state in router.fleet:
        if state.healthy and not state.draining and state.endpoint.role != PREFILL_ROLE:
            for model in state.endpoint.models:
                route = routes.get(model)
                if route is None or route.admits(state):
                    return True
    return False


def _subset_hint(msg: pb.ProcessingRequest) -> frozenset[str] | None:
    """The EPP subset hint's ``ip:port`` addresses; ``None`` when the key is absent (every endpoint may be
    picked). The protocol sends a list of strings; a comma-separated string, and list items that hold
    several comma-separated addresses, are read the same way (blanks trimmed, empty items dropped), so a
    data plane that joins them never widens the pick. A present but empty hint, or one of another type,
    is the empty set: nothing is eligible (503)."""
    ns = msg.metadata_context.filter_metadata
    if SUBSET_NS not in ns:
        return None
    value = ns[SUBSET_NS].fields.get(SUBSET_KEY)
    if value is None:
        return None
    if value.HasField("list_value"):
        items = [v.string_value for v in value.list_value.values]
    elif value.HasField("string_value"):
        items = [value.string_value]
    else:
        return frozenset()
    return frozenset(p.strip() for item in items for p in item.split(",") if p.strip())


def _jwt_metadata(msg: pb.ProcessingRequest) -> tuple[dict[str, object] | None, str | None]:
    """(verified JWT claims, failure reason) from Envoy's jwt_authn dynamic metadata.

    Only Envoy writes dynamic metadata, and jwt_authn writes the payload only after verifying the
    token's signature, issuer, audience and lifetime: these claims are never client-controlled. The
    namespace is read only in the shape jwt_authn gives it (an object under ``jwt_payload``, or under
    ``jwt_status`` for a failed token, never both, nothing else): any other is refused with 401
    ``invalid_identity`` (a misconfigured or foreign writer; not counted against the client's address).
    """
    ns = msg.metadata_context.filter_metadata
    if JWT_NS not in ns:
        return None, None
    fields = ns[JWT_NS].fields
    payload, status = fields.get(JWT_PAYLOAD), fields.get(JWT_STATUS)
    if (
        set(fields) - {JWT_PAYLOAD, JWT_STATUS}
        or (payload is not None and status is not None)
        or not all(v is None or v.HasField("struct_value") for v in (payload, status))
    ):
        raise Unauthorized("The identity metadata is not a verified token's.", code="invalid_identity")
    if payload is not None:
        return json_format.MessageToDict(payload.struct_value), None
    if status is not None:
        message = status.struct_value.fields.get("message")
        return None, message.string_value if message is not None else None
    return None, None


def _attribute(msg: pb.ProcessingRequest, name: str) -> str | None:
    """A string request attribute Envoy sent with the headers (``None``: none, or empty)."""
    attributes = msg.attributes.get(EXTPROC_ATTRIBUTES)
    value = attributes.fields.get(name) if attributes is not None else None
    return (value.string_value or None) if value is not None else None


def _client_address(msg: pb.ProcessingRequest) -> str | None:
    """The client's address as Envoy saw it (its ``source.address`` request attribute, without the port),
    or ``None`` when Envoy sent none."""
    attributes = msg.attributes.get(EXTPROC_ATTRIBUTES)
    value = attributes.fields.get(SOURCE_ADDRESS) if attributes is not None else None
    text: str = value.string_value if value is not None else ""
    if not text:
        return None
    host, sep, port = text.rpartition(":")
    return host.strip("[]") if sep and port.isdigit() else text


def _served_from_metadata(msg: pb.ProcessingRequest) -> str | None:
    ns = msg.metadata_context.filter_metadata
    if LB_NS not in ns:
        return None
    value = ns[LB_NS].fields.get(SERVED)
    return value.string_value or None if value is not None else None
