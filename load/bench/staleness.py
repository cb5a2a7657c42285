"""Index staleness: how long after an engine caches a prompt does the gateway route on it.

``python -m load.bench.staleness [--out results/staleness.json] [--quick]`` starts a local etcd and node
agents (:mod:`agent.main`), each supervising one simulated vLLM replica that publishes KV events, and, in
this process, two :class:`extproc.server.Gateway` s following the same etcd: one with the ``precise`` index
(fed by the agents' event streams) and one with the ``approximate`` index (the baseline: it learns only
from its own routing decisions). Then, one sample at a time, it sends a fresh prompt *directly* to a
replica (the gateways never route it) and, polling every ~1 ms in the event loop, records:

- ``send_to_engine_event_ms``: request sent -> the engine's KV event batch for the prompt (its ``ts``,
  read by this process's own ZMQ subscriber on the engine's PUB socket): the engine's prefill step;
- ``engine_event_to_index_ms``: that batch's ``ts`` -> ``router.index.match`` on the precise gateway shows
  the prompt's full blocks on that endpoint: the whole event path (engine PUB -> agent SUB, translation
  -> agent feed -> gateway feed client -> index) plus the poll's resolution;
- ``send_to_index_ms``: request sent -> the same index condition (what a follow-up request would see);
- ``feed_hop_ms``: the precise gateway's :class:`~runtime.feed.client.FeedStats` ``staleness_s`` samples of
  the run (agent publish -> gateway apply, every batch: index events and loads);
- ``send_to_load_ms``: request sent -> the precise gateway's fleet shows the endpoint ``running >= 1``:
  the load path, a scrape every ``scrape_interval_s`` (the agent's telemetry and the gateway's own
  scraper both poll the engine's ``/metrics`` every 0.1 s), so its staleness is bounded by the interval
  plus one scrape;
- on the approximate gateway: whether its index ever shows the prompt (it must not: engine events have no
  routing effect there until the gateway itself routes the prompt).

Clocks: the engine's ``ts`` and this process's wall clock are the same machine's ``time.time()``.
Benchmarks are not tests: this measures, writes JSON and prints a table; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvloop
import zmq
import zmq.asyncio

from agent.kvevents import BlockStored, KvEventDecodeError, decode_message
from contracts.digest import Digest
from contracts.events import EndpointId
from extproc.config import parse_config
from extproc.routing.request import Kind, parse_body
from extproc.server import Gateway
from kvgate.dev.etcd import EtcdServer
from kvgate.dev.procs import Child
from load.bench import CpuSample, cpu_seconds, machine, revision, summary, write_json

log = logging.getLogger(__name__)

MODEL = "SmolLM2-135M-Instruct"
POLL_S = 0.001
#: The gateway's metrics scrape period (its default) and the agent's telemetry period (agent.main).
SCRAPE_INTERVAL_S = 0.1
_WORDS = ("cache", "block", "prefix", "route", "engine", "token", "replica", "gateway", "index", "feed")


@dataclass(frozen=True, slots=True)
class Options:
    """Run size: agents (one simulated replica each), measured samples, warm-up samples, prompt words,
    generated tokens per request (long enough for the load scrape to see it running), and the longest wait
    for one sample's signals (s)."""

    agents: int = 2
    samples: int = 200
    warmup: int = 10
    prompt_words: int = 160
    max_tokens: int = 64
    timeout_s: float = 2.0


@dataclass(frozen=True, slots=True)
class Replica:
    """One agent-supervised simulated replica: endpoint id, HTTP ``host:port``, KV events PUB address,
    process id."""

    id: EndpointId
    address: str
    kv_events: str
    pid: int


@dataclass(slots=True)
class Sample:
    """One prompt's timings, ms (``None``: not seen within the sample's timeout)."""

    endpoint: str
    blocks: int
    send_to_engine_event_ms: float | None = None
    engine_event_to_index_ms: float | None = None
    send_to_index_ms: float | None = None
    send_to_load_ms: float | None = None
    approximate_visible: bool = False


