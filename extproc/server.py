"""The ext_proc gRPC shell: serves :class:`~extproc.processor.StreamProcessor` over grpc.aio.

``kvgate extproc --config FILE`` runs it: the ext_proc service, gRPC health (``liveness``,
``readiness`` and the ext_proc service name, which answers as ``readiness`` does) on its own port,
Prometheus metrics, and the metrics scraper feeding the fleet; the metrics port also serves the
read-only status (``/status``, ``/status.json``: :mod:`extproc.status`). The ext_proc port also serves,
for Envoy, the engine cluster's endpoints (EDS, :mod:`extproc.xds.eds`), the failed-try receiver (gRPC
access logs, :mod:`extproc.xds.als`: a failed try ejects its endpoint for a while) and the same gRPC
health (Envoy health-checks its ext_procs there, service ``liveness``). With ``[extproc] tls_*`` set,
the ext_proc port is mTLS only (certificates re-read when their files change, :mod:`runtime.tls`);
health and metrics stay plaintext. ``[feeds]`` TLS files also serve the slot restorer's ``https``
requests to agents (:mod:`extproc.control.restore`). First SIGINT/SIGTERM drains (health NOT_SERVING,
EDS and access-log streams ended so Envoy moves them to another replica, in-flight streams get a grace
period), the second forces.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import random
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path

import grpc
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.cluster.v3 import cds_pb2_grpc
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contracts.errors import ConfigError
from contracts.etcd import BURST, FEDERATION
from contracts.tracing import Timeline
from extproc.admission.gate import Gate, build_gate
from extproc.admission.shared import SharedAdmission
from extproc.affinity.core import ResponseAffinity
from extproc.affinity.metrics import AffinityCollector
from extproc.affinity.persist import AffinityState, state_path
from extproc.burst.core import Burster
from extproc.burst.metrics import BurstCollector
from extproc.burst.records import BurstSink, BurstTable
from extproc.cascade.metrics import PrerouteCollector
from extproc.cascade.persist import PrerouteState
from extproc.cascade.persist import state_path as preroute_path
from extproc.cascade.plan import Cascader
from extproc.collector import Collector
from extproc.config import GatewayConfig, default_max_body_bytes, load_config
from extproc.control.cluster import Cluster
from extproc.control.policy import Policy, cascade_policy, gateway_policy, pd_policy, routing_policy
from extproc.control.restore import SlotRestorer
from extproc.control.restore import plan as restore_plan
from extproc.control.scrape import Scraper
from extproc.control.siblings import SiblingBus
from extproc.disagg.plan import Disaggregator
from extproc.drift.counters import CounterDrift
from extproc.drift.monitor import DriftMonitor, DriftView, Key
from extproc.federation.forwarding import Forwarder
from extproc.federation.shell import FederationCollector, FederationShell
from extproc.fleet import Fleet
from extproc.flow.control import FlowControl, Room
from extproc.flow.dispatch import Dispatcher
from extproc.flow.policy import FlowPolicy
from extproc.index.approximate import ApproximateIndex
from extproc.index.hybrid import HybridIndex
from extproc.index.precise import PreciseIndex
from extproc.index.working_set import WorkingSet
from extproc.metrics import FEED_COUNTERS, GatewayMetrics
from extproc.models.registry import ModelRegistry
from extproc.models.tokenizer import CacheLimits
from extproc.overload.gate import DecisionGate, LagMeter
from extproc.processor import ProcessorConfig, StreamProcessor, flow_room, overloaded, routable
from extproc.routing.request import Kind
from extproc.routing.router import Decision, Router
from extproc.status.http import StatusServer
from extproc.status.peers import StatusPeers
from extproc.status.snapshot import Status, snapshot
from extproc.upstream.client import UpstreamClient
from extproc.upstream.errors import UpstreamError
from extproc.xds.als import Completion, FailedTries
from extproc.xds.cds import ClusterDiscovery
from extproc.xds.eds import EndpointDiscovery
from extproc.xds.ejection import Ejection, Ejector
from runtime.identity import PeerCheck
from runtime.lifecycle import announce_ready, stop_on_signals
from runtime.listen import ListenError, add_grpc_port, binding
from runtime.tls import (
    ClientTls,
    ClientTlsFiles,
    ReloadingServerCerts,
    ServerTlsFiles,
    client_tls,
)
from runtime.tracing.tracer import TRACE_HEADERS, Span, SpanKind, Tracer
from runtime.tracing.tracer import build as build_tracer

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
#: The gRPC health services that say whether requests can be routed (the Endpoint Picker Protocol: the
#: ext_proc service name answers as ``readiness`` does); ``""`` and ``liveness`` say the process is up.
READY_SERVICES = ("readiness", EXT_PROC_SERVICE)
GRPC_MESSAGE_SLACK = 64 * 1024 * 1024
#: The longest Envoy message timeout a held request asks for: the bundled filter's
#: ``max_message_timeout`` (kvgate/envoy/bootstrap.py ``EnvoyParams.max_message_timeout_s``).
HOLD_TIMEOUT_S = 600.0
#: How long a Prometheus scrape waits for the event loop to expire the drift windows (s); past it the
#: scrape shows the views published last.
DRIFT_REFRESH_WAIT_S = 1.0


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """One StreamProcessor per Envoy stream; times decisions for the metrics. With a ``restorer``, a
    routed request waits for the slot restore its decision calls for (:mod:`extproc.control.restore`) before
    Envoy gets the answer."""

    def __init__(
        self,
        router: Router,
        config: ProcessorConfig,
        metrics: GatewayMetrics,
        gate: Gate | None = None,
        restorer: SlotRestorer | None = None,
        dispatcher: Dispatcher[StreamProcessor, list[pb.ProcessingResponse]] | None = None,
        disagg: Disaggregator | None = None,
        upstream: UpstreamClient | None = None,
        overload: DecisionGate | None = None,
        on_decision: Callable[[Decision], None] | None = None,
        cascade: Cascader | None = None,
        tracer: Tracer | None = None,
        federation: Forwarder | None = None,
        after_request: Callable[[], object] | None = None,
    ) -> None:
        self._router = router
        #: Run once a stream's deferred bookkeeping is done (:meth:`Collector.after_request`).
        self._after_request = after_request
        self._overload = overload
        self._on_decision = on_decision
        #: ``None``: tracing off, and no span object is made (:mod:`runtime.tracing`).
        self._tracer = tracer
        self._federation = federation
        self._disagg = disagg
        self._cascade = cascade
        self._upstream = upstream
        #: Prefill halves running beside their routed requests (SGLang), kept until they end.
        self._beside: set[asyncio.Task[None]] = set()
        self._config = config
        self._metrics = metrics
        self._routed = metrics.requests.labels("routed")  # bound once: labels() is a locked dict lookup
        self._gate = gate
        self._restorer = restorer
        self._dispatcher = dispatcher

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        dispatcher = self._dispatcher
        flow = dispatcher.control if dispatcher is not None else None
        proc = StreamProcessor(
            self._router,
            self._config,
            time.monotonic,
            self._gate,
            flow,
            self._disagg,
            self._cascade,
            self._federation,
        )
        settling: asyncio.Future[None] | None = None  # the rest of the window, settled in a worker thread
        gate = self._overload
        counted = gate is not None  # this stream counts as a decision in flight (extproc/overload)
        if gate is not None:
            gate.enter()
        tracer = self._tracer
        span: Span | None = None  # the request's span when traced (and sampled)
        unseen = tracer is not None  # the first message decides whether the request is traced
        status = 0  # an immediate response's HTTP status
        delivered = False  # the decided request's routing replies were yielded to Envoy
        try:
            async for msg in request_iterator:
                if unseen and tracer is not None:
                    unseen = False
                    span = _request_span(tracer, msg, context, proc)
                if counted and msg.HasField("request_headers"):
                    assert gate is not None
                    if msg.request_headers.end_of_stream:  # bodyless (a probe): no decision to make
                        counted = False
                        gate.release()
                    elif not gate.admit():  # the fast path: shed before buffering or parsing anything
                        counted = False
                        gate.release()
                        status = 503
                        self._metrics.requests.labels("503").inc()
                        yield overloaded()
                        return
                started = time.perf_counter()
                decided_before = proc.decision is not None
                if proc.preparable(msg):  # a large body: parse, render, tokenize off the event loop
                    if gate is not None:
                        gate.enqueue()
                    try:
                        await asyncio.to_thread(proc.prepare, msg)
                    finally:
                        if gate is not None:
                            gate.dequeue()
                responses = proc.handle(msg)
                if counted and not proc.receiving:  # decided, held, or answered: the CPU work is done
                    counted = False
                    assert gate is not None
                    gate.release()
                if proc.refused is not None:
                    self._metrics.flow_sheds.labels(proc.refused).inc()
                    proc.refused = None
                if dispatcher is not None and proc.evicted:
                    dispatcher.evict(proc.evicted)
                    proc.evicted = ()
                if dispatcher is not None and proc.held is not None:
                    # Held by flow control: Envoy's message timeout is extended (responses), then the
                    # replies come when the dispatcher routes or sheds the request.
                    future = dispatcher.wait(proc.held)
                    for resp in responses:
                        yield resp
                    responses = await future
                    proc.undelivered = False
                    if proc.refused is not None:  # shed when dispatched (a deadline predicted missed)
                        self._metrics.flow_sheds.labels(proc.refused).inc()
                        proc.refused = None
                    started = time.perf_counter()  # the decision's time, not the wait
                while proc.cascade_step is not None:  # a cascade's gated step first (extproc/cascade)
                    for resp in responses:
                        yield resp
                    waited = time.perf_counter()
                    responses = await self._step(proc)
                    started += time.perf_counter() - waited
                if proc.handoff is not None and not proc.handoff.wait:  # SGLang: beside the request
                    self._send_beside(proc, span)
                if proc.handoff is not None:  # disaggregated: the prefill half first (extproc/disagg)
                    for resp in responses:
                        yield resp
                    waited = time.perf_counter()
                    responses = await self._prefill(proc, span)
                    started += time.perf_counter() - waited
                if proc.decision is not None and not decided_before:
                    if self._on_decision is not None:
                        self._on_decision(proc.decision)
                    run = proc.run
                    if run is not None and run.preskipped:  # a cascade's last step, no gated step before
                        self._metrics.cascade_preroutes.labels(run.virtual).inc()
                        self._metrics.cascade_answers.labels(run.virtual, str(run.number), run.model).inc()
                    if proc.pd is not None:
                        self._metrics.pd_decisions.labels(proc.pd.mode, proc.pd.reason).inc()
                    self._metrics.decision_seconds.observe(time.perf_counter() - started)
                    self._routed.inc()
                    blocks = proc.decision.prompt_blocks
                    if blocks:
                        self._metrics.prefix_hit_ratio.observe(proc.decision.matched_blocks / blocks)
                    if self._restorer is not None:
                        if span is not None:
                            await self._traced_restore(span, proc.decision)
                        else:
                            await self._restorer.before_routing(proc.decision)
                refused_pd = proc.pd_refused
                if refused_pd is not None:  # a verdict whose request was refused (no_prefill, SGLang)
                    self._metrics.pd_decisions.labels(refused_pd.mode, refused_pd.reason).inc()
                    proc.pd_refused = None
                for resp in responses:
                    if resp.HasField("immediate_response"):
                        status = resp.immediate_response.status.code
                        self._metrics.requests.labels(str(status)).inc()
                    elif proc.decision is not None:
                        delivered = True  # the routing replies go to Envoy: its completion log ends it
                    yield resp
                decision = proc.decision
                if decision is not None and decision.rest is not None and proc.settles_off_loop():
                    # The answer is out; the rest of the window is hashed for the index record (and the
                    # piece it ends in tokenized for the next turn): off the event loop when much is left
                    # (ProcessorConfig.offload_rest_chars). The prompt is the thread's until it is done:
                    # a cancelled stream closes only then (finally).
                    settling = asyncio.ensure_future(asyncio.to_thread(decision.rest.settle))
                    await asyncio.shield(settling)
                    settling = None
                proc.after_send()
                if self._after_request is not None:
                    self._after_request()
        finally:
            if counted and gate is not None:
                gate.release()
            if proc.decision is not None and not delivered:
                # Decided but never handed to Envoy (cancelled while a restore, a prefill half or a step
                # was awaited, or answered here): no completion log will come, so close() releases what
                # decide took and records nothing.
                proc.undelivered = True
            if dispatcher is not None and proc.held is not None:
                dispatcher.cancel(proc.held)  # the client went away while held: never routed
            if settling is not None and not settling.done():
                # Cancelled while a worker thread settles the rest: close (which commits the decision,
                # finishing that same prompt) once the thread is done, never beside it.
                settling.add_done_callback(partial(self._closed, proc, span, status))
            else:
                self._close(proc, span, status)

    def _closed(
        self, proc: StreamProcessor, span: Span | None, status: int, settled: asyncio.Future[None]
    ) -> None:
        """:meth:`_close` once a cancelled stream's settling thread is done (its error, if any, is the
        commit's to meet again)."""
        if not settled.cancelled():
            settled.exception()  # retrieved: nobody awaits it any more
        self._close(proc, span, status)

    def _close(self, proc: StreamProcessor, span: Span | None, status: int) -> None:
        """The end of a stream: the fallback count, the processor closed (its decision committed and
        finished), flow control kicked, the span ended."""
        if proc.decision is not None and proc.decision.served is not proc.decision.endpoints[0]:
            self._metrics.fallbacks.inc()
        proc.close()
        if self._dispatcher is not None and proc.decision is not None:
            self._dispatcher.kick()  # a stream's end frees its in-flight slot
        tracer = self._tracer
        if span is not None and tracer is not None:
            _end_request_span(tracer, span, proc, status)

    async def _traced_restore(self, span: Span, decision: Decision) -> None:
        """The slot restore of a traced request, in a ``slot_restore`` span (when one is asked for) whose
        ``traceparent`` goes to the agent."""
        restorer, tracer = self._restorer, self._tracer
        assert restorer is not None and tracer is not None
        if restore_plan(decision, restorer.config) is None:
            return
        child = tracer.start("slot_restore", parent=span, kind=SpanKind.CLIENT)
        outcome = await restorer.before_routing(decision, Tracer.headers(child))
        child.set_attribute("kvgate.restore.outcome", outcome or "none")
        child.end()

    def _handoff_span(self, proc: StreamProcessor, span: Span | None) -> Span | None:
        """A traced request's ``handoff.prefill`` span, its ``traceparent`` added to the sub-request."""
        if span is None or self._tracer is None or proc.handoff is None:
            return None
        child = self._tracer.start("handoff.prefill", parent=span, kind=SpanKind.CLIENT)
        child.set_attribute("kvgate.handoff.address", proc.handoff.address)
        sub = proc.handoff
        proc.handoff = dataclasses.replace(sub, headers={**sub.headers, **Tracer.headers(child)})
        return child

    def _send_beside(self, proc: StreamProcessor, span: Span | None = None) -> None:
        """Send a prefill half that runs beside its request (:attr:`SubRequest.wait` false) in a task of its
        own: the request's stream may end first."""
        child = self._handoff_span(proc, span)
        sub, proc.handoff = proc.handoff, None
        assert sub is not None and self._upstream is not None, "a handoff needs the upstream client"
        upstream = self._upstream
        model = _model_of(proc)

        async def send() -> None:
            started = time.monotonic()
            failure: str | None = "cancelled"
            try:
                await upstream.send(sub)
                failure = None
            except UpstreamError as exc:
                failure = exc.reason
            finally:
                if child is not None:
                    _end_handoff(child, failure)
                proc.prefill_done(failure)
                seconds = time.monotonic() - started
                self._metrics.pd_prefill_seconds.labels(model, failure or "ok").observe(seconds)
                if failure is not None:
                    self._metrics.pd_prefill_errors.labels(model, failure).inc()

        task = asyncio.create_task(send(), name="kvgate-prefill")
        self._beside.add(task)
        task.add_done_callback(self._beside.discard)

    async def _step(self, proc: StreamProcessor) -> list[pb.ProcessingResponse]:
        """Send a cascade's gated step (:attr:`StreamProcessor.cascade_step`), hand its answer back to the
        processor (:meth:`~StreamProcessor.judged`; a body that goes on to another step is prepared for it
        in a worker thread when large, as the first step's was, then :meth:`~StreamProcessor.restep`), and
        count the outcome."""
        sub, run = proc.cascade_step, proc.run
        assert sub is not None and run is not None and self._upstream is not None
        try:
            if sub.stream:  # a first_k gate: read as it comes, cut short when the first tokens fail it
                await self._upstream.post_stream(
                    sub.address,
                    sub.path,
                    sub.body,
                    proc.step_line,
                    timeout_s=sub.timeout_s,
                    headers=sub.headers,
                )
                body = None
            else:
                body = (await self._upstream.send(sub)).body
        except UpstreamError as exc:
            judged = proc.judged(None, exc.reason)
        else:
            judged = proc.judged(body)
        if judged is None:  # the body goes on to a step: its prompt rendered and tokenized first
            if proc.step_preparable():  # a large body: off the event loop, as the first step's was
                gate = self._overload
                if gate is not None:
                    gate.enqueue()
                try:
                    await asyncio.to_thread(proc.prepare_step)
                finally:
                    if gate is not None:
                        gate.dequeue()
            judged = proc.restep()
        responses = judged
        if self._dispatcher is not None:
            self._dispatcher.kick()  # the step's endpoint has a slot free again
        model, verdict = run.verdicts[-1]
        m = self._metrics
        if verdict.stat is not None:
            m.cascade_gate.labels(run.virtual).observe(verdict.stat)
        if proc.answered is not None:
            m.cascade_answers.labels(run.virtual, str(proc.answered.step), model).inc()
        elif run.replaying:  # passed on its first tokens: answered by this step again, through Envoy
            if proc.decision is not None:
                m.cascade_answers.labels(run.virtual, str(run.number), run.model).inc()
        else:
            m.cascade_escalations.labels(run.virtual, verdict.reason).inc()
            m.cascade_escalation_seconds.labels(run.virtual).observe(time.monotonic() - run.arrived)
            if not run.gated and proc.decision is not None:  # routed to the last step
                m.cascade_answers.labels(run.virtual, str(run.number), run.model).inc()
        return responses

    async def _prefill(self, proc: StreamProcessor, span: Span | None = None) -> list[pb.ProcessingResponse]:
        """Send a disaggregated request's prefill half (:attr:`StreamProcessor.handoff`) and hand the
        outcome back to the processor."""
        child = self._handoff_span(proc, span)
        sub = proc.handoff
        assert sub is not None and self._upstream is not None, "a handoff needs the upstream client"
        model = _model_of(proc)
        started = time.monotonic()
        failure: str | None = None
        try:
            answer = await self._upstream.send(sub)
        except UpstreamError as exc:
            failure = exc.reason
            responses = proc.handed_off(None, exc.reason)
        except asyncio.CancelledError:
            # The client went away (Envoy cancelled the stream) while the prefill ran: timed as
            # ``cancelled``, as an SGLang prefill half is; the stream's close frees the prefill slot.
            if child is not None:
                _end_handoff(child, "cancelled")
            seconds = time.monotonic() - started
            self._metrics.pd_prefill_seconds.labels(model, "cancelled").observe(seconds)
            raise
        else:
            responses = proc.handed_off(answer.body)
            if proc.handoff_outcome not in (None, "disaggregated"):  # a 2xx answer with no usable params
                failure = proc.handoff_outcome
        if child is not None:
            _end_handoff(child, failure)
        seconds = time.monotonic() - started
        self._metrics.pd_prefill_seconds.labels(model, failure or "ok").observe(seconds)
        if proc.handoff_outcome != "disaggregated":
            self._metrics.pd_fallbacks.labels(model, proc.handoff_outcome or "error").inc()
        return responses


