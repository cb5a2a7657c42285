from __future__ import annotations

import itertools
import json
import socket
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import pytest

import agent.config as config_module
from agent.config import AgentSection, NodeConfig, load_node_config, parse_node_config
from agent.errors import AgentConfigError
from agent.launch import render
from engines.config import KV_OFFLOADS, OffloadConfig, RestartPolicy
from engines.kinds import ENGINE_KINDS, OFFLOAD_MATRIX, ROLES


def engine_raw(kind: str, **keys: Any) -> dict[str, Any]:
    """A valid ``[[engines]]`` table of ``kind`` with ``keys`` on top."""
    raw: dict[str, Any] = {"kind": kind, "model": "m"}
    if kind == "openai_compat":
        raw["address"] = "10.0.0.9:443"
    else:
        raw["model_path"] = "smollm2" if kind in ("llama_cpp", "sim") else "org/model"
    raw.update(keys)
    return raw


def node(*engines: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"agent": {"id": "node-a", **top.pop("agent", {})}, "engines": list(engines), **top}


def parse_toml(text: str) -> NodeConfig:
    return parse_node_config(tomllib.loads(textwrap.dedent(text)))


def test_docstring_example_parses() -> None:
    doc = config_module.__doc__ or ""
    example = textwrap.dedent(doc[doc.index("    [agent]") : doc.index("KV offload x role matrix")])
    cfg = parse_node_config(tomllib.loads(example))
    assert cfg.agent.tls is not None and cfg.agent.tls.client_ca == "/etc/kvgate/ca.pem"
    assert [e.kind for e in cfg.engines] == ["llama_cpp", "vllm", "sglang", "sim", "vllm", "openai_compat"]
    assert [e.id for e in cfg.engines] == ["llama-0", *(f"node-a-{i}" for i in range(1, 6))]
    llama, vllm, sglang, _, attached, remote = cfg.engines
    assert (
        not attached.started and attached.kv_events and attached.kv_events_endpoint == "tcp://10.0.0.7:5557"
    )
    assert (llama.threads, llama.args, llama.env, llama.labels) == (
        2, ("--no-warmup",), (("LLAMA_ARG_FOO", "1"),), (("zone", "a"),),
    )  # fmt: skip
    assert vllm.offload == OffloadConfig(cpu_bytes=16 << 30, disk_bytes=64 << 30, disk_path="/nvme/kvbm")
    assert vllm.command == ("/opt/vllm/bin/vllm", "serve") and vllm.role == "prefill"
    assert sglang.offload.ratio == 2.0 and sglang.offload.storage_backend == "file"
    assert (remote.address, remote.tls, remote.api_key_env, remote.metrics) == (
        "10.0.0.9:443", True, "REMOTE_API_KEY", False,
    )  # fmt: skip
    assert cfg.etcd_raw == {"endpoints": ["127.0.0.1:2379"]}
    assert cfg.agent.kvcached == "unix:/run/kvgate/kvcached.sock" and cfg.agent.slot_save_min_tokens == 1024


def test_slot_save_min_tokens() -> None:
    with_kvcached = {"kvcached": "unix:/run/kvcached.sock"}
    assert parse_node_config(node(OK, agent=with_kvcached)).agent.slot_save_min_tokens == 1024
    off = parse_node_config(node(OK, agent={**with_kvcached, "slot_save_min_tokens": 0}))
    assert off.agent.slot_save_min_tokens == 0
    assert parse_node_config(node(OK, agent={"slot_save_min_tokens": 0})).agent.kvcached is None
    assert parse_node_config(node(OK)).agent.slot_save_min_tokens == 1024  # unused without kvcached


def test_kvcached_max_block_bytes() -> None:
    with_kvcached = {"kvcached": "unix:/run/kvcached.sock"}
    assert parse_node_config(node(OK, agent=with_kvcached)).agent.kvcached_max_block_bytes == 64 << 20
    big = parse_node_config(node(OK, agent={**with_kvcached, "kvcached_max_block_bytes": 256 << 20}))
    assert big.agent.kvcached_max_block_bytes == 256 << 20
    for bad in (0, 1000, "64MiB"):
        with pytest.raises(AgentConfigError, match="kvcached_max_block_bytes"):
            parse_node_config(node(OK, agent={**with_kvcached, "kvcached_max_block_bytes": bad}))