class Agents:
    """A local etcd plus one agent per simulated replica (KV events on), stopped by PID."""

    def __init__(self, workdir: Path, count: int) -> None:
        self.workdir, self.count = workdir, count
        self.etcd = EtcdServer(workdir / "etcd")
        self.children: list[Child] = []
        self.replicas: list[Replica] = []

    def start(self) -> Agents:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.etcd.start()
        ready_files = []
        for i in range(self.count):
            node = f"node-{i}"
            engine = {"id": f"sim-{i}", "kind": "sim", "model": MODEL, "model_path": "smollm2"}
            config = {
                "agent": {"id": node, "lease_ttl_s": 5, "state_dir": str(self.workdir / node)},
                "etcd": {"endpoints": [self.etcd.address]},
                "engines": [{**engine, "kv_events": True}],
            }
            path = self.workdir / f"{node}.json"
            path.write_text(json.dumps(config))
            ready = self.workdir / f"{node}.ready.json"
            argv = [sys.executable, "-m", "agent.main", "--config", str(path), "--ready-file", str(ready)]
            self.children.append(Child(node, argv, self.workdir / f"{node}.log"))
            ready_files.append(ready)
        for child, ready in zip(self.children, ready_files, strict=True):
            for e in child.wait_for_json_file(ready, 300)["engines"]:
                pid = e["pid"]
                self.replicas.append(Replica(EndpointId(e["id"]), e["address"], _kv_events_address(pid), pid))

    def cpu_s(self) -> float:
        """CPU seconds so far of the agents and their engines (children not reaped yet)."""
        pids = [c.pid for c in self.children] + [r.pid for r in self.replicas]
        return sum(cpu_seconds(pid) for pid in pids)

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
        self.etcd.stop()


def _kv_events_address(pid: int) -> str:
    """The engine's KV events PUB address, from its ``--kv-events-config`` (the agent picked the port)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    endpoint: str = json.loads(argv[argv.index("--kv-events-config") + 1])["endpoint"]
    return endpoint.replace("*", "127.0.0.1")


def gateway_config(etcd: str, mode: str) -> dict[str, Any]:
    """An in-process gateway following ``etcd`` with the ``mode`` index and no metrics listener."""
    return {
        "extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "metrics_listen": ""},
        "models": [{"name": MODEL, "gguf": "smollm2"}],
        "etcd": {"endpoints": [etcd]},
        "index": {"mode": mode},
        "scrape": {"interval_s": SCRAPE_INTERVAL_S},
    }


class EngineEvents:
    """This process's own subscriber to every replica's KV events: the engine-side ``ts`` of the batch
    that first stored each block, keyed by the block's tokens (a prompt is known by its last full block:
    its leading blocks, the chat template's default system prompt, are shared by every prompt)."""

    def __init__(self, replicas: list[Replica]) -> None:
        self._ctx = zmq.asyncio.Context()
        self._socks = []
        for r in replicas:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(r.kv_events)
            self._socks.append(sock)
        self.first_stored: dict[tuple[int, ...], float] = {}
        self._tasks = [asyncio.create_task(self._pump(s)) for s in self._socks]

    async def _pump(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                batch = decode_message(frames)
            except KvEventDecodeError:
                continue
            for event in batch.events:
                if isinstance(event, BlockStored):
                    ids, size = event.token_ids, event.block_size
                    for start in range(0, len(ids) - size + 1, size):
                        self.first_stored.setdefault(tuple(ids[start : start + size]), batch.ts)

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sock in self._socks:
            sock.close(linger=0)
        self._ctx.term()


async def _wait(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not {what} after {timeout_s:.0f} s")
        await asyncio.sleep(0.02)


def _attached(gateway: Gateway, replicas: list[Replica]) -> bool:
    ids = {s.id for s in gateway.fleet}
    clients = gateway.cluster.feeds.clients.values()
    connected = len(clients) == len(replicas) and all(c.connected for c in clients)
    return connected and {r.id for r in replicas} <= ids


async def run_samples(
    opts: Options, replicas: list[Replica], precise: Gateway, approximate: Gateway
) -> tuple[list[Sample], int]:
    """The samples (after the warm-up), and how many of their prompts the approximate gateway's index
    shows at the end of the run (0 expected: events have no effect there)."""
    rng = random.Random(7)
    events = EngineEvents(replicas)
    samples: list[Sample] = []
    chains: list[list[Digest]] = []
    async with httpx.AsyncClient(timeout=30) as http:
        try:
            for n in range(opts.warmup + opts.samples):
                replica = replicas[n % len(replicas)]
                words = " ".join(rng.choice(_WORDS) for _ in range(opts.prompt_words))
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"{n} {words}"}]}
                raw = json.dumps({**body, "max_tokens": opts.max_tokens}).encode()
                sample, digests = await one_sample(opts, http, events, replica, raw, precise, approximate)
                if n >= opts.warmup:
                    samples.append(sample)
                    chains.append(digests)
        finally:
            await events.aclose()
    now = time.monotonic()
    return samples, sum(bool(approximate.router.index.match(d, now)) for d in chains)