def _request_span(
    tracer: Tracer, msg: pb.ProcessingRequest, context: grpc.aio.ServicerContext, proc: StreamProcessor
) -> Span | None:
    """The request's span (``extproc.request``), its parent the ``traceparent`` Envoy's tracer sent with
    the gRPC call, else the client's in the request headers, else none (a new trace); and a timeline for
    the processor's phases when it is sampled. Only the trace headers are read."""
    carrier = {k: v for k, v in context.invocation_metadata() or () if k in TRACE_HEADERS}
    if not carrier and msg.HasField("request_headers"):
        for h in msg.request_headers.headers.headers:
            key = h.key.lower()
            if key in TRACE_HEADERS:
                carrier[key] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    span = tracer.start("extproc.request", parent=tracer.extract(carrier), kind=SpanKind.SERVER)
    if not span.is_recording():
        return None  # not sampled: nothing more is recorded
    proc.timeline = Timeline(time.time_ns)
    return span


#: OpenTelemetry's GenAI ``gen_ai.operation.name`` of each request kind with a well-known value in the
#: semantic conventions' registry (``chat``, ``text_completion``, ``embeddings``); the others get none.
GEN_AI_OPERATIONS = {Kind.CHAT: "chat", Kind.COMPLETION: "text_completion", Kind.EMBEDDING: "embeddings"}