def test_minimal_config_defaults() -> None:
    cfg = parse_toml(
        """
        [[engines]]
        kind = "llama_cpp"
        model = "SmolLM2"
        model_path = "smollm2"
        """
    )
    host = socket.gethostname()
    assert cfg.agent == AgentSection(id=host)
    assert cfg.etcd_raw is None
    (e,) = cfg.engines
    assert (e.id, e.role, e.kv_offload, e.host, e.port) == (f"{host}-0", "both", "none", "127.0.0.1", 0)
    assert (e.block_size, e.kv_events, e.metrics, e.parallel, e.context) == (16, False, True, None, None)
    assert e.ready_timeout_s == 600.0
    assert e.restart == RestartPolicy() and e.offload == OffloadConfig() and e.started


def test_relative_state_dir_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines run with the state directory as their working directory: a relative one, left relative,
    made an exported model's path (``node-a/models/...``) resolve under itself and the engine never start."""
    monkeypatch.chdir(tmp_path)
    cfg = parse_node_config(node(OK, agent={"state_dir": "node-a"}))
    assert cfg.agent.state_dir == str(tmp_path / "node-a")
    assert parse_node_config(node(OK, agent={"state_dir": "/srv/kv"})).agent.state_dir == "/srv/kv"


@pytest.mark.parametrize(
    ("kind", "events"),
    [("vllm", True), ("sglang", True), ("sim", True), ("trtllm", False), ("llama_cpp", False)],
)
def test_kv_events_default_follows_the_kind(kind: str, events: bool) -> None:
    (e,) = parse_node_config(node(engine_raw(kind))).engines
    assert e.kv_events is events


def test_role_inherited_and_overridden() -> None:
    cfg = parse_node_config(
        node(
            engine_raw("vllm", kv_offload="nixl"),
            engine_raw("vllm", kv_offload="nixl", role="both"),
            agent={"role": "decode"},
        )
    )
    assert [e.role for e in cfg.engines] == ["decode", "both"]


def test_etcd_table_kept_raw_and_read_only() -> None:
    raw = node(engine_raw("sim"), etcd={"endpoints": ["127.0.0.1:2379"], "tls": {"ca": "x"}})
    cfg = parse_node_config(raw)
    assert cfg.etcd_raw == {"endpoints": ["127.0.0.1:2379"], "tls": {"ca": "x"}}
    raw["etcd"]["endpoints"].append("changed")
    assert cfg.etcd_raw["endpoints"] == ["127.0.0.1:2379"]
    with pytest.raises(TypeError):
        cfg.etcd_raw["new"] = 1  # type: ignore[index]


def test_load_toml_and_json_files(tmp_path: Path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text('[agent]\nid = "n"\n[[engines]]\nkind = "sim"\nmodel = "m"\nmodel_path = "/models/m"\n')
    as_json = tmp_path / "node.json"
    as_json.write_text(json.dumps(node(engine_raw("sim", model_path="/models/m"), agent={"id": "n"})))
    assert load_node_config(toml) == load_node_config(as_json)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("missing", None, "cannot read node config"),
        ("bad.toml", "[agent\n", "not valid TOML"),
        ("bad.json", "{", "not valid JSON"),
    ],
)
def test_load_errors(tmp_path: Path, name: str, text: str | None, message: str) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(AgentConfigError, match=message):
        load_node_config(path)