async def one_sample(
    opts: Options,
    http: httpx.AsyncClient,
    events: EngineEvents,
    replica: Replica,
    raw: bytes,
    precise: Gateway,
    approximate: Gateway,
) -> tuple[Sample, list[Digest]]:
    """Send the chat ``raw`` to ``replica`` directly once its load shows idle; poll both gateways and the
    engine events until the request finished and every signal was seen (or ``timeout_s``)."""
    router = precise.router
    parsed = parse_body(Kind.CHAT, raw)
    tokens = router.tokens(parsed)
    digests: list[Digest] = router.digests(parsed, tokens)
    size, blocks = tokens.block_size, len(digests)
    last_block = tuple(tokens.ids[(blocks - 1) * size : blocks * size])
    sample = Sample(endpoint=replica.id, blocks=blocks)
    state = precise.fleet.get(replica.id)
    assert state is not None
    # The load signal starts from an idle endpoint: the last request's ``running`` has been scraped away.
    await _wait(lambda: state.metrics is not None and state.metrics.running == 0, 5, "idle")
    sent_wall, sent, visible_wall = time.time(), time.perf_counter(), 0.0
    url = f"http://{replica.address}/v1/chat/completions"
    request = asyncio.create_task(http.post(url, content=raw, headers={"content-type": "application/json"}))
    while (elapsed_ms := (time.perf_counter() - sent) * 1e3) < opts.timeout_s * 1e3:
        now = time.monotonic()
        if sample.send_to_index_ms is None and router.index.match(digests, now).get(replica.id) == blocks:
            sample.send_to_index_ms, visible_wall = elapsed_ms, time.time()
        if sample.send_to_load_ms is None and state.metrics is not None and state.metrics.running >= 1:
            sample.send_to_load_ms = elapsed_ms
        sample.approximate_visible |= bool(approximate.router.index.match(digests, now))
        ts = events.first_stored.get(last_block)
        if sample.send_to_engine_event_ms is None and ts is not None:
            sample.send_to_engine_event_ms = (ts - sent_wall) * 1e3
        if request.done() and sample.send_to_index_ms is not None and ts is not None:
            break
        await asyncio.sleep(POLL_S)
    (await request).raise_for_status()
    ts = events.first_stored.get(last_block)
    if sample.send_to_index_ms is not None and ts is not None:
        # Our own subscriber may read the engine's batch after the agent's path delivered it: ``ts`` is
        # the engine's stamp either way.
        sample.engine_event_to_index_ms = (visible_wall - ts) * 1e3
    return sample, digests


async def measure(opts: Options, workdir: Path, command: str) -> dict[str, Any]:
    """Start agents and both gateways, take the samples, stop everything (by PID), report."""
    agents = Agents(workdir, opts.agents)
    await asyncio.to_thread(agents.start)
    gateways: list[Gateway] = []
    try:
        for mode in ("precise", "approximate"):
            gateway = Gateway(parse_config(gateway_config(agents.etcd.address, mode)))
            await gateway.start()
            gateways.append(gateway)
        precise, approximate = gateways
        for gateway in gateways:
            await _wait(lambda g=gateway: _attached(g, agents.replicas), 60, "attached to every feed")
        feed_hop: list[float] = []
        precise.cluster.feeds.stats.on_staleness = feed_hop.append
        started, children_s = CpuSample.take(), agents.cpu_s()
        samples, visible_at_end = await run_samples(opts, agents.replicas, precise, approximate)
        ended = CpuSample.take()
        other_cores = started.other_cores(ended, agents.cpu_s() - children_s)
        wall_s = ended.wall - started.wall
        precise.cluster.feeds.stats.on_staleness = None
    finally:
        for gateway in gateways:
            await gateway.aclose(grace_s=0)
        await asyncio.to_thread(agents.stop)
    result = report(opts, samples, feed_hop, wall_s, command)
    result["approximate"]["visible_at_end"] = visible_at_end
    return {**result, "other_cpu_cores": other_cores}


