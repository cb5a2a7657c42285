"""``kvgate``: one entry point, one subcommand per component."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from extproc.config import GatewayConfig
    from kvgate.envoy.migration import EnvoyMigration

USAGE = """usage: kvgate COMMAND [ARGS]

commands:
  up              run Envoy + the ext_proc + simulated (or given) engines locally
  extproc         run the ext_proc endpoint picker (--config FILE)
  sim             run simulated vLLM replicas
  envoy-config    print the Envoy bootstrap (YAML) for given ports (--secure: the TLS profile)
  certs           dev CA and service certificates: `kvgate certs init|issue --dir D ...`
  model           model assets: `kvgate model export GGUF OUTDIR`
  oidc-dev        run a development OIDC issuer (--port P --clients FILE)
  apikey          API keys: `kvgate apikey create --tenant T | revoke ID | list`
  bench           routing benchmark: `kvgate bench routing [--smoke|--full] --out DIR`
  agent           run a node agent supervising engines (--config node.toml)
  policy          policy in etcd (or a file): `kvgate policy get|set|unset|list|watch|history|rollback`
  etcd            etcd users, roles and auth for kvgate's identities: `kvgate etcd bootstrap ...`
  drain           stop routing new requests to an endpoint: `kvgate drain ID [--undo] [--force]`
  status          a gateway's fleet, index, policy in force and queues: `kvgate status [--url URL] [--json]`
  kvcached        run the node's tiered KV block store (--config kvcached.toml)
"""


def _migration(gateway: GatewayConfig, proxy: str | None) -> EnvoyMigration | None:
    """The migration routes of ``gateway``'s opted-in models to the proxy at ``proxy`` (``host:port``)."""
    from contracts.errors import ConfigError
    from kvgate.envoy.migration import EnvoyMigration, migrating_models

    models = migrating_models(gateway)
    if not models:
        return None
    if proxy is None:
        names = ", ".join(m[0] for m in models)
        raise ConfigError(f"models {names} have migration = true: give --migration-proxy HOST:PORT")
    try:
        host, port = _hostport(proxy)
    except ValueError as exc:
        raise ConfigError(f"--migration-proxy: expected HOST:PORT, got {proxy!r}") from exc
    return EnvoyMigration(host, port, models)


