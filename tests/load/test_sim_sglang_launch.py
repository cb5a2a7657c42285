"""``load.sim.sglang_launch``: the command line the node agent renders for an SGLang engine becomes the
simulator's, each flag parsed by the simulator's own parser (SGLang's disaggregation flags included)."""

from __future__ import annotations

import json

import pytest

from load.sim import server
from load.sim.sglang_launch import translate
from tests.agent.test_launch import engine, launch_of


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_agents_sglang_argv_becomes_the_simulators(role: str) -> None:
    command = ("python", "-m", "load.sim.sglang_launch")
    launch = launch_of(engine("sglang", role, "nixl", command=command, args=("--time-scale", "0.1")))
    assert launch.argv[:3] == command
    argv = translate(list(launch.argv[3:]))
    args = server.build_parser().parse_args(argv)  # every flag the simulator's own
    assert (args.model, str(args.model_dir), args.port, args.block_size) == ("served", "org/model", 8100, 16)
    assert (args.disaggregation_mode, args.time_scale) == (role, 0.1)
    assert args.disaggregation_bootstrap_port == (
        5600 if role == "prefill" else server.DEFAULT_BOOTSTRAP_PORT
    )
    events = json.loads(args.kv_events_config)
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"  # SGLang: on when given
    assert "--disaggregation-transfer-backend" not in argv and "--enable-metrics" not in argv


def test_features_the_simulator_lacks_are_refused() -> None:
    with pytest.raises(SystemExit) as exc:
        translate(["--model-path", "m", "--enable-hierarchical-cache"])
    assert exc.value.code == 2