def report(
    opts: Options, samples: list[Sample], feed_hop_s: list[float], wall_s: float, command: str
) -> dict[str, Any]:
    """The JSON result: summaries (ms) per signal of the precise gateway, the approximate baseline."""

    def seen(name: str) -> list[float]:
        return [v for s in samples if (v := getattr(s, name)) is not None]

    metrics = {
        name: {**summary(seen(name), 2), "missing": len(samples) - len(seen(name))}
        for name in (
            "send_to_engine_event_ms",
            "engine_event_to_index_ms",
            "send_to_index_ms",
            "send_to_load_ms",
        )
    }
    metrics["feed_hop_ms"] = summary([s * 1e3 for s in feed_hop_s], 2)
    return {
        "benchmark": "staleness",
        "command": command,
        "machine": machine(),
        "revision": revision(),
        "parameters": {**vars_of(opts), "poll_s": POLL_S, "scrape_interval_s": SCRAPE_INTERVAL_S},
        "wall_s": round(wall_s, 1),
        "precise": metrics,
        "approximate": {"samples": len(samples), "visible": sum(s.approximate_visible for s in samples)},
        "scrape_bound_ms": SCRAPE_INTERVAL_S * 1e3,
        "blocks_per_prompt": summary([float(s.blocks) for s in samples], 0),
        "samples": [vars_of(s) for s in samples],
    }


def vars_of(obj: Any) -> dict[str, Any]:
    """A slotted dataclass as a dict (JSON)."""
    return {name: getattr(obj, name) for name in obj.__slots__}


def table(result: dict[str, Any]) -> str:
    """The result as the printed table (ms)."""
    rows = [f"{'signal':32} {'n':>5} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8} {'missing':>8}"]
    for name, s in result["precise"].items():
        rows.append(
            f"{name:32} {s['n']:>5} {s['p50']:>8} {s['p90']:>8} {s['p99']:>8} {s['max']:>8} "
            f"{s.get('missing', ''):>8}"
        )
    ap = result["approximate"]
    rows.append(
        f"approximate index (learns only from its own decisions): prompt visible in {ap['visible']}/"
        f"{ap['samples']} samples while measured, {ap['visible_at_end']} at the end of the run"
    )
    rows.append(f"other tenants' CPU while measuring: {result['other_cpu_cores']} cores")
    rows.append(f"load via scrape: bounded by the {result['scrape_bound_ms']:.0f} ms interval + one scrape")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m load.bench.staleness", description="Engine KV event -> routing effect latency."
    )
    parser.add_argument("--out", type=Path, default=Path("results/staleness.json"))
    parser.add_argument("--quick", action="store_true", help="1 agent, a few samples (seconds; a smoke run)")
    parser.add_argument("--samples", type=int, help="measured samples (default 200; quick 5)")
    parser.add_argument("--agents", type=int, help="agents, one replica each (default 2; quick 1)")
    parser.add_argument("--workdir", type=Path, help="logs and configs (default: a temp dir)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = Options(agents=1, samples=5, warmup=2) if args.quick else Options()
    if args.samples is not None:
        opts = dataclasses.replace(opts, samples=args.samples)
    if args.agents is not None:
        opts = dataclasses.replace(opts, agents=args.agents)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvgate-staleness-"))
    workdir.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m load.bench.staleness", *(argv if argv is not None else sys.argv[1:])])
    result = uvloop.run(measure(opts, workdir, command))
    write_json(args.out, result)
    print(table(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
