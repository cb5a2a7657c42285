"""``kvgate up``'s command line: its flags (``kvgate up --help``) and the banner it prints once up.

The flags are documented in the README's "``kvgate up`` flags" table (``tests/test_readme.py`` checks
that every flag ``--help`` lists is there).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from certs.store import LeafFiles
from engines.kinds import ENGINE_KINDS
from kvgate.dev import stackfile
from kvgate.dev.auth import DevAuth
from kvgate.dev.nodes import gpu_list, watts_list


def banner(
    info: stackfile.StackInfo,
    engines: Sequence[Mapping[str, str]],
    *,
    access_log: Path,
    certs: Mapping[str, LeafFiles],
    auth: DevAuth | None,
    client_certs: bool,
    pointer: Path | None,
) -> list[str]:
    """What ``kvgate up`` prints once up (``info``: its addresses; ``engines`` in order; ``certs``: the
    secure profile's; ``client_certs``: the listener requires a client certificate; ``auth``: the dev
    identity setup; ``pointer``: where ``info`` is published): every address, credentials (shown once),
    a curl to try."""
    listed = ", ".join(f"{e['id']}={e['address']}" for e in engines)
    models = f"model {info.models[0]}" if len(info.models) == 1 else f"models {', '.join(info.models)}"
    lines = [
        f"kvgate is up: {info.base_url}  ({models}; engines {listed})",
        f"  OpenAI base URL:  {info.base_url}",
        f"  ext_proc metrics: {info.metrics_url}",
    ]
    if info.metrics_url is not None:
        status = info.metrics_url.removesuffix("/metrics") + "/status"
        lines.append(f"  status page:      {status}   (kvgate status)")
    if len(info.extprocs) > 1:
        each = (f"{name}=127.0.0.1:{ports['extproc']}" for name, ports in info.extprocs.items())
        lines.append(f"  ext_procs:        {', '.join(each)}")
    lines += [
        f"  Envoy admin:      {info.admin_url}",
        f"  access log:       {access_log}   (one JSON line per request)",
    ]
    if info.etcd is not None:
        lines.append(f"  etcd:             {info.etcd}   (kvgate policy list; kvgate drain ID)")
    curl = ""
    if "envoy-edge" in certs:
        ca = certs["envoy-edge"].ca
        lines.append(f"  CA certificate for clients: {ca}")
        curl = f"--cacert {ca} "
        if client_certs:
            client = certs["client-dev"]
            lines.append(f"  client certificate: {client.cert}  key: {client.key}")
            curl += f"--cert {client.cert} --key {client.key} "
    if auth is not None:
        lines += auth.banner()
        curl += f"-H 'authorization: Bearer {auth.dev_key}' "
    body = json.dumps({"model": info.models[0], "messages": [{"role": "user", "content": "Hi"}]})
    lines += [
        f"  try: curl {curl}{info.base_url}/chat/completions -H 'content-type: application/json' -d '{body}'",
        f"  workdir:          {info.workdir}   (configs, logs: *.log)",
        f"  addresses:        {info.workdir}/{stackfile.FILE_NAME}"
        + ("" if pointer is None else f"  (published at {pointer})"),
        "  Ctrl-C stops everything",
    ]
    return lines


def parser(default_model: str) -> argparse.ArgumentParser:
    """``kvgate up``'s flags; ``default_model``: the simulators' model name."""
    p = argparse.ArgumentParser(
        prog="kvgate up",
        description="Run Envoy + kvgate + engines locally.",
        epilog=(
            "Once up, every address (OpenAI base URL, ext_proc metrics, Envoy admin, etcd with --agents) "
            "is printed and written to WORKDIR/stack.json, and published at "
            f"${stackfile.STATE_DIR_ENV} (default $XDG_STATE_HOME/kvgate or ~/.local/state/kvgate)"
            f"/{stackfile.FILE_NAME} until a clean stop: kvgate policy and kvgate drain use its etcd when "
            "given no --etcd. A child that dies (an engine, an ext_proc, an agent, etcd, Envoy) is restarted "
            "on the same addresses with backoff (0.2 s doubling to 10 s), and the rest keeps serving. "
            "Children stop with kvgate up (Ctrl-C, SIGTERM, even kill -9). Exit status: 0 stopped, 1 could "
            "not start, 2 bad usage or --config, 130 interrupted while starting."
        ),
    )
    p.add_argument(
        "--replicas", type=int, default=4, help="simulated vLLM replicas, one process each (default 4)"
    )
    p.add_argument(
        "--prefill",
        type=int,
        default=0,
        metavar="N",
        help="a disaggregated fleet instead of --replicas: N simulated prefill replicas (with --decode; "
        "with --agents N+M: the first N agents' engines have role prefill, the other M decode)",
    )
    p.add_argument(
        "--decode",
        type=int,
        default=0,
        metavar="M",
        help="M simulated decode replicas (with --prefill); the model's route is conditional: prefilled on "
        "a prefill replica when the decode pick lacks at least --pd-min-uncached-tokens prompt tokens",
    )
    p.add_argument(
        "--pd-mode",
        choices=["conditional", "disaggregated", "aggregated"],
        default="conditional",
        help="with --prefill/--decode: how the model is served (default conditional)",
    )
    p.add_argument(
        "--pd-protocol",
        choices=["vllm", "sglang"],
        default="vllm",
        help="with --prefill/--decode: the replicas speak vLLM's kv_transfer_params (default) or SGLang's "
        "bootstrap protocol (registered as SGLang engines; an SGLang decode replica is always paired; with "
        "--agents each agent runs an engine of kind sglang, the simulator behind it)",
    )
    p.add_argument(
        "--pd-min-uncached-tokens",
        type=int,
        default=512,
        metavar="T",
        help="with --pd-mode conditional: disaggregate from T uncached prompt tokens (default 512)",
    )
    p.add_argument(
        "--extprocs",
        type=int,
        metavar="N",
        help="ext_proc processes behind Envoy's one ext_proc cluster, each following the same engines, "
        "sharing in-flight counts and routing decisions (default: --config's [extproc] workers, else 1)",
    )
    p.add_argument(
        "--envoy-stats",
        action="store_true",
        help="also serve Envoy's statistics for Prometheus, read-only, on a free loopback port "
        "(GET /stats/prometheus only; the URL is in the banner)",
    )
    p.add_argument(
        "--fail-open",
        action="store_true",
        help="with every ext_proc down, proxy to the least-loaded engine instead of answering 503",
    )
    p.add_argument(
        "--port",
        type=int,
        default=8080,
        help="OpenAI listener port (default 8080; refused if already in use; 0: any free port)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="OpenAI listener address, an IP (default 127.0.0.1; 0.0.0.0 or :: to serve other machines)",
    )
    p.add_argument(
        "--model",
        help=f"served model name (default {default_model}; with --endpoint: the models each engine lists "
        "at GET /v1/models)",
    )
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="URL",
        help="front an existing OpenAI-compatible engine instead of simulators (repeatable)",
    )
    p.add_argument(
        "--engine",
        default="vllm",
        choices=[k for k in ENGINE_KINDS if k != "sim"],
        help="engine kind of --endpoint URLs (selects metric names; default vllm)",
    )
    p.add_argument("--model-dir", help="directory with the model's tokenizer.json + tokenizer_config.json")
    p.add_argument("--chat-template", help="chat template file overriding the model's")
    p.add_argument(
        "--workdir", type=Path, help="where configs and logs go (default: a temp dir; reusing one is safe)"
    )
    p.add_argument(
        "--secure",
        action="store_true",
        help="TLS everywhere: HTTPS listener, mTLS to the ext_proc and engines (certs in WORKDIR/certs)",
    )
    p.add_argument(
        "--client-certs",
        action="store_true",
        help="the HTTPS listener requires a client certificate from the dev CA (implies --secure)",
    )
    p.add_argument(
        "--agents",
        type=int,
        default=0,
        metavar="N",
        help="a local etcd and N node agents, each running one engine (see --agent-engine)",
    )
    p.add_argument(
        "--etcd-auth",
        action="store_true",
        help="with --agents: etcd with TLS client-certificate auth and RBAC (agents write only their own "
        "endpoints/<node>/, gateways read, only operators write policy; kvgate policy uses the operator "
        "certificate from stack.json)",
    )
    p.add_argument(
        "--agent-engine",
        default="sim",
        choices=["sim", "llama_cpp"],
        help="with --agents: the engine each agent runs (llama_cpp: llama-server with SmolLM2 on the CPU)",
    )
    p.add_argument(
        "--gpu",
        metavar="CLASSES",
        type=_checked(gpu_list),
        help="with --agents and the sim engine: simulate each engine's GPU power (h100, a100, l40s; "
        "comma-separated, cycled over the nodes); each agent reads it as a DCGM power source",
    )
    p.add_argument(
        "--power-cap-w",
        metavar="W[,W...]",
        type=_checked(watts_list),
        help="with --gpu: power caps in W (0: none), comma-separated, cycled over the nodes",
    )
    p.add_argument(
        "--kvcached",
        action="store_true",
        help="with --agents: a kvcached daemon per node (llama.cpp slots saved, restored before routing)",
    )
    p.add_argument(
        "--auth",
        action="store_true",
        help="require credentials: a dev OIDC issuer (JWTs) and an API key for tenant 'dev'",
    )
    p.add_argument(
        "--recipe",
        type=Path,
        metavar="DIR",
        help="run a recipe (recipes/<model>/<engine>/<topology>): a local etcd, one agent per [[engines]] "
        "table of its node*.toml, its gateway.toml merged over the generated config; refused, naming the "
        "engine, when its engines cannot run here (vLLM, SGLang: a GPU)",
    )
    p.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="a gateway config (TOML or JSON, the schema of kvgate extproc --config) merged over the "
        "generated one: [auth], [[tenants]], [policy], [scheduling], [index], [scrape], [slot_restore], "
        "[[models]], [extproc] limits. Refused (they are kvgate up's): [[endpoints]], [etcd], [feeds], "
        "extproc listen addresses and TLS files, scrape TLS files; with --auth also [auth], [[tenants]]",
    )
    return p


T = TypeVar("T")


def _checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type`` that reports ``parse``'s ``ValueError`` as a usage error (exit 2)."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return convert


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Combinations the flags do not take, refused (``p.error``: usage, exit 2) before anything starts:
    negative counts, ``--extprocs 0``, a ``--port`` out of range, a ``--host`` that is not an IP address,
    ``--gpu``/``--power-cap-w`` without ``--agents`` (or with another engine than the simulator), and
    ``--model-dir`` with ``--agents`` (whose engines tokenize with SmolLM2's)."""
    for flag in ("replicas", "prefill", "decode", "extprocs", "agents"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            p.error(f"--{flag} must not be negative (got {value})")
    if args.extprocs == 0:
        p.error("--extprocs must be at least 1 (got 0)")
    if not 0 <= args.port <= 65535:
        p.error(f"--port: a port from 0 (any free one) to 65535, got {args.port}")
    try:
        ipaddress.ip_address(args.host)
    except ValueError:
        p.error(f"--host: an IP address (Envoy listens on addresses, not names), got {args.host!r}")
    power = [flag for flag, value in (("--gpu", args.gpu), ("--power-cap-w", args.power_cap_w)) if value]
    if power and not args.agents:
        p.error(f"{' and '.join(power)} simulate the GPU power of --agents' engines: they need --agents")
    if power and args.agent_engine != "sim":
        p.error(f"{' and '.join(power)} simulate the sim engine's power: not with --agent-engine llama_cpp")
    if args.model_dir is not None and args.agents:
        p.error("--model-dir is not used by --agents' engines (they run SmolLM2): not with --agents")
