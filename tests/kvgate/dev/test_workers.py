"""``kvgate up`` and ``[extproc] workers``: the config's worker count is the default for ``--extprocs``,
and the workers it starts find each other (extproc/control/siblings.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.dev import upcli
from kvgate.dev.options import DEFAULT_MODEL
from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import FAST_SIM
from tests.polling import until

pytestmark = pytest.mark.e2e


def test_extprocs_flag_defaults_to_the_config() -> None:
    assert upcli.parser(DEFAULT_MODEL).parse_args([]).extprocs is None  # [extproc] workers decides
    assert upcli.parser(DEFAULT_MODEL).parse_args(["--extprocs", "3"]).extprocs == 3


async def test_config_workers_start_that_many_ext_procs_that_find_each_other(tmp_path: Path) -> None:
    options = StackOptions(
        replicas=1, port=0, sim_args=FAST_SIM, workdir=tmp_path, overlay={"extproc": {"workers": 2}}
    )
    with Stack(options) as stack:
        assert [e.name for e in stack.extprocs] == ["extproc-0", "extproc-1"]
        assert len(stack.extproc_listeners) == 2
        siblings = tmp_path / "siblings"
        assert siblings.stat().st_mode & 0o777 == 0o700
        logs = {name: tmp_path / f"{name}.log" for name in ("extproc-0", "extproc-1")}

        def met() -> bool:
            text = {name: path.read_text() for name, path in logs.items()}
            return "heard from extproc-1" in text["extproc-0"] and "heard from extproc-0" in text["extproc-1"]

        await until(met, 10.0)
        # each worker's datagram socket, and the status URL it announces (extproc/status/peers.py)
        assert sorted(p.name for p in siblings.glob("*.sock")) == ["extproc-0.sock", "extproc-1.sock"]
        assert {p.name for p in siblings.iterdir()} <= {
            "extproc-0.sock",
            "extproc-1.sock",
            "extproc-0.status",
            "extproc-1.status",
        }