OK = engine_raw("llama_cpp")
BAD: list[tuple[dict[str, Any], str]] = [
    ({"agent": {}, "engines": [OK], "nodes": 1}, "config: unknown key(s) nodes"),
    ({"agent": {"id": "n"}}, "config.engines: required"),
    ({"engines": []}, "engines: at least one [[engines]] table is required"),
    ({"agent": "x", "engines": [OK]}, "agent: expected a table, got str"),
    (node(OK, agent={"bogus": 1}), "agent: unknown key(s) bogus"),
    (node(OK, agent={"id": "a/b"}), "agent.id: expected letters, digits"),
    (node(OK, agent={"listen": "nope"}), "agent.listen: expected host:port, got 'nope'"),
    (node(OK, agent={"admin_listen": "h:99999"}), "agent.admin_listen: expected host:port"),
    (node(OK, agent={"advertise": ""}), "agent.advertise: must not be empty"),
    (node(OK, agent={"role": "x"}), "agent.role: expected one of both, prefill, decode, got 'x'"),
    (node(OK, agent={"lease_ttl_s": 1}), "agent.lease_ttl_s: must be >= 2, got 1"),
    (node(OK, agent={"lease_ttl_s": 2.5}), "agent.lease_ttl_s: expected int, got float"),
    (node(OK, agent={"drain_timeout_s": -1}), "agent.drain_timeout_s: must be a finite number >= 0.0"),
    (node(OK, agent={"state_dir": ""}), "agent.state_dir: must not be empty"),
    (node(OK, agent={"tls": {"cert": "c"}}), "agent.tls: set all of cert, key, client_ca or none (got cert)"),
    (node(OK, agent={"tls": {"ca": "c"}}), "agent.tls: unknown key(s) ca"),
    (node(OK, etcd=3), "etcd: expected a table, got int"),
    (
        node(OK, agent={"kvcached": "unix:/k.sock", "slot_save_min_tokens": -1}),
        "agent.slot_save_min_tokens: expected a whole number of tokens >= 0 (0 = no automatic saves), got -1",
    ),
    (
        node(OK, agent={"kvcached": "unix:/k.sock", "slot_save_min_tokens": 1.5}),
        "agent.slot_save_min_tokens: expected a whole number of tokens >= 0",
    ),
    (
        node(OK, agent={"kvcached": "unix:/k.sock", "slot_save_min_tokens": True}),
        "agent.slot_save_min_tokens: expected a whole number of tokens >= 0",
    ),
    (
        node(OK, agent={"slot_save_min_tokens": 512}),
        "agent.slot_save_min_tokens: automatic slot saves go into kvcached; set agent.kvcached",
    ),
    ({"agent": {"id": "n"}, "engines": [1]}, "engines[0]: expected a table, got int"),
    (node({"model": "m"}), "engines[0].kind: required"),
    (
        node(OK, {"kind": "tgi", "model": "m"}),
        "engines[1].kind: expected one of vllm, sglang, trtllm, llama_cpp",
    ),
    (node({"kind": "sim", "model_path": "x"}), "engines[0].model: required"),
    (node(engine_raw("sim", model="")), "engines[0].model: must not be empty"),
    (
        node(engine_raw("vllm", model_path=None) | {"model_path": ""}),
        "engines[0].model_path: required for vllm",
    ),
    (
        node(engine_raw("vllm", model_path="smollm2")),
        "engines[0].model_path: 'smollm2' is for llama_cpp, sim",
    ),
    (node(engine_raw("llama_cpp", model_path="m.bin")), "llama_cpp needs a .gguf or 'smollm2', not 'm.bin'"),
    (node(engine_raw("sim", id="../x")), "engines[0].id: expected letters, digits"),
    (node(engine_raw("sim", port=70000)), "engines[0].port: must be <= 65535, got 70000"),
    (node(engine_raw("sim", port=-1)), "engines[0].port: must be >= 0, got -1"),
    (node(engine_raw("sim", host="")), "engines[0].host: must not be empty"),
    (node(engine_raw("sim", bogus=True)), "engines[0]: unknown key(s) bogus"),
    (
        node(engine_raw("sim", kv_offload="ssd")),
        "engines[0].kv_offload: expected one of none, nixl, lmcache, hicache",
    ),
    (node(engine_raw("sim", role="x")), "engines[0].role: expected one of both, prefill, decode, got 'x'"),
    (
        node(engine_raw("vllm", kv_offload="hicache")),
        "engines[0].kv_offload: 'hicache' is not supported by vllm; allowed: none, nixl, lmcache, kvbm",
    ),
    (
        node(engine_raw("sglang", kv_offload="nixl")),
        "engines[0].kv_offload: 'nixl' is not supported by sglang with role 'both'; allowed: none, hicache",
    ),
    (
        node(engine_raw("vllm", role="decode", kv_offload="kvbm", offload={"cpu_bytes": 1})),
        "engines[0].kv_offload: 'kvbm' is not supported by vllm with role 'decode'; allowed: nixl",
    ),
    (
        node(engine_raw("llama_cpp", role="prefill")),
        "engines[0].role: 'prefill' is not supported by llama_cpp; allowed: both",
    ),
    (
        node(OK, agent={"role": "decode"}),
        "engines[0].role: 'decode' (inherited from agent.role) is not supported by llama_cpp; allowed: both",
    ),
    (node(engine_raw("openai_compat", host="h")), "engines[0].host: mutually exclusive with address"),
    (node(engine_raw("openai_compat", port=80)), "engines[0].port: mutually exclusive with address"),
    (node({"kind": "openai_compat", "model": "m"}), "engines[0].address: required"),
    (node(engine_raw("openai_compat", address="nope")), "engines[0].address: expected host:port"),
    (  # gateways refuse an endpoint named by host (EDS serves IPs): the agent says so at load
        node(engine_raw("openai_compat", address="api.example:443")),
        "engines[0].address: expected an IP address and port",
    ),
    (node(engine_raw("openai_compat", model_path="x")), "engines[0].model_path: not used by remote engines"),
    (node(engine_raw("openai_compat", command=["x"])), "engines[0].command: not used by remote engines"),
    (node(engine_raw("openai_compat", restart={})), "engines[0].restart: not used by remote engines"),
    (
        node(engine_raw("sim", kv_events_endpoint="tcp://h:1")),
        "engines[0].kv_events_endpoint: only for remote engines",
    ),
    (node(engine_raw("llama_cpp", tls=True)), "engines[0].tls: only for remote engines"),
    (node(engine_raw("sim", api_key_env="K")), "engines[0].api_key_env: only for remote engines"),
    (node(engine_raw("vllm", threads=2)), "engines[0].threads: only for llama_cpp"),
    (node(engine_raw("llama_cpp", threads=0)), "engines[0].threads: must be >= 1, got 0"),
    (
        node(engine_raw("llama_cpp", kv_events=True)),
        "engines[0].kv_events: llama_cpp does not publish KV events over ZMQ; allowed with: vllm, sglang,",
    ),
    (node(engine_raw("trtllm", kv_events=True)), "engines[0].kv_events: trtllm does not publish KV events"),
    (node(engine_raw("sim", kv_events="yes")), "engines[0].kv_events: expected bool, got str"),
    (node(engine_raw("sim", metrics=1)), "engines[0].metrics: expected bool, got int"),
    (node(engine_raw("sim", args=["--x", 1])), "engines[0].args: expected a list of non-empty strings"),
    (node(engine_raw("sim", args="--x")), "engines[0].args: expected list, got str"),
    (node(engine_raw("sim", command=[""])), "engines[0].command: expected a list of non-empty strings"),
    (node(engine_raw("sim", env={"FOO": 1})), "engines[0].env.FOO: expected str, got int"),
    (node(engine_raw("sim", labels={"zone": ["a"]})), "engines[0].labels.zone: expected str, got list"),
    (node(engine_raw("sim", parallel=0)), "engines[0].parallel: must be >= 1, got 0"),
    (node(engine_raw("sim", context=0)), "engines[0].context: must be >= 1, got 0"),
    (node(engine_raw("sim", block_size=0)), "engines[0].block_size: must be >= 1, got 0"),
    (
        node(engine_raw("sim", ready_timeout_s=0)),
        "engines[0].ready_timeout_s: must be a finite number >= 0.001",
    ),
    (node(engine_raw("sim", restart={"tries": 3})), "engines[0].restart: unknown key(s) tries"),
    (
        node(engine_raw("sim", restart={"backoff_initial_s": 2, "backoff_max_s": 1})),
        "engines[0].restart.backoff_max_s: must be >= backoff_initial_s",
    ),
    (
        node(engine_raw("sim", restart={"backoff_initial_s": 0})),
        "engines[0].restart.backoff_initial_s: must be",
    ),
    (
        node(engine_raw("vllm", kv_offload="nixl", offload={"cpu_bytes": 1})),
        "engines[0].offload.cpu_bytes: not used with kv_offload 'nixl'; used with: lmcache, kvbm, hicache",
    ),
    (
        node(engine_raw("vllm", kv_offload="lmcache", offload={"ratio": 2.0})),
        "engines[0].offload.ratio: not used with kv_offload 'lmcache'; used with: hicache",
    ),
    (
        node(engine_raw("sglang", kv_offload="hicache", offload={"chunk_size": 256})),
        "engines[0].offload.chunk_size: not used with kv_offload 'hicache'; used with: lmcache",
    ),
    (
        node(engine_raw("vllm", kv_offload="lmcache", offload={"gpu_bytes": 1})),
        "engines[0].offload: unknown key(s)",
    ),
    (node(engine_raw("vllm", kv_offload="kvbm")), "engines[0].offload: kvbm needs cpu_bytes or disk_bytes"),
    (
        node(engine_raw("vllm", kv_offload="lmcache", offload={"disk_path": "/d"})),
        "engines[0].offload.disk_path: needs disk_bytes",
    ),
    (
        node(engine_raw("vllm", kv_offload="lmcache", offload={"cpu_bytes": 0})),
        "offload.cpu_bytes: must be >= 1",
    ),
    (
        node(engine_raw("sglang", kv_offload="hicache", offload={"ratio": 2.0, "cpu_bytes": 1 << 30})),
        "engines[0].offload: set ratio or cpu_bytes, not both",
    ),
    (
        node(engine_raw("sglang", kv_offload="hicache", offload={"disk_path": "/d"})),
        'engines[0].offload.disk_path: hicache uses it only with storage_backend = "file"',
    ),
    (
        node(engine_raw("sglang", kv_offload="hicache", role="decode")),
        "engines[0].offload.storage_backend: required for hicache on an sglang decode engine",
    ),
    (
        node(engine_raw("sglang", kv_offload="hicache", offload={"write_policy": "lazy"})),
        "engines[0].offload.write_policy: expected one of write_through, write_through_selective, write_back",
    ),
    (
        node(engine_raw("sglang", kv_offload="hicache", offload={"storage_backend": ""})),
        "engines[0].offload: disk_path and storage_backend must not be empty",
    ),
    (node(engine_raw("sim", id="a"), engine_raw("sim", id="a")), "engines: duplicate id 'a'"),
    (
        node(engine_raw("sim", port=8000), engine_raw("sim", port=8000)),
        "engines: duplicate host:port '127.0.0.1:8000'",
    ),
]