def _envoy_config(argv: list[str]) -> int:
    import argparse

    from contracts.errors import ConfigError
    from extproc.burst.core import BurstEndpoint
    from extproc.burst.records import BurstCredential
    from kvgate.envoy.bootstrap import EnvoyParams, render_yaml
    from kvgate.envoy.resilience import Resilience, model_idle_timeouts
    from kvgate.envoy.tls import EnvoyTls, write_sds

    defaults, tls_defaults, res = EnvoyParams(), EnvoyTls(), Resilience()
    parser = argparse.ArgumentParser(prog="kvgate envoy-config")
    parser.add_argument(
        "--listen-host",
        default=defaults.listen_host,
        help="the OpenAI listener's address (default %(default)s: this machine only; 0.0.0.0 or :: to "
        "serve other machines)",
    )
    parser.add_argument("--listen-port", type=int, default=defaults.listen_port)
    parser.add_argument("--admin-port", type=int, default=defaults.admin_port)
    parser.add_argument(
        "--admin-socket",
        metavar="PATH",
        help="Envoy's admin on this Unix socket (mode 0600) instead of 127.0.0.1:--admin-port",
    )
    parser.add_argument(
        "--stats-port",
        type=int,
        metavar="PORT",
        help="serve Envoy's statistics for Prometheus, read-only (GET /stats/prometheus only), on "
        "127.0.0.1:PORT; needs --admin-socket or a fixed --admin-port",
    )
    parser.add_argument("--extproc-host", default=defaults.extproc_host)
    parser.add_argument("--extproc-port", type=int, default=defaults.extproc_port)
    parser.add_argument(
        "--extproc",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="an ext_proc replica (repeat for each; replaces --extproc-host/--extproc-port)",
    )
    parser.add_argument(
        "--fail-open",
        action="store_true",
        help="with every ext_proc down, proxy to the least-loaded engine instead of answering 503",
    )
    parser.add_argument(
        "--max-retries",
        type=int,
        default=res.max_retries,
        help="fallbacks tried for a request that never reached an engine (default %(default)s)",
    )
    parser.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=res.stream_idle_timeout_s,
        metavar="SECONDS",
        help="end a routed stream with no byte either way for this long (default %(default)s); a request "
        "held before its decision may stay silent for the longer of this and 600 s",
    )
    parser.add_argument(
        "--trusted-hops",
        type=int,
        default=defaults.trusted_hops,
        metavar="N",
        help="proxies in front of Envoy whose x-forwarded-for entries are trusted (default %(default)s: "
        "clients connect directly and their own x-forwarded-for is dropped)",
    )
    parser.add_argument("--secure", action="store_true", help="the TLS profile (SDS files in --certs-dir)")
    parser.add_argument("--certs-dir", default=tls_defaults.certs_dir, help="with --secure: PEM + SDS files")
    parser.add_argument("--client-certs", action="store_true", help="with --secure: require client certs")
    parser.add_argument(
        "--write-sds", action="store_true", help="with --secure: also write the SDS files into --certs-dir"
    )
    parser.add_argument(
        "--gateway-config",
        help="render its [auth] and [[tenants]] (JWT verification, per-tenant rate limits), its models' "
        "idle_timeout_s and its [tracing] (Envoy's OpenTelemetry tracer)",
    )
    parser.add_argument(
        "--migration-proxy",
        metavar="HOST:PORT",
        help="with --gateway-config: where the migration proxy (python -m extproc.migration.proxy) listens, "
        "for the models with migration = true (required when one has it)",
    )
    parser.add_argument(
        "--no-endpoint-header",
        action="store_true",
        help="do not tell clients which engine served them (the x-kvgate-endpoint response header)",
    )
    logs = parser.add_mutually_exclusive_group()
    logs.add_argument(
        "--access-log",
        default=defaults.access_log_path,
        metavar="PATH",
        help="Envoy's JSON-lines access log: a file, /dev/stdout or /dev/stderr (default %(default)s)",
    )
    logs.add_argument("--no-access-log", action="store_true", help="no access log")
    args = parser.parse_args(argv)
    try:
        extprocs = tuple(_hostport(a) for a in args.extproc)
    except ValueError:
        parser.error(f"--extproc: expected HOST:PORT (port 1 to 65535), got {args.extproc}")
    tls_only = (("--client-certs", args.client_certs), ("--write-sds", args.write_sds))
    without_tls = [flag for flag, given in tls_only if given]
    if without_tls and not args.secure:  # silently plaintext, with no client certificate asked for
        parser.error(f"{' and '.join(without_tls)} work with --secure (the TLS profile): add it")
    if args.max_retries < 0 or args.stream_idle_timeout <= 0 or args.trusted_hops < 0:
        parser.error("--max-retries and --trusted-hops must be >= 0 and --stream-idle-timeout > 0")
    # What Envoy itself would refuse when loading the config: refused here, naming the flag.
    import ipaddress
    import math

    ports = {"--listen-port": (args.listen_port, 0), "--admin-port": (args.admin_port, 0)}
    ports |= {"--extproc-port": (args.extproc_port, 1), "--stats-port": (args.stats_port, 1)}
    for flag, (port, least) in ports.items():
        if port is not None and not least <= port <= 65535:
            parser.error(f"{flag}: a port from {least} to 65535, got {port}")
    if not math.isfinite(args.stream_idle_timeout):
        parser.error(f"--stream-idle-timeout: a finite number of seconds, got {args.stream_idle_timeout}")
    if args.max_retries > _MAX_RETRIES:
        parser.error(f"--max-retries: at most {_MAX_RETRIES}, got {args.max_retries}")
    try:
        ipaddress.ip_address(args.listen_host)
    except ValueError:
        parser.error(
            f"--listen-host: an IP address (Envoy listens on addresses, not names), got {args.listen_host!r}"
        )
    auth = None
    tracing = None
    idle_timeouts: tuple[tuple[str, float], ...] = ()
    burst: tuple[BurstEndpoint, ...] = ()
    credentials: tuple[BurstCredential, ...] = ()
    migration = None
    if args.gateway_config:
        from pathlib import Path

        from extproc.config import load_config
        from kvgate.envoy.auth import EdgeAuth
        from kvgate.envoy.tracing import EnvoyTracing

        try:
            gateway = load_config(Path(args.gateway_config))
            auth, idle_timeouts = EdgeAuth.from_config(gateway), model_idle_timeouts(gateway)
            tracing = EnvoyTracing.from_settings(gateway.tracing)
            burst, credentials = gateway.burst, gateway.burst_credentials
            migration = _migration(gateway, args.migration_proxy)
        except ConfigError as exc:
            print(f"kvgate envoy-config: {exc}", file=sys.stderr)
            return 2
    tls = EnvoyTls(certs_dir=args.certs_dir, client_certs=args.client_certs) if args.secure else None
    try:
        rendered = render_yaml(
            EnvoyParams(
                listen_host=args.listen_host,
                listen_port=args.listen_port,
                admin_port=args.admin_port,
                admin_socket=args.admin_socket,
                stats_port=args.stats_port,
                extproc_host=args.extproc_host,
                extproc_port=args.extproc_port,
                extproc_addresses=extprocs,
                resilience=Resilience(
                    fail_open=args.fail_open,
                    max_retries=args.max_retries,
                    stream_idle_timeout_s=args.stream_idle_timeout,
                    model_idle_timeouts=idle_timeouts,
                ),
                tls=tls,
                auth=auth,
                access_log_path=None if args.no_access_log else args.access_log,
                endpoint_header=not args.no_endpoint_header,
                trusted_hops=args.trusted_hops,
                tracing=tracing,
                burst=burst,
                burst_credentials=credentials,
                migration=migration,
            )
        )
    except ConfigError as exc:  # a combination of flags and config the profile refuses
        print(f"kvgate envoy-config: {exc}", file=sys.stderr)
        return 2
    if tls is not None and args.write_sds:
        try:
            written = write_sds(tls)
        except ConfigError as exc:  # e.g. a --certs-dir that does not exist
            print(f"kvgate envoy-config: --write-sds: {exc}", file=sys.stderr)
            return 1
        for path in written:
            print(f"wrote {path}", file=sys.stderr)
    sys.stdout.write(rendered)
    return 0