def _end_request_span(tracer: Tracer, span: Span, proc: StreamProcessor, status: int) -> None:
    """End a traced request's span: its phases as children, and what was decided (model, endpoint ids,
    block counts, statuses: never the prompt, its tokens or any header's value), with OpenTelemetry's
    GenAI attributes for the model, the operation and (counted exactly) the prompt's token count."""
    timeline = proc.timeline
    decision = proc.decision
    if decision is not None:
        span.set_attribute("gen_ai.request.model", decision.model)
        operation = GEN_AI_OPERATIONS.get(proc.kind) if proc.kind is not None else None
        if operation is not None:
            span.set_attribute("gen_ai.operation.name", operation)
        if decision.counted:  # an estimate is no usage
            span.set_attribute("gen_ai.usage.input_tokens", decision.prompt_tokens)
        span.set_attribute("kvgate.model", decision.model)
        span.set_attribute("kvgate.endpoint", str(decision.endpoints[0].id))
        span.set_attribute("kvgate.matched_blocks", decision.matched_blocks)
        span.set_attribute("kvgate.prompt_blocks", decision.prompt_blocks)
        span.set_attribute("kvgate.prompt_tokens", decision.prompt_tokens)
        if proc.pd is not None:
            span.set_attribute("kvgate.pd.mode", proc.pd.mode)
    span.set_attribute("kvgate.request_id", proc.request_id)
    if status:
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            Tracer.fail(span, "gateway error")
    if timeline is not None:
        tracer.emit(timeline, span)
    span.end()


