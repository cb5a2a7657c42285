"""Node configs of ``kvgate up --agents``, pinned to the ports the first run bound (where restarts listen)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from certs.store import LeafFiles
from kvgate.dev.nodes import agent_config, kvcached_config, pin_agent, pin_kvcached, port_of, with_port


def leaf(name: str) -> LeafFiles:
    return LeafFiles(name=name, cert=Path(f"/c/{name}.pem"), key=Path(f"/c/{name}.key"), ca=Path("/c/ca.pem"))


ENGINE = {"id": "sim-0", "kind": "sim", "model": "m", "model_path": "/m", "args": []}


def test_an_agent_is_pinned_to_its_feed_admin_and_engine_ports() -> None:
    config = agent_config(
        "node-0",
        [ENGINE, {"id": "remote", "kind": "vllm", "model": "m", "address": "10.0.0.9:8000"}],
        etcd="127.0.0.1:2379",
        state_dir=Path("/w/node-0"),
        lease_ttl_s=5,
        kvcached_unix=None,
        tls=None,
        options={"slot_save_min_tokens": 512},
    )
    status: dict[str, Any] = {
        "feed": "127.0.0.1:41001",
        "admin_port": 41002,
        "engines": [
            {"id": "sim-0", "address": "127.0.0.1:41003"},
            {"id": "remote", "address": "10.0.0.9:8000"},
        ],
    }
    pinned = pin_agent(config, status)
    assert pinned["agent"] == {
        **config["agent"],
        "listen": "127.0.0.1:41001",
        "admin_listen": "127.0.0.1:41002",
    }
    assert pinned["agent"]["slot_save_min_tokens"] == 512
    assert pinned["engines"] == [{**ENGINE, "port": 41003}, config["engines"][1]]  # a remote one is not ours
    assert pinned["etcd"] == config["etcd"] == {"endpoints": ["127.0.0.1:2379"]}


def test_an_agent_with_kvcached_gets_its_socket_and_mtls() -> None:
    config = agent_config(
        "node-1",
        [ENGINE],
        etcd="127.0.0.1:2379",
        state_dir=Path("/w/node-1"),
        lease_ttl_s=5,
        kvcached_unix="/w/kvcached-node-1.sock",
        tls=leaf("agent-node-1"),
        options={},
    )
    assert config["agent"]["kvcached"] == "unix:/w/kvcached-node-1.sock"
    assert config["agent"]["tls"] == {
        "cert": "/c/agent-node-1.pem",
        "key": "/c/agent-node-1.key",
        "client_ca": "/c/ca.pem",
    }


def test_a_kvcached_daemon_is_pinned_to_its_feed_and_quic_ports() -> None:
    config = kvcached_config(
        "node-0",
        socket=Path("/w/kvcached-node-0.sock"),
        tls=leaf("kvcached-node-0"),
        etcd="127.0.0.1:2379",
        lease_ttl_s=5,
    )
    pinned = pin_kvcached(config, {"feed": "127.0.0.1:42001", "quic": "127.0.0.1:42002", "grpc": None})
    assert pinned["kvcached"] == {**config["kvcached"], "feed_listen": "127.0.0.1:42001"}
    assert pinned["quic"] == {**config["quic"], "listen": "127.0.0.1:42002"}
    assert pinned["kvcached"]["listen_unix"] == "/w/kvcached-node-0.sock"


@pytest.mark.parametrize(
    ("address", "port", "pinned"),
    [("127.0.0.1:0", 9, "127.0.0.1:9"), ("[::1]:0", 9, "[::1]:9"), ("0.0.0.0:5", 6, "0.0.0.0:6")],
)
def test_ports(address: str, port: int, pinned: str) -> None:
    assert with_port(address, port) == pinned and port_of(pinned) == port


def test_simulated_gpu_power_for_a_node() -> None:
    """``kvgate up --agents N --gpu h100,a100 --power-cap-w 0,250``: node i's sim flags and its agent's
    DCGM source, which the agent config accepts."""
    from agent.config import parse_node_config
    from kvgate.dev.nodes import SIM_GPU_CLASSES, gpu_list, sim_power, watts_list
    from load.sim.power import GPU_CLASSES
    from load.sim.server import DCGM_PATH, power_models

    assert set(SIM_GPU_CLASSES) == set(GPU_CLASSES)
    gpus, caps = gpu_list("h100,a100"), watts_list("0,250")
    args, power = sim_power(gpus, caps, 3, 8123)
    assert args == ["--gpu", "a100", "--power-cap-w", "250"]
    assert power == [{"kind": "dcgm", "url": f"http://127.0.0.1:8123{DCGM_PATH}", "interval_s": 1.0}]
    assert [m.cap_w for m in power_models(args[1], args[3])] == [250.0]
    engine = {"kind": "sim", "model": "m", "model_path": "/m", "port": 8123, "args": args}
    assert parse_node_config({"engines": [engine], "power": power}).power[0].kind == "dcgm"
    assert sim_power((), (), 0, 1)[0] == ["--gpu", "h100", "--power-cap-w", "0"]
    with pytest.raises(ValueError, match="unknown GPU class b200"):
        gpu_list("h100,b200")
    with pytest.raises(ValueError, match="finite watts"):
        watts_list("-5")
