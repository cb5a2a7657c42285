"""The configs of ``kvgate up --agents``'s nodes: each node agent's and each kvcached daemon's.

Listen addresses start on port 0. Once a child is ready, its config is rewritten with the ports it bound
(:func:`pin_agent`, :func:`pin_kvcached`), so a restarted agent, its engines and a restarted daemon come
back at the addresses the gateway, etcd and the peers already know.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from certs.store import LeafFiles


def agent_config(
    node: str,
    engines: Sequence[Mapping[str, Any]],
    *,
    etcd: str,
    state_dir: Path,
    lease_ttl_s: int,
    kvcached_unix: str | None,
    tls: LeafFiles | None,
    options: Mapping[str, Any],
) -> dict[str, Any]:
    """Node agent ``node``'s config: its ``[[engines]]``, the local etcd, its state directory; with
    kvcached, the daemon's unix socket and mTLS (``tls``) on its feed and admin API; ``options`` are
    extra ``[agent]`` keys."""
    agent: dict[str, Any] = {
        "id": node,
        "lease_ttl_s": lease_ttl_s,
        "drain_timeout_s": 10,
        "state_dir": str(state_dir),
    }
    if kvcached_unix is not None:
        agent["kvcached"] = f"unix:{kvcached_unix}"
    if tls is not None:
        agent["tls"] = {"cert": str(tls.cert), "key": str(tls.key), "client_ca": str(tls.ca)}
    return {
        "agent": {**agent, **options},
        "etcd": {"endpoints": [etcd]},
        "engines": [dict(e) for e in engines],
    }


def kvcached_config(
    node: str, *, socket: Path, tls: LeafFiles, etcd: str, lease_ttl_s: int
) -> dict[str, Any]:
    """kvcached daemon ``node``'s config: its API on the unix socket ``socket``, its feed and QUIC with
    mTLS, Prometheus metrics on a loopback port."""
    return {
        "kvcached": {
            "node": node,
            "listen_unix": str(socket),
            "feed_listen": "127.0.0.1:0",
            "metrics_listen": "127.0.0.1:0",
            "ram_bytes": 512 << 20,
            "lease_ttl_s": lease_ttl_s,
            "tls": {"cert": str(tls.cert), "key": str(tls.key), "ca": str(tls.ca)},
        },
        # Loopback: 65,000-byte datagrams (aioquic's cost is per packet); a slot file of a long
        # prompt is tens of MB, so a peer fetch gets more than the 2 s default.
        "quic": {"listen": "127.0.0.1:0", "max_datagram_size": 65000, "timeout_s": 20.0},
        "etcd": {"endpoints": [etcd]},
    }


def pin_agent(config: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with the agent's feed and admin API, and each engine it runs, on the ports its ready
    ``status`` reports (engines given by ``address`` are left alone)."""
    agent = dict(config["agent"])
    agent["listen"] = with_port(str(agent.get("listen", "127.0.0.1:0")), port_of(str(status["feed"])))
    agent["admin_listen"] = with_port(
        str(agent.get("admin_listen", "127.0.0.1:0")), int(status["admin_port"])
    )
    addresses = {str(e["id"]): e.get("address") for e in status["engines"]}
    engines = []
    for engine in config["engines"]:
        bound = addresses.get(str(engine["id"]))
        if "address" not in engine and isinstance(bound, str):
            engine = {**engine, "port": port_of(bound)}
        engines.append(engine)
    return {**config, "agent": agent, "engines": engines}


def pin_kvcached(config: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with the daemon's feed, metrics and QUIC listeners on the ports its ready ``status``
    reports."""
    daemon = dict(config["kvcached"])
    daemon["feed_listen"] = with_port(str(daemon["feed_listen"]), port_of(str(status["feed"])))
    if "metrics_listen" in daemon and status.get("metrics_port"):
        daemon["metrics_listen"] = with_port(str(daemon["metrics_listen"]), int(status["metrics_port"]))
    pinned = {**config, "kvcached": daemon}
    if "quic" in config and status.get("quic"):
        quic = dict(config["quic"])
        quic["listen"] = with_port(str(quic["listen"]), port_of(str(status["quic"])))
        pinned["quic"] = quic
    return pinned


def port_of(address: str) -> int:
    """The port of ``host:port`` (``[v6]:port`` too)."""
    return int(address.rpartition(":")[2])


def with_port(address: str, port: int) -> str:
    """``address`` (``host:port``) with its port replaced by ``port``."""
    return f"{address.rpartition(':')[0]}:{port}"


#: Where a simulated engine with a GPU power model serves dcgm-exporter's format (load.sim.server).
SIM_DCGM_PATH = "/dcgm/metrics"
#: The simulator's GPU classes (load.sim.power.GPU_CLASSES; kvgate.dev does not import load, a test
#: keeps the two equal).
SIM_GPU_CLASSES = ("h100", "a100", "l40s")


def gpu_list(text: str) -> tuple[str, ...]:
    """``--gpu``: comma-separated simulator GPU classes; ``ValueError`` naming an unknown one."""
    names = tuple(n.strip() for n in text.split(","))
    unknown = [n for n in names if n not in SIM_GPU_CLASSES]
    if unknown:
        raise ValueError(f"unknown GPU class {', '.join(unknown)}; known: {', '.join(SIM_GPU_CLASSES)}")
    return names


def watts_list(text: str) -> tuple[float, ...]:
    """``--power-cap-w``: comma-separated watts >= 0 (0: no cap); ``ValueError`` otherwise."""
    values = tuple(float(w) for w in text.split(","))
    if any(not 0 <= w < float("inf") for w in values):
        raise ValueError(f"power caps must be finite watts >= 0, got {text!r}")
    return values


def sim_power(
    gpus: Sequence[str], caps_w: Sequence[float], index: int, port: int
) -> tuple[list[str], list[dict[str, Any]]]:
    """For node ``index``'s simulated engine on ``port``: the ``kvgate sim`` flags of its GPU power model
    (class ``gpus[index]`` and cap ``caps_w[index]``, each list cycled; an empty one: ``h100``, no cap),
    and its agent's ``[[power]]`` table reading the engine's dcgm-exporter endpoint every second."""
    gpu = gpus[index % len(gpus)] if gpus else "h100"
    cap = caps_w[index % len(caps_w)] if caps_w else 0.0
    args = ["--gpu", gpu, "--power-cap-w", f"{cap:g}"]
    table = {"kind": "dcgm", "url": f"http://127.0.0.1:{port}{SIM_DCGM_PATH}", "interval_s": 1.0}
    return args, [table]