def _end_handoff(span: Span, failure: str | None) -> None:
    span.set_attribute("kvgate.handoff.outcome", failure or "ok")
    if failure is not None:
        Tracer.fail(span, failure)
    span.end()


def _model_of(proc: StreamProcessor) -> str:
    """The model of a disaggregated request (a metric label)."""
    return proc.decision.model if proc.decision is not None else ""


class Gateway:
    """Wires config -> fleet, models, index, profile, router; owns the servers and the scraper.

    ``worker``: this process's name among the sibling workers of ``[extproc] siblings_dir`` (default:
    ``pid<PID>``; give a stable one so a restarted worker takes its predecessor's place at once)."""

    def __init__(self, config: GatewayConfig, worker: str | None = None) -> None:
        self.config = config
        #: Python's GC after answers (``[extproc] gc``); :func:`serve` starts it, process-wide.
        self.collector = Collector()
        self.fleet = Fleet(config.endpoints)
        limits = CacheLimits(config.tokenizer.segment_cache_entries, config.tokenizer.segment_cache_tokens)
        self.models = ModelRegistry.from_config(config.models, cache_limits=limits)
        #: The request body limit in force: ``[extproc] max_body_bytes``, else from the models' contexts.
        self.max_body_bytes = _max_body_bytes(config, self.models)
        max_fallbacks = config.extproc.max_fallbacks
        #: The policy in force (config defaults + [policy] file; etcd changes it live via the cluster).
        store = gateway_policy(config)
        approximate = ApproximateIndex(
            capacity_blocks_per_endpoint=config.index.capacity_blocks,
            ttl_s=config.index.ttl_s,
            max_match_blocks=config.index.max_match_blocks,
        )
        precise = PreciseIndex(
            speculative_ttl_s=config.index.speculative_ttl_s,
            max_match_blocks=config.index.max_match_blocks,
        )
        #: Precise where agents stream KV events (``index.mode = "precise"``); in approximate mode every
        #: endpoint stays in the approximate part and events are ignored.
        self.index = HybridIndex(precise, approximate, events=config.index.mode == "precise")
        self.router = Router(
            self.fleet,
            self.models,
            self.index,
            routing_policy(store.policy, max_fallbacks=max_fallbacks),
            max_blocks=config.index.max_match_blocks,
            chain_memo_entries=config.index.chain_memo_entries,
            rng=random.Random(),
            working_set=(
                WorkingSet(config.index.working_set_s, config.index.max_match_blocks)
                if config.index.working_set_s > 0
                else None
            ),
        )
        #: Prefill/decode pairs for models whose route disaggregates (:mod:`extproc.disagg`); the prefill
        #: sub-requests go through the one upstream client (engine-side TLS: the scraper's files).
        self.disagg = Disaggregator(
            self.router, pd_policy(store.policy, max_fallbacks=max_fallbacks), random.Random()
        )
        self.upstream = UpstreamClient(tls=_scrape_tls(config))
        #: Virtual models answered by a cascade of served models (:mod:`extproc.cascade`); their gated
        #: steps go through the same upstream client.
        self.cascade = Cascader(cascade_policy(store.policy))
        #: Its preroute learners' snapshot file, kept across restarts (``[cascade] state_dir``; ``None``:
        #: not kept).
        self.cascade_state = (
            PrerouteState(
                self.cascade,
                preroute_path(config.cascade.state_dir, worker or "extproc"),
                config.cascade.snapshot_interval_s,
                wait=config.etcd is not None,  # etcd's policy comes after the start
            )
            if config.cascade.state_dir is not None
            else None
        )
        #: Spans of traced requests (``[tracing]``); ``None``: tracing off.
        self.tracer = build_tracer(config.tracing)
        #: etcd control plane, agents' feeds and policy (:mod:`extproc.control.cluster`).
        self.cluster = Cluster(config, self.fleet, self.index, self.router, store)
        self.cluster.pd_listener = self._apply_pd
        self.metrics = GatewayMetrics(self.fleet)
        self.metrics.watch_index(self.index.occupancy)
        self.metrics.registry.register(PrerouteCollector(self.cascade, self.cascade_state))
        feed_stats = self.cluster.feeds.stats
        feed_stats.on_staleness = self.metrics.feed_staleness.observe
        self.metrics.watch_feeds(self._feed_counters)
        if self.cluster.pool_watcher is not None:
            self.metrics.watch_pool(self.cluster.pool_counters)
        self.router.predictor.listener = lambda seen: self.metrics.ttft_observed(
            seen.predicted_s, seen.observed_s
        )
        #: Flow control: requests held while their model's endpoints are saturated (:mod:`extproc.flow`),
        #: dispatched when capacity may have freed (a scrape round, a fleet change, a stream's end, a policy).
        self.flow: FlowControl[StreamProcessor] = FlowControl(store.policy.flow)
        self.dispatcher: Dispatcher[StreamProcessor, list[pb.ProcessingResponse]] = Dispatcher(
            self.flow, self._flow_space, time.monotonic, self.metrics
        )
        self.cluster.flow_listener = self._apply_flow
        #: Hosted endpoints overflow bursts to (:mod:`extproc.burst`), budgeted by the policy's flow/burst.
        self.burst = Burster(config.burst) if config.burst or config.burst_credentials else None
        #: etcd burst/<name> endpoints (naming the host's [burst_credentials]) and their clusters, served
        #: to Envoy over CDS (:mod:`extproc.xds.cds`).
        self.burst_table = table = BurstTable(config.burst, config.burst_credentials)
        if self.burst is not None:
            self.metrics.registry.register(
                BurstCollector(self.burst, lambda: self.flow.policy.burst_per_minute, lambda: table.refused)
            )
        self.cds = ClusterDiscovery()
        #: Responses API follow-ups to the endpoint holding their conversation (:mod:`extproc.affinity`),
        #: learned from Envoy's completion log.
        affinity = config.response_affinity
        self.affinity = ResponseAffinity(affinity) if affinity.enabled else None
        #: Its snapshot file, kept across restarts (``state_dir``; ``None``: not kept).
        self.affinity_state = (
            AffinityState(
                self.affinity,
                state_path(affinity.state_dir, worker or "extproc"),
                affinity.snapshot_interval_s,
                lambda: {e.id: e.address for e in self.fleet},
            )
            if self.affinity is not None and affinity.state_dir is not None
            else None
        )
        if self.affinity is not None:
            self.metrics.registry.register(AffinityCollector(self.affinity, self.affinity_state))
        if config.burst_credentials and self.cluster.control is not None:
            self.cluster.control.core.follow(BURST, BurstSink(self.burst_table, self._burst_changed))
        self.fleet.watch(self.dispatcher.kick)
        self.fleet.on_reading = self.dispatcher.kick
        #: Authentication and tenant admission (``None``: no ``[auth]`` section, the gateway is open).
        self.gate = build_gate(config.auth, config.tenants)
        shared = None
        if self.gate is not None:  # etcd tenants/<id>, and token budgets shared with the other replicas
            shared = SharedAdmission(self.gate)
            self.cluster.share_admission(shared.tenants, shared.usage, self.gate.config.usage_sync_s)
        #: llama.cpp slot restores before routing (endpoints whose agent offers them), over mTLS with the
        #: ``[feeds]`` client certificate where agents serve their admin API over HTTPS.
        self.restorer = SlotRestorer(config.slot_restore, self.metrics, tls=_feeds_tls(config))
        #: Cross-cluster federation (``[federation]``; :mod:`extproc.federation`).
        self.federation = FederationShell(config.federation, self.router) if config.federation else None
        if self.federation is not None:
            self.metrics.registry.register(FederationCollector(self.federation))
            if self.cluster.control is not None:
                self.cluster.control.core.follow(FEDERATION, self.federation.sink)
        self.health = _HealthServicer()
        #: The drift alarm: predicted vs engine-reused cached prompt tokens per model and endpoint, fed
        #: by the completion log (:mod:`extproc.drift`).
        published: dict[Key, DriftView] = {}
        self.drift = DriftMonitor(config.drift, published)
        #: The same from engines' prefix-cache counters, for answers without a count (streams).
        self.counter_drift = CounterDrift(config.drift, published)
        self.metrics.watch_drift(published, self._refresh_drift)
        self._drift_known = {str(s.id) for s in self.fleet}
        self.fleet.watch(self._forget_drift)
        #: The ext_proc's own saturation: decisions in flight (bounded: beyond, 503 at the headers) and
        #: the event loop's lag (:mod:`extproc.overload`).
        self.decisions = DecisionGate(config.overload.max_decisions)
        self.loop_lag = LagMeter(config.overload.lag_window_s)
        self.metrics.watch_overload(self.decisions, self.loop_lag)
        self._lag_task: asyncio.Task[None] | None = None
        #: Envoy's engine cluster (EDS) and the failed tries Envoy reports, which eject endpoints.
        self.eds = EndpointDiscovery(self.fleet, time.monotonic)
        self.ejector = Ejector(config.ejection.base_s, config.ejection.max_s)
        self.failed_tries = FailedTries(
            self.fleet, self.ejector, time.monotonic, self._on_ejection, on_completion=self._on_completion
        )
        if self.federation is not None:
            fed = self.federation
            self.failed_tries.on_failed_try = lambda failed: fed.failed_try(failed.address, failed.kind)
            fed.on_ingresses = self.eds.set_peers  # peers' ingresses are hosts of Envoy's engine cluster
        #: In-flight counts and decisions shared with the other workers of this host (``None``: no
        #: ``[extproc] siblings_dir``).
        self.siblings = (
            SiblingBus(
                Path(config.extproc.siblings_dir),
                worker or f"pid{os.getpid()}",
                self.router,
                flow=self.dispatcher,  # strict priority across the workers: each one's queued tops
                # token budgets across the workers (with etcd, usage/ carries them to every replica)
                usage=shared.usage if shared is not None and self.cluster.usage is None else None,
                prefill=self.disagg,  # P/D's least-work prefill pick sees the siblings' queued prefills
                cascade=self.cascade,  # the preroute learners learn from every worker's gate verdicts
            )
            if config.extproc.siblings_dir
            else None
        )
        self._servers: list[grpc.aio.Server] = []
        self._scraper: Scraper | None = None
        self._status_server: StatusServer | None = None
        #: The event loop the gateway runs on (set by :meth:`start`): the drift windows are its objects.
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Set by :meth:`aclose`: health stays NOT_SERVING whatever a last scrape round finds.
        self._draining = False
        self.ports: dict[str, int] = {}
        #: The ext_proc port's certificate fetcher when TLS is configured (``reloads`` counts rotations).
        self.server_certs: ReloadingServerCerts | None = None

    def _feed_counters(self) -> dict[str, int]:
        """The feed clients' counters; ``version_skew`` also counts etcd endpoint records of a version
        this gateway does not read as written (:mod:`contracts.versions`); ``endpoint_claims_refused``:
        the control plane's etcd endpoint records refused for an id another node holds."""
        stats = self.cluster.feeds.stats
        counters = {name: getattr(stats, name) for name in FEED_COUNTERS}
        if self.cluster.control is not None:
            counters["version_skew"] += self.cluster.control.core.counters["version_skew"]
            counters["version_skew_sources"] = len(self.cluster.control.core.skewed)
            counters["endpoint_claims_refused"] = self.cluster.control.core.counters["claims_refused"]
        return counters

    async def start(self) -> None:
        cfg = self.config
        ex = cfg.extproc  # TLS files are read first: a bad one fails the start before anything listens
        if ex.tls_cert and ex.tls_key and ex.tls_client_ca:
            self.server_certs = ReloadingServerCerts(
                ServerTlsFiles(Path(ex.tls_cert), Path(ex.tls_key), Path(ex.tls_client_ca))
            )
        scrape_tls = _scrape_tls(cfg)
        proc_cfg = ProcessorConfig(
            max_body_bytes=self.max_body_bytes,
            conformance=cfg.extproc.conformance,
            offload_rest_chars=cfg.extproc.offload_rest_chars,
            timeouts=cfg.timeout_table(),
            hold_timeout_s=HOLD_TIMEOUT_S,
            burst=self.burst,
            affinity=self.affinity,
        )
        # Envoy forwards body data in chunks as large as what it has buffered (up to its connection buffer
        # limit), so one message may exceed max_body_bytes; the processor enforces the body limit itself.
        message_limit = self.max_body_bytes + GRPC_MESSAGE_SLACK
        options = [
            ("grpc.max_receive_message_length", message_limit),
            ("grpc.max_send_message_length", message_limit),
        ]
        # With TLS, only the allowed identities (Envoy's) may call: a certificate of another role chains
        # to the same CA, and a caller here could forge jwt_authn metadata or failed tries.
        peers = [PeerCheck(frozenset(ex.tls_allowed_peers), "the ext_proc")] if self.server_certs else []
        server = grpc.aio.server(options=options, interceptors=peers)
        pb_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessor(
                self.router,
                proc_cfg,
                self.metrics,
                self.gate,
                self.restorer,
                self.dispatcher,
                self.disagg,
                self.upstream,
                self.decisions,
                self._on_decision,
                self.cascade,
                self.tracer,
                self.federation.forwarder if self.federation is not None else None,
                self.collector.after_request,
            ),
            server,
        )
        eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(self.eds, server)
        cds_pb2_grpc.add_ClusterDiscoveryServiceServicer_to_server(self.cds, server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(self.failed_tries, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if self.server_certs is not None:
            self.ports["extproc"] = add_grpc_port(server, cfg.extproc.listen, self.server_certs.credentials())
        else:
            self.ports["extproc"] = add_grpc_port(server, cfg.extproc.listen)
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, health_server)
        self.ports["health"] = add_grpc_port(health_server, cfg.extproc.health_listen)
        self._servers = [server, health_server]
        for name in READY_SERVICES:  # known from the first probe on; SERVING from the first scrape round
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.affinity_state is not None:  # the last run's table, before the first request
            await self.affinity_state.load()
            self.affinity_state.start()
        if self.cascade_state is not None:  # the last run's preroute learners, before the first request
            await self.cascade_state.load()
            self.cascade_state.start()
        if self.siblings is not None:
            self.siblings.start()
        self.eds.start()
        for s in self._servers:
            await s.start()
        for name in ("", "liveness"):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._loop = asyncio.get_running_loop()
        self._lag_task = asyncio.create_task(self._measure_lag(), name="kvgate-loop-lag")
        if cfg.extproc.metrics_listen:  # Prometheus, and the read-only status page (extproc/status)
            siblings = self.siblings
            status_peers = None if siblings is None else StatusPeers(siblings.directory, siblings.name)
            self._status_server = StatusServer(
                self.metrics.registry, self.status, asyncio.get_running_loop(), peers=status_peers
            )  # with siblings: the page combines the host's workers (extproc/status/peers.py)
            with binding(cfg.extproc.metrics_listen):
                self.ports["metrics"] = self._status_server.start(cfg.extproc.metrics_listen)
        await self.cluster.start()
        if self.federation is not None:
            await self.federation.start()
            self.ports["federation"] = self.federation.service.port
        self._scraper = Scraper(
            self.fleet,
            interval_s=cfg.scrape.interval_s,
            timeout_s=cfg.scrape.timeout_s,
            stale_after_s=cfg.scrape.stale_after_s,
            unhealthy_after=cfg.scrape.unhealthy_after,
            clock=time.monotonic,
            on_round=self._on_scrape_round,
            tls=scrape_tls,
        )
        await self._scraper.scrape_once()
        self._scraper.start()
        log.info(
            "ext_proc listening on %s (health %s), %d endpoints, %d models with tokenizers, bodies up to %d"
            " bytes",
            self.ports["extproc"],
            self.ports["health"],
            len(self.fleet),
            len(self.models),
            self.max_body_bytes,
        )

    def status(self) -> Status:
        """What ``GET /status.json`` shows (:func:`extproc.status.snapshot.snapshot`); on the event loop."""
        now = time.monotonic()
        return snapshot(
            self.fleet,
            self.index,
            self.flow,
            self.cluster.store,
            self.cluster.feeds.views(now),
            now,
            time.time(),
            [*self.drift.views(now), *self.counter_drift.views(now)],
        )

    async def _measure_lag(self) -> None:
        """The loop-lag timer: every ``lag_interval_s``, how late it woke (:class:`LagMeter`)."""
        loop = asyncio.get_running_loop()
        interval = self.config.overload.lag_interval_s
        while True:
            due = loop.time() + interval
            await asyncio.sleep(interval)
            self.metrics.loop_lag.observe(self.loop_lag.record(due, loop.time()))

    def _on_completion(self, done: Completion) -> None:
        """Envoy's completion log: an engine finished a request (this worker's or another's), so its
        load fell and a held request may go; a 2xx answer with the engine's cached-token count, served by
        the pick itself (not a fallback, whose cache the prediction was not about), feeds the drift
        alarm."""
        now = time.monotonic()
        self.router.completed(done.request_id, now)
        if self.federation is not None:
            self.federation.completed(done.address, done.status, done.ttfb_s, streamed=done.streamed)
        self.dispatcher.kick()
        if (
            self.affinity is not None
            and done.responses_scope is not None
            and done.response_id is not None
            and 200 <= done.status < 300
            and (producer := self.fleet.by_address(done.address)) is not None
        ):  # the endpoint that produced this Responses API answer (it holds the conversation)
            self.affinity.learn(done.responses_scope, done.response_id, producer.id, now)
        if (
            done.cached_tokens is not None
            and done.predicted_tokens is not None
            and done.model is not None
            and done.endpoint is not None
            and 200 <= done.status < 300
            and (served := self.fleet.by_address(done.address)) is not None
            and served.id == done.endpoint
        ):
            predicted, cached = done.predicted_tokens, done.cached_tokens
            _log_drift(self.drift.observe(done.model, done.endpoint, predicted, cached, now))

    def _refresh_drift(self) -> None:
        """Expire both drift alarms' windows (a scrape): an alarm clears at its window's end even when its
        endpoint gets no more traffic. A scrape runs on the metrics server's thread, and the windows are
        the event loop's (changed there by every completion and reading): the expiry runs on the loop,
        waited for at most :data:`DRIFT_REFRESH_WAIT_S` (then the scrape shows the views published last)."""
        loop = self._loop
        try:
            on_loop = loop is None or asyncio.get_running_loop() is loop
        except RuntimeError:  # no loop running in this thread: the metrics server's
            on_loop = False
        if on_loop:
            self._expire_drift()
            return
        assert loop is not None
        done = threading.Event()

        def run() -> None:
            try:
                self._expire_drift()
            finally:
                done.set()

        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError:  # the loop is closed: nothing changes the windows any more
            return
        done.wait(DRIFT_REFRESH_WAIT_S)

    def _expire_drift(self) -> None:
        now = time.monotonic()
        self.drift.views(now)
        self.counter_drift.views(now)

    def _forget_drift(self) -> None:
        """The fleet changed: drop the drift windows (and their published series) of endpoints that
        left, so a removed endpoint's tripped alarm does not fire on, and their ejection counters."""
        current = {str(s.id) for s in self.fleet}
        for gone in self._drift_known - current:
            self.drift.forget(gone)
            self.counter_drift.forget(gone)
        self._drift_known = current
        self.metrics.keep_endpoints(current)

    def _on_decision(self, decision: Decision) -> None:
        """A routed request, for the counter-based drift alarm (:mod:`extproc.drift.counters`)."""
        predicted = decision.matched_blocks * self.router.policy.block_size
        pick = decision.endpoints[0]
        self.counter_drift.routed(
            pick.id, decision.model, predicted, decision.prompt_tokens, time.monotonic()
        )

    def _flow_space(self, model: str, priority: int, now: float) -> Room:
        return flow_room(self.flow.policy, self.router, model, now, priority)

    def _apply_pd(self, policy: Policy) -> None:
        self.disagg.apply(pd_policy(policy, max_fallbacks=self.config.extproc.max_fallbacks))
        self.cascade.apply(cascade_policy(policy))

    def _burst_changed(self) -> None:
        assert self.burst is not None
        self.burst.endpoints = self.burst_table.endpoints
        try:
            self.cds.set(self.burst_table.dynamic())
        except Exception:  # a cluster the protos cannot hold: Envoy keeps the last ones, the watch goes on
            log.exception("CDS: the burst clusters could not be built")

    def _apply_flow(self, policy: FlowPolicy) -> None:
        self.flow.apply(policy)
        if self.burst is not None:  # the pause before a changed budget counts at the old rate
            self.burst.rerate(policy.burst_per_minute, time.monotonic())
        self.dispatcher.kick()  # limits may have risen

    def _on_scrape_round(self) -> None:
        self.dispatcher.kick()
        now = time.monotonic()
        for state in self.fleet:  # engines' prefix-cache counters (scraped or in an agent's Load) vs routed
            m = state.metrics
            if m is not None and m.prefix_hits is not None and m.prefix_queries is not None:
                _log_drift(self.counter_drift.reading(state.id, m.prefix_hits, m.prefix_queries, m.at, now))
        if self._draining:
            return
        # Ready as the HTTP ``/ready`` probe: some endpoint routable for some model (processor.routable).
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if routable(self.router)
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in READY_SERVICES:
            self.health.set(name, status)

    def _on_ejection(self, ejection: Ejection) -> None:
        self.metrics.ejected(ejection.endpoint, ejection.kind)

    async def aclose(self, grace_s: float = 5.0) -> None:
        """Drain: report NOT_SERVING (on both ports), end the EDS and access-log streams (Envoy reopens
        them to another replica), stop accepting streams, give in-flight ones ``grace_s`` seconds."""
        self._draining = True
        if self._lag_task is not None:
            self._lag_task.cancel()
        for name in HEALTH_SERVICES:
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.eds.aclose()
        await self.cds.aclose()
        await self.failed_tries.aclose()
        if self._scraper is not None:
            await self._scraper.aclose()
        await asyncio.gather(*(s.stop(grace_s) for s in self._servers))
        if self.affinity_state is not None:  # after the last completion-log entry: the table, a last time
            await self.affinity_state.aclose()
        if self.cascade_state is not None:  # after the last request's verdict: the learners, a last time
            await self.cascade_state.aclose()
        self.dispatcher.close()
        if self.siblings is not None:
            await self.siblings.aclose()
        await self.cluster.aclose()
        if self.federation is not None:
            await self.federation.aclose()
        await self.restorer.aclose()
        await self.upstream.aclose()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)
        if self._status_server is not None:
            await asyncio.to_thread(self._status_server.close)


