"""``kvgate``: one entry point, one subcommand per component."""

from __future__ import annotations

import sys
from collections.abc import Callable

USAGE = """usage: kvgate COMMAND [ARGS]

commands:
  up              run Envoy + the ext_proc + simulated (or given) engines locally
  extproc         run the ext_proc endpoint picker (--config FILE)
  sim             run simulated vLLM replicas
  envoy-config    print the Envoy bootstrap (YAML) for given ports
  model           model assets: `kvgate model export GGUF OUTDIR`
"""


def _envoy_config(argv: list[str]) -> int:
    import argparse

    from kvgate.envoyconf import EnvoyParams, render_yaml

    defaults = EnvoyParams()
    parser = argparse.ArgumentParser(prog="kvgate envoy-config")
    parser.add_argument("--listen-port", type=int, default=defaults.listen_port)
    parser.add_argument("--admin-port", type=int, default=defaults.admin_port)
    parser.add_argument("--extproc-host", default=defaults.extproc_host)
    parser.add_argument("--extproc-port", type=int, default=defaults.extproc_port)
    args = parser.parse_args(argv)
    sys.stdout.write(
        render_yaml(
            EnvoyParams(
                listen_port=args.listen_port,
                admin_port=args.admin_port,
                extproc_host=args.extproc_host,
                extproc_port=args.extproc_port,
            )
        )
    )
    return 0


def _lazy(module: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        import importlib

        main: Callable[[list[str]], int] = importlib.import_module(module).main
        return main(argv)

    return run


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "up": _lazy("kvgate.up"),
    "extproc": _lazy("extproc.server"),
    "sim": _lazy("load.sim.server"),
    "model": lambda argv: _lazy("extproc.gguf")(argv[1:] if argv[:1] == ["export"] else argv),
    "envoy-config": _envoy_config,
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