@pytest.mark.parametrize(("raw", "message"), BAD, ids=[m[:60] for _, m in BAD])
def test_bad_values_name_the_key(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(AgentConfigError) as info:
        parse_node_config(raw)
    assert message in str(info.value)


def cell_extras(kind: str, role: str, offload: str) -> dict[str, Any]:
    """The offload details a valid cell needs besides kind x role x kv_offload."""
    if offload == "kvbm":
        return {"offload": {"cpu_bytes": 1 << 30}}
    if offload == "hicache" and role == "decode":
        return {"offload": {"storage_backend": "file"}}
    return {}


CELLS = list(itertools.product(ENGINE_KINDS, ROLES, KV_OFFLOADS))


@pytest.mark.parametrize(("kind", "role", "offload"), CELLS)
def test_every_matrix_cell(kind: str, role: str, offload: str) -> None:
    raw = node(engine_raw(kind, role=role, kv_offload=offload, **cell_extras(kind, role, offload)))
    roles = OFFLOAD_MATRIX[kind]
    if role in roles and offload in roles[role]:
        (e,) = parse_node_config(raw).engines
        assert (e.kind, e.role, e.kv_offload) == (kind, role, offload)
        return
    with pytest.raises(AgentConfigError) as info:
        parse_node_config(raw)
    message = str(info.value)
    if role not in roles:
        assert message == f"engines[0].role: {role!r} is not supported by {kind}; allowed: {', '.join(roles)}"
    else:
        assert message.startswith(f"engines[0].kv_offload: {offload!r} is not supported by {kind}")
        offered = [o for o in KV_OFFLOADS if any(o in allowed for allowed in roles.values())]
        allowed = roles[role] if offload in offered else offered
        assert message.endswith(f"; allowed: {', '.join(allowed)}")


def test_remote_engine_with_kv_events_attaches() -> None:
    cfg = node_config(
        {
            "kind": "sim",
            "model": "m",
            "address": "127.0.0.1:9000",
            "kv_events_endpoint": "tcp://127.0.0.1:9100",
            "kv_replay_endpoint": "tcp://127.0.0.1:9101",
            "kv_events_topic": "t",
        }
    )
    (engine,) = cfg.engines
    assert not engine.started and engine.kv_events and engine.metrics
    launch = render(engine, cfg.agent, port=0)
    assert launch.argv == () and launch.health_path == "/health" and launch.speaks_kv_events
    assert (launch.kv_events_endpoint, launch.kv_replay_endpoint, launch.kv_events_topic) == (
        "tcp://127.0.0.1:9100", "tcp://127.0.0.1:9101", "t",
    )  # fmt: skip
    remote_no_events = node_config({"kind": "vllm", "model": "m", "address": "10.0.0.1:1"}).engines[0]
    assert not remote_no_events.kv_events
    with pytest.raises(AgentConfigError, match="kv_events_endpoint: required"):
        node_config({"kind": "vllm", "model": "m", "address": "10.0.0.1:1", "kv_events": True})
    with pytest.raises(AgentConfigError, match="expected tcp://host:port"):
        node_config({"kind": "vllm", "model": "m", "address": "10.0.0.1:1", "kv_events_endpoint": "h:1"})


def node_config(engine: dict[str, object]) -> NodeConfig:
    return parse_node_config({"agent": {"id": "node-a"}, "engines": [engine]})


POWER_ENGINE = {"engines": [{"kind": "sim", "model": "m", "model_path": "smollm2"}]}


def test_power_sources_parse() -> None:
    from agent.power.config import Common, DcgmConfig, IpmiConfig, NvmlConfig, RedfishConfig

    raw = POWER_ENGINE | {
        "power": [
            {"kind": "nvml"},
            {"kind": "dcgm", "url": "http://127.0.0.1:9400/metrics", "gpus": [0, 1], "interval_s": 0.5},
            {
                "kind": "redfish",
                "name": "bmc",
                "url": "https://10.0.0.2/",
                "username": "kvgate",
                "password_env": "BMC_PASSWORD",
                "ca_file": "/etc/kvgate/bmc-ca.pem",
                "auth": "session",
            },
            {
                "kind": "ipmi",
                "host": "10.0.0.3",
                "username": "kvgate",
                "password_env": "IPMI_PASSWORD",
                "sensor": "Node Power",
                "interface": "lan",
                "temperature_sensor": "Inlet Temp",
            },
        ]
    }
    power = parse_node_config(raw).power
    assert power[0] == NvmlConfig(Common("nvml"))
    assert power[1] == DcgmConfig(Common("dcgm", 0.5), "http://127.0.0.1:9400/metrics", frozenset({0, 1}))
    assert power[2] == RedfishConfig(
        Common("bmc"),
        "https://10.0.0.2",
        "kvgate",
        "BMC_PASSWORD",
        auth="session",
        verify="/etc/kvgate/bmc-ca.pem",
    )
    assert isinstance(power[3], IpmiConfig)
    assert (power[3].port, power[3].interface, power[3].temperature_sensor) == (623, "lan", "Inlet Temp")
    assert parse_node_config(POWER_ENGINE).power == ()


@pytest.mark.parametrize(
    ("power", "message"),
    [
        ({"kind": "rapl"}, r"power\[0\].kind: expected one of nvml, dcgm, redfish, ipmi"),
        ({"kind": "nvml", "url": "x"}, r"power\[0\]: unknown key\(s\) url"),
        ({"kind": "dcgm"}, r"power\[0\].url: required"),
        ({"kind": "dcgm", "url": "ftp://x/metrics"}, "expected an http:// or https:// URL"),
        ({"kind": "dcgm", "url": "http://x/m", "gpus": [-1]}, "GPU indices"),
        ({"kind": "redfish", "url": "https://bmc", "username": "u"}, r"password_env: required"),
        (
            {"kind": "redfish", "url": "https://u:p@bmc", "username": "u", "password_env": "P"},
            "no credentials",
        ),
        (
            {"kind": "redfish", "url": "https://bmc/redfish/v1", "username": "u", "password_env": "P"},
            "only scheme",
        ),
        (
            {
                "kind": "redfish",
                "url": "https://bmc",
                "username": "u",
                "password_env": "P",
                "verify": False,
                "ca_file": "/ca.pem",
            },
            "verify = false turns verification off",
        ),
        (
            {"kind": "redfish", "url": "https://bmc", "username": "u", "password_env": "no-such var"},
            "variable",
        ),
        ({"kind": "ipmi", "host": "h", "username": "u", "password_env": "P"}, r"sensor: required"),
        (
            {
                "kind": "ipmi",
                "host": "h",
                "username": "u",
                "password_env": "P",
                "sensor": "S",
                "interface": "lan",
                "cipher_suite": 3,
            },
            "cipher_suite: only with",
        ),
        ({"kind": "nvml", "interval_s": 0}, "interval_s: must be a finite number >= 0.01"),
    ],
)
def test_power_source_errors(power: dict[str, object], message: str) -> None:
    with pytest.raises(AgentConfigError, match=message):
        parse_node_config(POWER_ENGINE | {"power": [power]})


def test_power_source_names_are_unique() -> None:
    with pytest.raises(AgentConfigError, match="two sources named 'nvml'"):
        parse_node_config(POWER_ENGINE | {"power": [{"kind": "nvml"}, {"kind": "nvml"}]})


@pytest.mark.parametrize(
    ("kind", "flags"),
    [
        ("vllm", ["--enable-lora", "--lora-modules", "a=/l/a", "b=/l/b", "--max-loras", "2"]),
        ("sglang", ["--enable-lora", "--lora-paths", "a=/l/a", "b=/l/b", "--max-loras-per-batch", "2"]),
    ],
)
def test_lora_modules_render_and_register(kind: str, flags: list[str]) -> None:
    from agent.launch import endpoint_for

    raw = engine_raw(kind, lora_modules={"b": "/l/b", "a": "/l/a"}, max_loras=2, kv_events=False)
    cfg = parse_node_config(node(raw))
    (engine,) = cfg.engines
    launch = render(engine, cfg.agent, port=8000)
    argv = list(launch.argv)
    start = argv.index(flags[0])
    assert argv[start : start + len(flags)] == flags
    registered = endpoint_for(engine, launch, node="node-a", feed=None)
    assert registered.adapters == {"a", "b"} and registered.models == {"m", "a", "b"}
    assert registered.base_model == "m"


@pytest.mark.parametrize(
    "raw",
    [
        engine_raw("llama_cpp", lora_modules={"a": "/l/a"}),
        engine_raw("vllm", lora_modules={"m": "/l/m"}),
        engine_raw("vllm", lora_modules={"a": "/l/a"}, max_loras=0),
        engine_raw("vllm", lora_modules={"a": 3}),
    ],
)
def test_bad_lora_modules_are_refused(raw: dict[str, Any]) -> None:
    with pytest.raises(AgentConfigError):
        parse_node_config(node(raw))