def _log_drift(changed: DriftView | None) -> None:
    """A drift alarm that tripped (WARNING) or cleared (INFO); never request content."""
    if changed is None:
        return
    log.log(
        logging.WARNING if changed.tripped else logging.INFO,
        "drift alarm %s: model %s at endpoint %s (%s): engine reused %.0f%% of the predicted cached prompt "
        "tokens over %d requests (error %.2f)",
        "TRIPPED" if changed.tripped else "cleared",
        changed.model,
        changed.endpoint,
        changed.source,
        100 * (changed.ratio or 0.0),
        changed.samples,
        changed.error or 0.0,
    )


def _max_body_bytes(cfg: GatewayConfig, models: ModelRegistry) -> int:
    """``[extproc] max_body_bytes`` when set, else :func:`~extproc.config.default_max_body_bytes` over
    the configured models and the models the configured endpoints serve (one without a tokenizer, or
    whose context length or token bounds are unknown, keeps the default)."""
    if cfg.extproc.max_body_bytes is not None:
        return cfg.extproc.max_body_bytes
    names = set(models) | {m for e in cfg.endpoints for m in e.models}
    windows: list[tuple[int, int] | None] = []
    for name in sorted(names):
        assets = models.find(name)
        bounds = assets.tokenizer.bounds if assets is not None else None
        if assets is None or assets.max_model_len is None or bounds is None:
            windows.append(None)
        else:
            windows.append((assets.max_model_len, bounds.max_token_bytes))
    return default_max_body_bytes(windows)


