"""Decision latency of the routing core, in-process (no gRPC, no Envoy).

One timed iteration is what the ext_proc does once a request body is complete: ``parse_body`` on the raw
bytes, then :meth:`Router.decide` (render the chat template, tokenize with the segment cache, chained
digests, index lookup, filters + scorers + picker, speculative record). The router is wired by
:class:`extproc.server.Gateway` from a :class:`GatewayConfig`, exactly as ``kvgate extproc`` does.

Cells: chats of about 1k / 4k / 16k tokens (real SmolLM2 tokenizer and template) x fleets of 4 / 16 / 64
endpoints x two turns:

* ``first``: a conversation never seen, every message unique, so no tokenizer segment is cached and no
  block of it is in the index;
* ``follow_up``: an earlier conversation (already routed once: its segments cached, its blocks recorded)
  plus a new assistant reply and a new user message, unique per iteration.

Each fleet has engine metrics set on every endpoint and an index pre-filled with other prefixes. After each
decision ``Router.finish`` releases the in-flight slot so load state does not drift. One cell is also run
stage by stage (parse, render, tokenize, digest, lookup, schedule, record) for a breakdown.

    python -m load.bench.decision --out results/decision.json [--quick] [--tracing on|alternate]
        [--gc python|deferred|alternate]

``--gc`` (default ``python``: CPython's collector as it is) ``deferred`` runs the ext_proc's
:class:`extproc.collector.Collector` as ``kvgate extproc`` does (started once the fleets are built, a
collection when due after each decision's deferred record); ``alternate`` runs each cell twice, the
collector off then on, for a before/after under the same machine noise. Each cell reports the
collections that began inside its timed decisions (``gc_in_decisions``: count and pause p50/max).

``--tracing on`` traces every decision as the ext_proc traces a sampled request (its span, the phases'
timeline and their spans, batched to an in-memory exporter); off (the default) is the untraced path;
``alternate`` traces every other decision of each cell, so both halves run under the same machine noise.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import orjson
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from contracts.digest import Digest
from contracts.tracing import Timeline, TracingSettings
from engines.metrics import EngineMetrics
from extproc.collector import Collector
from extproc.config import parse_config
from extproc.models.registry import ModelAssets
from extproc.routing.request import Kind, ParsedRequest, parse_body
from extproc.routing.router import LazyPrompt
from extproc.scheduling.interface import CycleState, SchedulingRequest
from extproc.scheduling.profile import Profile
from extproc.server import Gateway
from load.bench import (
    CpuSample,
    add_model_dir_argument,
    add_quiet_arguments,
    machine,
    percentile,
    quietest,
    revision,
    smollm2_dir,
    summary,
    write_json,
)
from runtime.tracing.tracer import SpanKind, Tracer

MODEL = "SmolLM2-135M-Instruct"
SIZES = (1024, 4096, 16384)
FLEETS = (4, 16, 64)
TURNS = ("first", "follow_up")
BASES_PER_CELL = 8
"""Distinct earlier conversations a follow-up cell rotates through."""
EXACT_COUNTS = 30
"""Timed decisions per cell whose prompt is also tokenized whole, untimed: the sizes reported (the router
itself estimates a prompt's length when it stops tokenizing at the first block nobody holds)."""
FOLLOW_UP_WORDS = 325
"""Mean words :meth:`ChatFactory.follow_up` adds; a follow-up cell's earlier turns are that much shorter."""

OTHER_CHAINS_PER_ENDPOINT = 40
OTHER_CHAIN_BLOCKS = 64
SHARED_CHAINS = 64
"""Index pre-fill: per endpoint 40 chains of 64 random blocks, plus 64 chains held by 2-8 endpoints."""

GOAL_FOLLOW_UP_P99_US = 500.0
GOAL_SCHEDULE_US = 100.0

_WORD_TEXT = """
the a of to and in is that for it as with was on be by this are from at or an have not which but
they you we can more one all their has there been if would will what when so no out up about into
than them only other its some time could these two may then do first any my now such like our over
man me even most made after also did many before must through back years where much your way well down
should because each just those people how too little state good very make world still own see men work
long get here between both life being under never day same another know while last might us great old
year off come since against go came right used take three model cache token request latency replica
gateway engine prefix block index scheduler decode prefill batch memory kernel tensor attention layer
weights router envoy cluster endpoint metric queue budget config deploy rollout fleet region shard
"""
_WORDS = tuple(_WORD_TEXT.split())
_CODE = (
    "def handler(request, context):",
    "    body = json.loads(request.body)",
    "    for i, item in enumerate(body['items']):",
    "        total += item.price * item.quantity",
    "    return Response(status=200, content=total)",
    "SELECT id, name, created_at FROM users WHERE active = 1 ORDER BY created_at DESC LIMIT 50;",
    "kubectl rollout status deployment/vllm-llama-8b -n inference --timeout=300s",
    "export CUDA_VISIBLE_DEVICES=0,1,2,3",
)


class ChatFactory:
    """Multi-turn chats of random English-like text (words, numbers, code), unique per call."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._serial = 0

    def _sentence(self) -> str:
        rng = self._rng
        words = rng.choices(_WORDS, k=rng.randint(6, 18))
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(2, 99_999)))
        return " ".join(words).capitalize() + rng.choice((".", ".", ".", "?", "!", ":"))

    def text(self, n_words: int) -> str:
        """About ``n_words`` words of prose, sometimes with a code block; starts with a unique tag."""
        self._serial += 1
        rng = self._rng
        parts = [f"[{self._serial}-{rng.getrandbits(40):x}]"]
        count = 0
        while count < n_words:
            if rng.random() < 0.06:
                lines = rng.choices(_CODE, k=rng.randint(2, 6))
                parts.append("\n```\n" + "\n".join(lines) + "\n```\n")
                count += 8 * len(lines)
            else:
                sentence = self._sentence()
                parts.append(sentence)
                count += sentence.count(" ") + 1
        return " ".join(parts)

    def conversation(self, target_words: int) -> list[dict[str, str]]:
        """System prompt, then user/assistant turns, ending with a user turn, of ~``target_words`` words."""
        rng = self._rng
        system = rng.randint(40, 120)
        messages = [{"role": "system", "content": self.text(system)}]
        words = system
        while True:  # the last turns are cut to land near the target
            user = min(rng.randint(20, 150), max(10, target_words - words))
            messages.append({"role": "user", "content": self.text(user)})
            words += user
            if words >= target_words:
                return messages
            reply = min(rng.randint(80, 400), max(10, target_words - words - 20))
            messages.append({"role": "assistant", "content": self.text(reply)})
            words += reply

    def follow_up(self) -> list[dict[str, str]]:
        """The next turn of any conversation: the engine's reply, then a new user message."""
        rng = self._rng
        return [
            {"role": "assistant", "content": self.text(rng.randint(80, 400))},
            {"role": "user", "content": self.text(rng.randint(20, 150))},
        ]


def body(messages: Sequence[Mapping[str, str]]) -> bytes:
    """An OpenAI chat request as a client sends it."""
    return orjson.dumps(
        {"model": MODEL, "messages": messages, "max_tokens": 256, "temperature": 0.7, "stream": True}
    )


def build_gateway(n_endpoints: int, model_dir: Path, rng: random.Random, now: float) -> Gateway:
    """The gateway's router over ``n_endpoints`` endpoints with metrics and a pre-filled index."""
    config = parse_config(
        {
            "extproc": {"metrics_listen": ""},
            # A 131,072-token window (SmolLM2's is 8192): the 16,384-token cells time tokenizing and
            # routing, not the context-length refusal.
            "models": [{"name": MODEL, "model_dir": str(model_dir), "max_model_len": 131072}],
            "endpoints": [
                {
                    "id": f"e{i}",
                    "address": f"10.0.{i // 200}.{i % 200 + 1}:8000",
                    "models": [MODEL],
                    "engine": "vllm",
                }
                for i in range(n_endpoints)
            ],
        }
    )
    gateway = Gateway(config)
    ids = [s.id for s in gateway.fleet]
    for endpoint_id in ids:
        metrics = EngineMetrics(
            waiting=float(rng.randint(0, 6)),
            running=float(rng.randint(0, 32)),
            kv_usage=rng.uniform(0.1, 0.9),
            at=now,
        )
        gateway.fleet.record_scrape(endpoint_id, metrics)
    index = gateway.index

    def chain() -> list[Digest]:
        return [Digest(rng.randbytes(16)) for _ in range(OTHER_CHAIN_BLOCKS)]

    for endpoint_id in ids:
        for _ in range(OTHER_CHAINS_PER_ENDPOINT):
            index.record(endpoint_id, chain(), now)
    for _ in range(SHARED_CHAINS):
        digests = chain()
        for endpoint_id in rng.sample(ids, min(len(ids), rng.randint(2, 8))):
            index.record(endpoint_id, digests, now)
    return gateway


def words_per_token(gateway: Gateway, factory: ChatFactory) -> float:
    """Calibrate the text generator: words per prompt token on a sample conversation."""
    sample = factory.conversation(3000)
    n_words = sum(m["content"].count(" ") + 1 for m in sample)
    tokens = gateway.router.tokens(parse_body(Kind.CHAT, body(sample)), exact_count=True).count
    return n_words / tokens


#: ``--tracing on``: every decision traced (sampled), as the ext_proc traces a request; ``None``: off.
TRACER: Tracer | None = None
#: ``--tracing alternate``: odd decisions traced, even ones not (both under the same machine noise).
ALTERNATE = False
#: What a timed decision is measured with: wall time, or (``--clock cpu``) the thread's CPU time, which
#: leaves out the time other tenants of a shared machine hold the CPU (not work done by other threads).
TIMER: Callable[[], int] = time.perf_counter_ns
#: ``--interleave-baseline``: the whole encodes run between timed decisions (:func:`run_cell`).
INTERLEAVE = False
#: ``--evict-mb N``: N MiB written after every decision, so each starts with cold caches (:func:`run_cell`).
EVICT_MB = 0
#: ``--gc deferred``: the ext_proc's collector, started; run after each decision's deferred record.
COLLECTOR: Collector | None = None
#: Pauses (ns) of collections that began inside a timed decision, per generation (:func:`_gc_watch`).
_IN_DECISION = False
_GC_PAUSES: list[tuple[int, int]] = []
_gc_started = 0


def _gc_watch(phase: str, info: dict[str, Any]) -> None:
    """``gc.callbacks`` hook: records the pause of each collection that starts inside a timed decision."""
    global _gc_started
    if phase == "start":
        _gc_started = time.perf_counter_ns() if _IN_DECISION else 0
    elif _gc_started:
        _GC_PAUSES.append((int(info["generation"]), time.perf_counter_ns() - _gc_started))
        _gc_started = 0


def _decide(
    gateway: Gateway, raw: bytes, serial: int, clock: Callable[[], float], traced: bool = True
) -> int:
    """One timed decision (parse + decide); returns its nanoseconds. With :data:`TRACER` (and
    ``traced``), also what the ext_proc does for a traced request: its span, a timeline of the phases,
    their spans, ended."""
    global _IN_DECISION
    router = gateway.router
    tracer = TRACER if traced else None
    _IN_DECISION = True
    started = TIMER()
    if tracer is None:
        decision = router.decide(parse_body(Kind.CHAT, raw), request_id=f"r{serial}", now=clock())
    else:
        span = tracer.start("extproc.request", kind=SpanKind.SERVER)
        timeline = Timeline(time.time_ns)
        request = parse_body(Kind.CHAT, raw)
        timeline.mark("parse")
        decision = router.decide(request, request_id=f"r{serial}", now=clock(), timeline=timeline)
        span.set_attribute("kvgate.model", decision.model)
        span.set_attribute("kvgate.endpoint", str(decision.endpoints[0].id))
        span.set_attribute("kvgate.matched_blocks", decision.matched_blocks)
        span.set_attribute("kvgate.prompt_blocks", decision.prompt_blocks)
        span.set_attribute("kvgate.prompt_tokens", decision.prompt_tokens)
        tracer.emit(timeline, span)
        span.end()
    elapsed = TIMER() - started
    _IN_DECISION = False
    router.commit(decision, clock())  # what the gRPC shell does after sending the reply
    router.finish(decision)
    if COLLECTOR is not None:
        COLLECTOR.after_request()  # as the shell does once the stream's bookkeeping is done
    return elapsed


def run_cell(
    gateway: Gateway,
    factory: ChatFactory,
    target_words: int,
    turn: str,
    iterations: int,
    warmup: int,
    clock: Callable[[], float],
    baseline_iterations: int = 0,
) -> dict[str, Any]:
    """Time ``warmup + iterations`` decisions of one cell; statistics over the last ``iterations``.

    With ``baseline_iterations``, the baseline on the first that many requests: the rendered prompt
    tokenized whole by ``tokenizers`` (:meth:`SegmentTokenizer.encode_whole`), the tokenization alone of
    a router without a segment cache; it and the exact lengths (:data:`EXACT_COUNTS`) run after the timed
    loop, untimed. With :data:`INTERLEAVE` they run inside it, each after its request's decision (the
    method before 2026-11-28): a whole encode of a long prompt evicts the decision's working set from the
    CPU caches, so the decision after it takes 2-3x as long, and those decisions (10 % of a follow-up cell
    at the first fleet) set its p90 and p99. With :data:`EVICT_MB`, that many MiB of memory are written
    after every decision (untimed), so every timed decision starts with cold caches.
    """
    if turn == "first":
        bodies = [body(factory.conversation(target_words)) for _ in range(warmup + iterations)]
    else:
        bases = [factory.conversation(target_words - FOLLOW_UP_WORDS) for _ in range(BASES_PER_CELL)]
        for i, base in enumerate(bases):  # the previous turn of each conversation: routed once
            _decide(gateway, body(base), -i - 1, clock)
        bodies = [body(bases[i % len(bases)] + factory.follow_up()) for i in range(warmup + iterations)]
    assets = gateway.models.find(MODEL)
    if assets is None:
        raise RuntimeError(f"model {MODEL} is not loaded")
    gc.collect()
    samples_us: list[float] = []
    traced_us: list[float] = []
    baseline_us: list[float] = []
    tokens: list[float] = []
    cpu = CpuSample.take()
    for i, raw in enumerate(bodies):
        traced = not ALTERNATE or i % 2 == 1
        if i == warmup:
            _GC_PAUSES.clear()
        elapsed = _decide(gateway, raw, i, clock, traced)
        if i < warmup:
            continue
        (traced_us if ALTERNATE and traced else samples_us).append(elapsed / 1e3)
        if INTERLEAVE and i - warmup < max(baseline_iterations, EXACT_COUNTS):
            _baseline(assets, raw, i - warmup < baseline_iterations, tokens, baseline_us)
        if EVICT_MB:
            _evict(EVICT_MB)
    if not INTERLEAVE:  # untimed, after the timed loop: the same machine a few seconds later
        for raw in bodies[warmup : warmup + max(baseline_iterations, EXACT_COUNTS)]:
            _baseline(assets, raw, len(baseline_us) < baseline_iterations, tokens, baseline_us)
    cell: dict[str, Any] = {
        "turn": turn,
        "prompt_tokens": summary(tokens, 0),
        "body_bytes_p50": round(percentile(sorted(len(b) for b in bodies), 50)),
        "latency_us": summary(samples_us),
        "other_cpu_cores": cpu.other_cores(CpuSample.take()),
        "gc": "deferred" if COLLECTOR is not None else "python",
        "gc_in_decisions": _gc_summary(),
    }
    if baseline_us:
        cell["baseline_encode_whole_us"] = summary(baseline_us)
    if traced_us:  # --tracing alternate: latency_us holds the untraced half
        cell["latency_traced_us"] = summary(traced_us)
    return cell


def _set_gc(mode: str) -> None:
    """``python``: CPython's collector; ``deferred``: :data:`COLLECTOR` started (collect, freeze, backstop
    threshold), as ``kvgate extproc`` starts it once its gateway is built."""
    global COLLECTOR
    if mode == "deferred" and COLLECTOR is None:
        COLLECTOR = Collector()
        COLLECTOR.start()
    elif mode == "python" and COLLECTOR is not None:
        COLLECTOR.stop()
        COLLECTOR = None


def _gc_summary() -> dict[str, Any]:
    """Collections that began inside the cell's timed decisions: count and pause (us) per generation."""
    out: dict[str, Any] = {}
    for generation in (0, 1, 2):
        pauses = sorted(ns / 1e3 for g, ns in _GC_PAUSES if g == generation)
        if pauses:
            out[f"gen{generation}"] = {
                "n": len(pauses),
                "pause_p50_us": round(percentile(pauses, 50), 1),
                "pause_max_us": round(pauses[-1], 1),
            }
    return out


def _baseline(
    assets: ModelAssets, raw: bytes, timed: bool, tokens: list[float], baseline_us: list[float]
) -> None:
    """The request's exact length in tokens into ``tokens`` (the router estimates when it stops
    tokenizing early) and, when ``timed``, its whole encode's microseconds into ``baseline_us``."""
    us, n_tokens = _encode_whole_us(assets, raw)
    tokens.append(n_tokens)
    if timed:
        baseline_us.append(us)


def _evict(mib: int) -> None:
    """Write ``mib`` MiB of fresh memory, a byte per page: the CPU caches lose what the next decision
    would find in them (as after another request's work on the same core)."""
    buffer = bytearray(mib << 20)
    buffer[::4096] = b"\x01" * len(range(0, len(buffer), 4096))


def _encode_whole_us(assets: ModelAssets, raw: bytes) -> tuple[float, int]:
    """Microseconds to tokenize the request's rendered prompt whole (rendering not timed), and its
    exact length in tokens."""
    request = parse_body(Kind.CHAT, raw)
    text = assets.template.render(request.messages, add_generation_prompt=True)
    started = time.perf_counter_ns()
    n_tokens = len(assets.tokenizer.encode_whole(text, add_special_tokens=False))
    return (time.perf_counter_ns() - started) / 1e3, n_tokens


STAGES = ("parse", "render", "tokenize", "digest", "lookup", "schedule", "record (deferred)")


def run_breakdown(
    gateway: Gateway,
    factory: ChatFactory,
    target_words: int,
    iterations: int,
    warmup: int,
    clock: Callable[[], float],
) -> dict[str, Any]:
    """A follow-up cell run stage by stage with the router's own parts, timed separately.

    Same work and side effects as :meth:`Router.decide` (in-flight +1, speculative record), split at
    the stage boundaries; ``schedule`` is :meth:`Profile.schedule` (filters + scorers + picker) alone,
    untimed as on the request path, and ``plugins_us`` the per-plugin timings of a second, ``timed`` run
    of the same cycle outside the stages.
    """
    router = gateway.router
    assets = gateway.models.find(MODEL)
    if assets is None:
        raise RuntimeError(f"model {MODEL} is not loaded")
    bases = [factory.conversation(target_words - FOLLOW_UP_WORDS) for _ in range(BASES_PER_CELL)]
    for i, base in enumerate(bases):
        _decide(gateway, body(base), -i - 1, clock)
    bodies = [body(bases[i % len(bases)] + factory.follow_up()) for i in range(warmup + iterations)]
    stages: dict[str, list[float]] = {name: [] for name in (*STAGES, "total")}
    plugins: dict[str, list[float]] = {}
    candidates_all = list(gateway.fleet)
    profile, block_size = router.policy.profile, router.policy.block_size
    timed = Profile(profile.name, profile.filters, profile.scorers, profile.picker, timed=True)
    gc.collect()
    cpu = CpuSample.take()
    for i, raw in enumerate(bodies):
        marks = [time.perf_counter_ns()]
        request: ParsedRequest = parse_body(Kind.CHAT, raw)
        marks.append(time.perf_counter_ns())
        text = assets.template.render(
            request.messages,
            tools=request.tools,
            add_generation_prompt=request.add_generation_prompt,
            extra=request.template_kwargs,
        )
        marks.append(time.perf_counter_ns())
        # As Router.tokens does without token budgets: resume at the previous turn's boundary, then
        # tokenize and hash block by block up to the first block nobody holds (the follow-up's new
        # reply), estimating the length from the bytes.
        lazy = LazyPrompt.open(
            assets.tokenizer,
            text,
            False,
            router.seed(request),
            block_size,
            router.max_blocks,
            router._chains,  # the router's own chain memo, as Router.tokens passes it
            router.index,
            estimated=round(len(text.encode()) * router.ratio(assets)),
            history=router.history,  # resumed at the previous turn's boundary, as Router.tokens does
        )
        lazy.extend(router.index.unheld)
        tokens = lazy.tokens()
        marks.append(time.perf_counter_ns())
        digests = router.digests(request, tokens)
        marks.append(time.perf_counter_ns())
        now = clock()
        state = CycleState(
            prefix_blocks=router.index.match(digests, now), cached_blocks=router.index.occupancy()
        )
        marks.append(time.perf_counter_ns())
        candidates = [s for s in candidates_all if request.model in s.endpoint.models]
        sched = SchedulingRequest(
            request_id=f"b{i}",
            model=request.model,
            digests=digests,
            prompt_tokens=tokens.count,
            now=now,
            prompt_blocks=router.scored_blocks(tokens, digests, state),
        )
        result = profile.schedule(sched, state, candidates, random.Random(i))
        marks.append(time.perf_counter_ns())
        primary = result.endpoints[0]
        primary.in_flight += 1
        lazy.finish()  # the deferred record hashes the rest of the window first (Router.commit)
        generation = router.index.generation
        router.index.record(primary.id, lazy.digests, now)
        held = min(len(lazy.digests), router.index.max_match_blocks)
        lazy.remember((generation, held) if router.index.generation == generation else None)
        marks.append(time.perf_counter_ns())
        primary.in_flight -= 1
        if i < warmup:
            continue
        plugin_ns = timed.schedule(sched, state, candidates, random.Random(i)).timings_ns
        for name, start, end in zip(STAGES, marks[:-1], marks[1:], strict=True):
            stages[name].append((end - start) / 1e3)
        # "total" is what the request waits for: the record is deferred until after the reply is sent.
        stages["total"].append((marks[-2] - marks[0]) / 1e3)
        for plugin, ns in plugin_ns.items():
            plugins.setdefault(plugin, []).append(ns / 1e3)
    return {
        "other_cpu_cores": cpu.other_cores(CpuSample.take()),
        "stages_us": {name: summary(values) for name, values in stages.items()},
        "plugins_us": {name: summary(values, 2) for name, values in plugins.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load.bench.decision", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument(
        "--quick", action="store_true", help="a tiny smoke run (seconds, figures meaningless)"
    )
    parser.add_argument("--iterations", type=int, default=1000, help="timed follow-up decisions per cell")
    parser.add_argument(
        "--first-iterations", type=int, default=300, help="timed first-turn decisions per cell"
    )
    parser.add_argument("--warmup", type=int, default=30, help="untimed decisions before each cell")
    parser.add_argument(
        "--baseline-iterations", type=int, default=100, help="timed whole-prompt encodes per size and turn"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--tracing",
        choices=["off", "on", "alternate"],
        default="off",
        help="on: trace every decision as the ext_proc does (spans batched to an in-memory exporter); "
        "alternate: every other decision traced, the two halves reported apart (latency_us untraced, "
        "latency_traced_us traced)",
    )
    parser.add_argument("--sizes", help="comma-separated prompt sizes in tokens (default 1024,4096,16384)")
    parser.add_argument("--fleets", help="comma-separated fleet sizes (default 4,16,64)")
    add_model_dir_argument(parser)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="time decisions by wall clock (default) or by the thread's CPU time (steadier on a shared "
        "machine; leaves out work of other threads, such as the span exporter's)",
    )
    parser.add_argument(
        "--gc",
        choices=["python", "deferred", "alternate"],
        default="python",
        help="python: CPython's collector as it is; deferred: the ext_proc's collector "
        "(extproc.collector); alternate: each cell twice, python then deferred",
    )
    parser.add_argument(
        "--interleave-baseline",
        action="store_true",
        help="run the untimed whole-prompt encodes between the timed decisions, each after its request's "
        "(the method of the records before 2026-11-28; it evicts the next decision's caches), instead of "
        "after the timed loop",
    )
    parser.add_argument(
        "--evict-mb",
        type=int,
        default=0,
        help="write this many MiB of memory after every decision (untimed): each decision starts with "
        "cold CPU caches (0: off)",
    )
    add_quiet_arguments(parser, "cell")
    args = parser.parse_args(argv)
    global TRACER, ALTERNATE, TIMER, INTERLEAVE, EVICT_MB
    INTERLEAVE, EVICT_MB = args.interleave_baseline, max(0, args.evict_mb)
    TIMER = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    exporter = None
    ALTERNATE = args.tracing == "alternate"
    if args.tracing != "off":
        exporter = InMemorySpanExporter()
        TRACER = Tracer(TracingSettings(True, 1.0, service_name="bench"), exporter=exporter)
    sizes: Sequence[int] = SIZES
    fleets: Sequence[int] = FLEETS
    breakdown_size = 4096
    if args.sizes:
        sizes = tuple(int(x) for x in args.sizes.split(","))
    if args.fleets:
        fleets = tuple(int(x) for x in args.fleets.split(","))
    if breakdown_size not in sizes:
        breakdown_size = sizes[0]
    if args.quick:
        sizes, fleets, breakdown_size = (1024,), (4,), 1024
        args.iterations, args.first_iterations, args.warmup, args.baseline_iterations = 20, 10, 3, 5
        args.max_attempts, args.quiet_wait_s = 1, 0.0
    info = machine()
    clock = time.monotonic
    rng = random.Random(args.seed)
    factory = ChatFactory(args.seed)
    model_dir = smollm2_dir(args.model_dir)
    started = time.monotonic()
    cpu = CpuSample.take()
    cells: list[dict[str, Any]] = []
    breakdowns: list[dict[str, Any]] = []
    ratio = 0.0
    gc_modes = ("python", "deferred") if args.gc == "alternate" else (args.gc,)
    gc.callbacks.append(_gc_watch)
    for n_endpoints in fleets:
        gateway = build_gateway(n_endpoints, model_dir, rng, clock())
        if not ratio:
            ratio = words_per_token(gateway, factory)
        for size in sizes:
            for turn in TURNS:
                for gc_mode in gc_modes:
                    iterations = args.iterations if turn == "follow_up" else args.first_iterations
                    baseline = args.baseline_iterations if n_endpoints == fleets[0] else 0
                    _set_gc(gc_mode)
                    cell = quietest(
                        partial(
                            run_cell,
                            gateway,
                            factory,
                            round(size * ratio),
                            turn,
                            iterations,
                            args.warmup,
                            clock,
                            baseline,
                        ),
                        args.quiet_threshold,
                        args.max_attempts,
                        args.quiet_wait_s,
                    )
                    cells.append({"target_tokens": size, "endpoints": n_endpoints, **cell})
                    lat = cell["latency_us"]
                    print(
                        f"{size:>6} tok {n_endpoints:>3} ep {turn:<9} gc {gc_mode:<8} "
                        f"tokens~{cell['prompt_tokens']['p50']:>6.0f} "
                        f"p50 {lat['p50']:>9.1f} p90 {lat['p90']:>9.1f} p99 {lat['p99']:>9.1f} us "
                        f"(other tenants {cell['other_cpu_cores']:.2f} cores)",
                        file=sys.stderr,
                    )
            if size == breakdown_size:
                parts = quietest(
                    partial(
                        run_breakdown,
                        gateway,
                        factory,
                        round(size * ratio),
                        args.iterations,
                        args.warmup,
                        clock,
                    ),
                    args.quiet_threshold,
                    args.max_attempts,
                    args.quiet_wait_s,
                )
                breakdowns.append(
                    {"target_tokens": size, "endpoints": n_endpoints, "turn": "follow_up", **parts}
                )
    goal_cell = next(
        (c for c in cells if (c["target_tokens"], c["endpoints"], c["turn"]) == (4096, 64, "follow_up")), None
    )
    goals: dict[str, Any] = {}
    if goal_cell is not None:
        p99 = goal_cell["latency_us"]["p99"]
        goals["follow_up_4k_64ep_p99_us"] = {
            "value": p99,
            "goal": GOAL_FOLLOW_UP_P99_US,
            "met": p99 < GOAL_FOLLOW_UP_P99_US,
        }
    if breakdowns:
        p99 = breakdowns[-1]["stages_us"]["schedule"]["p99"]
        goals[f"schedule_{breakdowns[-1]['endpoints']}ep_p99_us"] = {
            "value": p99,
            "goal": GOAL_SCHEDULE_US,
            "met": p99 < GOAL_SCHEDULE_US,
        }
    result = {
        "benchmark": "decision",
        "command": " ".join(["python -m load.bench.decision", *(argv if argv is not None else sys.argv[1:])]),
        "machine": info,
        "revision": revision(),
        "parameters": {
            "quick": args.quick,
            "iterations_follow_up": args.iterations,
            "iterations_first": args.first_iterations,
            "warmup": args.warmup,
            "iterations_baseline": args.baseline_iterations,
            "baseline": "interleaved" if INTERLEAVE else "after the timed loop",
            "evict_mib_between_decisions": EVICT_MB,
            "quiet_threshold_cores": args.quiet_threshold,
            "max_attempts": args.max_attempts,
            "seed": args.seed,
            "tracing": args.tracing,
            "clock": args.clock,
            "gc": args.gc,
            "model": MODEL,
            "words_per_token": round(ratio, 3),
            "index_prefill": {
                "chains_per_endpoint": OTHER_CHAINS_PER_ENDPOINT,
                "chain_blocks": OTHER_CHAIN_BLOCKS,
                "shared_chains": SHARED_CHAINS,
            },
        },
        "unit": "microseconds",
        "cells": cells,
        "breakdowns": breakdowns,
        "goals": goals,
        "other_cpu_cores": cpu.other_cores(CpuSample.take()),
        "wall_s": round(time.monotonic() - started, 1),
    }
    if TRACER is not None and exporter is not None:
        TRACER.shutdown()
        result["spans_exported"] = len(exporter.get_finished_spans())
        TRACER = None
    _set_gc("python")
    gc.callbacks.remove(_gc_watch)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