#: The most retries ``kvgate envoy-config --max-retries`` renders (Envoy's ``num_retries`` is 32-bit).
_MAX_RETRIES = 2**32 - 1


def _hostport(value: str) -> tuple[str, int]:
    """``HOST:PORT`` as ``(host, port)``; an IPv6 address in brackets (``[::1]:5000``) loses them, as
    Envoy's ``socket_address`` takes the bare address (``[::1]`` would be looked up as a name)."""
    host, sep, port = value.rpartition(":")
    if len(host) > 2 and host[0] == "[" and host[-1] == "]":
        host = host[1:-1]
    if not sep or not host or not 1 <= int(port) <= 65535:
        raise ValueError(value)
    return host, int(port)


def _model(argv: list[str]) -> int:
    usage = "usage: kvgate model export GGUF OUTDIR [--force]"
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if argv[:1] != ["export"]:
        print(usage, file=sys.stderr)
        return 2
    return _lazy("engines.gguf")(argv[1:])


def _drain(argv: list[str]) -> int:
    from kvgate.policy_cli import drain_main

    return drain_main(argv)


def _lazy(module: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        import importlib

        main: Callable[[list[str]], int] = importlib.import_module(module).main
        return main(argv)

    return run


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "up": _lazy("kvgate.dev.up"),
    "extproc": _lazy("extproc.server"),
    "sim": _lazy("load.sim.server"),
    "model": _model,
    "envoy-config": _envoy_config,
    "oidc-dev": _lazy("kvgate.dev.oidc"),
    "apikey": _lazy("kvgate.apikey"),
    "certs": _lazy("certs.cli"),
    "bench": _lazy("load.bench.routing"),
    "agent": _lazy("agent.main"),
    "policy": _lazy("kvgate.policy_cli"),
    "drain": _drain,
    "etcd": _lazy("kvgate.etcdsec.cli"),
    "status": _lazy("kvgate.status_cli"),
    "kvcached": _lazy("kvcached.main"),
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"kvgate: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return command(args[1:])


if __name__ == "__main__":
    sys.exit(main())