def _scrape_tls(cfg: GatewayConfig) -> ClientTls | None:
    """The client TLS towards engines (``[scrape]`` TLS files; with all three, it follows rotation)."""
    sc = cfg.scrape
    if not (sc.tls_ca or sc.tls_cert):
        return None
    files = ClientTlsFiles(
        ca=Path(sc.tls_ca) if sc.tls_ca else None,
        cert=Path(sc.tls_cert) if sc.tls_cert else None,
        key=Path(sc.tls_key) if sc.tls_key else None,
    )
    return client_tls(files, where="scrape")


def _feeds_tls(cfg: GatewayConfig) -> ClientTls | None:
    """The client TLS towards agents' admin APIs (``[feeds]`` TLS files, following rotation; ``None``
    without them)."""
    fd = cfg.feeds
    if not (fd.tls_ca and fd.tls_cert and fd.tls_key):
        return None
    files = ClientTlsFiles(ca=Path(fd.tls_ca), cert=Path(fd.tls_cert), key=Path(fd.tls_key))
    return client_tls(files, where="feeds")


class _HealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """gRPC health with per-service status (liveness, readiness, the ext_proc service)."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {}

    def set(self, service: str, status: int) -> None:
        self._status[service] = status

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        return health_pb2.HealthCheckResponse(status=status)


async def serve(config: GatewayConfig, ready_file: Path | None = None, worker: str | None = None) -> int:
    gateway = Gateway(config, worker)
    try:
        await gateway.start()
    except ListenError:  # nothing stays half-started: the listeners bound so far close, as on a stop
        await gateway.aclose(grace_s=0)
        raise
    if config.extproc.gc == "deferred":  # process-wide: only here, not for a Gateway embedded in tests
        gateway.collector.start()
    announce_ready(ready_file, {**gateway.ports, "pid": os.getpid()})
    stop = asyncio.Event()
    stop_on_signals(stop)
    await stop.wait()
    log.info("draining")
    await gateway.aclose()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvgate extproc", description="Run the kvgate ext_proc endpoint picker."
    )
    parser.add_argument("--config", type=Path, required=True, help="gateway config (.toml or .json)")
    parser.add_argument("--ready-file", type=Path, help="write the bound ports here (JSON) once serving")
    parser.add_argument(
        "--worker",
        metavar="NAME",
        help="this worker's name among the siblings of [extproc] siblings_dir (default: pid<PID>)",
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"kvgate extproc: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        return uvloop.run(serve(config, args.ready_file, args.worker))
    except ConfigError as exc:  # unusable TLS files, found when the servers start
        print(f"kvgate extproc: {exc}", file=sys.stderr)
        return 2
    except ListenError as exc:  # a listen address taken, not this host's, or privileged
        print(f"kvgate extproc: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
