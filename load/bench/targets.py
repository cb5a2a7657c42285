"""The simulated fleet and the routers the benchmark compares, each started fresh for every run.

* ``kvgate``: Envoy + the ext_proc exactly as ``kvgate up --endpoint ...`` starts them
  (:class:`kvgate.dev.up.Stack` fronting the fleet), approximate prefix index (learned from its decisions).
* ``kvgate-precise``: the same gateway with a local etcd and a node agent attached to the replicas
  (``StackOptions.attach``): the agent subscribes to each replica's KV events and streams them, with the
  replicas' load, to the ext_proc, whose precise index then knows what each replica really holds.
* ``round-robin`` / ``least-loaded``: plain Envoy, same listener settings, a STATIC cluster over the
  same replicas with ``ROUND_ROBIN`` / ``LEAST_REQUEST`` (power of two choices on active requests).
* ``sglang-router`` / ``vllm-router``: the peers, ``--policy cache_aware`` (:mod:`load.bench.peers`).
* ``oracle``: no router: the client sends straight to replicas knowing each request's group or
  session (see :class:`OracleRoute`).

Every target is started after the replicas' prefix caches are reset and stopped after its run, so
each starts cold with no routing state. Processes are ended by PID.
"""

from __future__ import annotations

import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.dev.procs import Child, start_envoy
from kvgate.dev.up import Stack, StackOptions
from kvgate.envoy.bootstrap import render_baseline
from load.bench import peers
from load.client import FixedRoute, Route
from load.workloads.session import Session

TARGETS = (
    "kvgate",
    "kvgate-precise",
    "round-robin",
    "least-loaded",
    "sglang-router",
    "vllm-router",
    "oracle",
)
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
KV_EVENTS_TOPIC = "kv"
#: Every replica publishes vLLM-format KV events (ephemeral ZMQ ports), whichever target runs, so all
#: targets see the same fleet; only ``kvgate-precise`` subscribes (through a node agent).
KV_EVENTS_CONFIG = (
    '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", '
    f'"replay_endpoint": "tcp://127.0.0.1:0", "topic": "{KV_EVENTS_TOPIC}"}}'
)


class TargetUnavailable(RuntimeError):
    """This target cannot run here; the message is the reason reported in the results."""


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """The simulated fleet: ``replicas`` in one process, each with ``kv_blocks`` blocks of 16 tokens,
    and ``sim_args`` (timing model, scheduler limits) passed to ``kvgate sim``."""

    replicas: int
    kv_blocks: int
    max_model_len: int
    sim_args: tuple[str, ...] = ()


class Fleet:
    """Simulated replicas as one child process (``python -m load.sim.server``)."""

    def __init__(self, spec: FleetSpec, model: str, model_dir: Path, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        ready = workdir / "sim.ready.json"
        ready.unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-m",
            "load.sim.server",
            "--model",
            model,
            "--model-dir",
            str(model_dir),
            "--replicas",
            str(spec.replicas),
            "--port",
            "0",
            "--kv-blocks",
            str(spec.kv_blocks),
            "--max-model-len",
            str(spec.max_model_len),
            "--ready-file",
            str(ready),
            "--log-level",
            "WARNING",
            "--kv-events-config",
            KV_EVENTS_CONFIG,
            *spec.sim_args,
        ]
        self.child = Child("sim", argv, workdir / "sim.log")
        try:
            described: list[dict[str, str]] = self.child.wait_for_json_file(ready, 120)
        except BaseException:
            self.child.stop()
            raise
        self.ids = [r["id"] for r in described]
        self.addresses = [r["address"] for r in described]
        #: Each replica's KV event PUB and replay addresses (``tcp://host:port``).
        self.kv_events = [(r["kv_events"], r["kv_events_replay"]) for r in described]

    def reset(self, timeout_s: float = 30.0) -> None:
        """Drop every replica's cached prefixes (waits while requests still hold blocks)."""
        reset_caches(self.addresses, timeout_s)

    def stop(self) -> None:
        self.child.stop()


