"""The simulator started as SGLang is: ``python -m load.sim.sglang_launch`` takes the command line the
node agent renders for an engine of kind ``sglang`` (:mod:`engines.sglang`, ``sglang.launch_server``'s
flags) and serves one simulated replica in SGLang's disaggregation mode (:mod:`load.sim.bootstrap`).

It exists so that an agent can run a prefill/decode fleet of SGLang's protocol without a GPU: the agent's
config names ``kind = "sglang"`` with ``command = ["python", "-m", "load.sim.sglang_launch"]``, and
everything else is the real path: the agent renders SGLang's argv, picks the bootstrap port (its side
port) and registers the engine in etcd with engine kind ``sglang`` and that ``bootstrap_port``.

Flags translated (SGLang -> the simulator's, ``load.sim.server``):

=======================================  ==============================================================
``--model-path DIR``                     ``--model-dir DIR`` (a tokenizer directory)
``--served-model-name NAME``             ``--model NAME``
``--page-size N``                        ``--block-size N``
``--max-running-requests N``             ``--max-num-seqs N``
``--context-length N``                   ``--max-model-len N``
``--kv-events-config JSON``              the same JSON with ``enable_kv_cache_events`` set when its
                                         ``publisher`` is ``zmq`` (SGLang publishes whenever the flag is
                                         given; vLLM needs the key)
``--disaggregation-mode``,               passed on (the simulator has SGLang's flags)
``--disaggregation-bootstrap-port``,
``--host``, ``--port``
``--enable-metrics``                     dropped: the simulator always serves ``/metrics`` (SGLang's names
                                         besides vLLM's in disaggregation mode)
``--disaggregation-transfer-backend``    dropped: the KV transfer is the simulator's timed wait
=======================================  ==============================================================

Any other argument (the engine's ``args``) goes to the simulator as given. SGLang flags the agent renders
for features the simulator lacks (LoRA, HiCache) are refused with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from load.sim import server

#: SGLang flag -> the simulator's flag, for flags that take one value.
RENAMED = {
    "--model-path": "--model-dir",
    "--served-model-name": "--model",
    "--page-size": "--block-size",
    "--max-running-requests": "--max-num-seqs",
    "--context-length": "--max-model-len",
    "--disaggregation-mode": "--disaggregation-mode",
    "--disaggregation-bootstrap-port": "--disaggregation-bootstrap-port",
    "--host": "--host",
    "--port": "--port",
}
#: Flags taking a value that the simulator has no use for.
DROPPED = ("--disaggregation-transfer-backend",)


def translate(argv: list[str]) -> list[str]:
    """The simulator's argv for SGLang's ``argv`` (module docstring). Raises ``SystemExit(2)`` for a flag
    of a feature the simulator does not have."""
    p = argparse.ArgumentParser(prog="python -m load.sim.sglang_launch", allow_abbrev=False)
    for flag in (*RENAMED, *DROPPED, "--kv-events-config"):
        p.add_argument(flag)
    p.add_argument("--enable-metrics", action="store_true")
    args, rest = p.parse_known_args(argv)
    unsupported = [a for a in rest if a in ("--enable-lora", "--enable-hierarchical-cache")]
    if unsupported:
        p.error(f"the simulator does not model {', '.join(unsupported)}")
    out: list[str] = []
    for flag, to in RENAMED.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out += [to, value]
    if args.kv_events_config is not None:
        config = json.loads(args.kv_events_config)
        if config.get("publisher") == "zmq":
            config.setdefault("enable_kv_cache_events", True)
        out += ["--kv-events-config", json.dumps(config)]
    return [*out, *rest]


def main(argv: list[str] | None = None) -> int:
    return server.main(translate(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