@dataclass(slots=True)
class OracleRoute:
    """Client-side routing with knowledge no router has: each request's group/session ``key``.

    A key's first request goes to the replica with the fewest keys so far (ties: fewest requests in
    flight, then lowest index), which spreads groups or sessions evenly and keeps each one's prefix
    on one replica. Later requests of the key go to that replica unless it has ``spill`` (8) or more
    requests in flight beyond the least-busy replica; then to the least busy (the key stays put). No
    proxy hop. A strong reference point, not a proven upper bound.
    """

    urls: list[str]
    spill: int = 8
    homes: dict[str, int] = field(default_factory=dict)
    keys: list[int] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.keys = [0] * len(self.urls)
        self.in_flight = [0] * len(self.urls)

    def pick(self, session: Session, turn: int) -> str:
        n = len(self.urls)
        home = self.homes.get(session.key)
        if home is None:
            home = min(range(n), key=lambda i: (self.keys[i], self.in_flight[i], i))
            self.homes[session.key] = home
            self.keys[home] += 1
        least = min(range(n), key=lambda i: (self.in_flight[i], i))
        pick = home if self.in_flight[home] < self.in_flight[least] + self.spill else least
        self.in_flight[pick] += 1
        return self.urls[pick]

    def done(self, url: str) -> None:
        self.in_flight[self.urls.index(url)] -= 1


class Running:
    """A started target: its route for the client and the processes to stop."""

    def __init__(self, route: Route, children: Sequence[Child] = (), stack: Stack | None = None) -> None:
        self.route = route
        self._children = list(children)
        self._stack = stack

    def stop(self) -> None:
        for child in reversed(self._children):
            child.stop()
        if self._stack is not None:
            self._stack.stop()


def reset_caches(addresses: Sequence[str], timeout_s: float = 30.0) -> None:
    """Drop the cached prefixes of every engine at ``addresses`` (``POST /reset_prefix_cache``, retried
    every 0.2 s while requests still hold blocks); RuntimeError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for address in addresses:
        while True:
            req = urllib.request.Request(f"http://{address}/reset_prefix_cache", method="POST")
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not reset the prefix cache of {address}")
            time.sleep(0.2)


def start(
    name: str,
    fleet: Fleet,
    model: str,
    model_dir: Path,
    workdir: Path,
    scheduling: dict[str, Any] | None = None,
    adapters: tuple[str, ...] = (),
) -> Running:
    """Start target ``name`` over ``fleet``; raises :class:`TargetUnavailable` with the reason.
    ``scheduling`` replaces kvgate's default scheduling section (plugins + profiles) when given;
    ``adapters``: the LoRA adapters the replicas serve by name, which ``kvgate`` routes (its static
    endpoints name them)."""
    workdir.mkdir(parents=True, exist_ok=True)
    urls = [f"http://{a}" for a in fleet.addresses]
    if name in ("kvgate", "kvgate-precise"):
        if name == "kvgate":  # routes learned from its own decisions, engines scraped by the gateway
            options = StackOptions(
                port=0,
                model=model,
                endpoints=tuple(urls),
                engine="vllm",
                model_dir=str(model_dir),
                index={"mode": "approximate"},
                scheduling=scheduling,
                adapters=adapters,
                workdir=workdir,
            )
        else:  # a node agent attached to the replicas streams their KV events and load; fleet in etcd
            attach = tuple(
                {
                    "id": replica_id,
                    "kind": "sim",
                    "model": model,
                    "address": address,
                    "kv_events_endpoint": pub,
                    "kv_replay_endpoint": replay,
                    "kv_events_topic": KV_EVENTS_TOPIC,
                }
                for replica_id, address, (pub, replay) in zip(
                    fleet.ids, fleet.addresses, fleet.kv_events, strict=True
                )
            )
            options = StackOptions(
                port=0,
                model=model,
                model_dir=str(model_dir),
                attach=attach,
                index={"mode": "precise"},
                scheduling=scheduling,
                workdir=workdir,
            )
        stack = Stack(options)
        stack.start()
        return Running(FixedRoute(stack.url), stack=stack)
    if name in ("round-robin", "least-loaded"):
        policy = "ROUND_ROBIN" if name == "round-robin" else "LEAST_REQUEST"
        child, url = start_baseline_envoy(workdir, fleet.addresses, policy)
        return Running(FixedRoute(url), [child])
    if name in peers.PEERS:
        spec = peers.PEERS[name]
        try:
            bin_dir = peers.install(spec)
            child, url = peers.launch(spec, bin_dir, urls, workdir)
        except peers.PeerUnavailable as exc:
            raise TargetUnavailable(str(exc)) from exc
        return Running(FixedRoute(url), [child])
    if name == "oracle":
        return Running(OracleRoute(urls))
    raise TargetUnavailable(f"unknown target {name!r}")


def start_baseline_envoy(workdir: Path, addresses: Sequence[str], lb_policy: str) -> tuple[Child, str]:
    """Start a plain Envoy over ``addresses`` balanced by ``lb_policy``; returns it and its base URL."""
    child, _admin, port = start_envoy(
        f"envoy-{lb_policy.lower()}", render_baseline(addresses, lb_policy), workdir, listener="openai"
    )
    return child, f"http://127.0.0.1:{port}"
