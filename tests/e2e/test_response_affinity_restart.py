"""End to end, ``previous_response_id`` affinity survives an ext_proc restart (a rolling upgrade): real
Envoy, the real ext_proc process and simulated replicas. Conversations are started, the ext_proc alone is
stopped (SIGTERM: it drains and writes its table to ``WORKDIR/affinity``, ``kvgate up``'s default
``state_dir``) and started again on the same ports; every continuation still goes to the replica that
produced its response (outcome ``hit`` in the new process's metrics). Without the file (removed before the
next restart) the same continuation finds nothing (outcome ``unknown``) and is scored as usual. A SIGKILL
(a crash: no last snapshot) keeps what the timed snapshot (``snapshot_interval_s``) held."""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extproc.affinity.persist import read
from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import FAST_SIM
from tests.e2e.test_burst import gateway
from tests.e2e.test_disagg import samples
from tests.e2e.test_gateway import LONG
from tests.e2e.test_response_affinity import FOLLOW_UP, post, wait_learned
from tests.polling import poll

pytestmark = pytest.mark.e2e


def state_file(stack: Stack) -> Path:
    """The ext_proc's snapshot: ``kvgate up``'s ``state_dir``, the one worker's file."""
    return stack.workdir / "affinity" / "affinity-extproc.json"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        replicas=3,
        port=0,
        sim_args=FAST_SIM,
        workdir=tmp_path_factory.mktemp("restart"),
        overlay={"response_affinity": {"snapshot_interval_s": 0.2}},  # the timer, for the SIGKILL test
    )
    with Stack(options) as running:
        yield running


def restart_extproc(stack: Stack, before_start: Path | None = None, *, kill: bool = False) -> None:
    """SIGTERM the ext_proc (it drains and snapshots; ``kill``: SIGKILL, no last snapshot), optionally
    remove ``before_start``, start it again on its pinned ports, and poll until a request passes Envoy
    again."""
    assert stack.extproc is not None
    if kill:
        os.kill(stack.extproc.pid, signal.SIGKILL)
        assert stack.extproc.child.proc.wait(30) == -signal.SIGKILL
    else:
        assert stack.extproc.stop() == 0
    if before_start is not None:
        before_start.unlink()
    stack.extproc.spawn()
    stack.extproc.await_ready()

    def served() -> bool | None:
        try:
            got = httpx.post(
                f"{stack.url}/v1/chat/completions",
                json={
                    "model": "SmolLM2-135M-Instruct",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1,
                },
                timeout=10,
            )
        except httpx.HTTPError:
            return None
        return True if got.status_code == 200 else None

    poll(served, 60, "Envoy routing through the restarted ext_proc", interval_s=0.1)


def test_continuations_reach_their_producer_after_an_extproc_restart(stack: Stack) -> None:
    producers, ids = [], []
    for i in range(6):
        before = gateway(stack, "kvgate_response_affinity_learned_total")
        first = post(stack, {"input": f"Restart {i}: {i * 7919} is where we start. " + LONG})
        wait_learned(stack, before + 1)
        producers.append(first.headers["x-kvgate-endpoint"])
        ids.append(first.json()["id"])
    assert len(set(producers)) >= 2, producers  # so the common follow-up prompt alone could not do it

    restart_extproc(stack)
    state = state_file(stack)
    assert stat.S_IMODE(state.stat().st_mode) == 0o600
    assert gateway(stack, "kvgate_response_affinity_restored_total") == len(ids)  # the new process's
    assert gateway(stack, "kvgate_response_affinity_state_errors_total") == 0
    followed = [
        post(stack, {"input": FOLLOW_UP, "previous_response_id": rid}).headers["x-kvgate-endpoint"]
        for rid in ids
    ]
    assert followed == producers
    assert gateway(stack, "kvgate_response_affinity_requests_total", outcome="hit") == len(ids)

    restart_extproc(stack, before_start=state)  # the control: the same restart without the file
    assert gateway(stack, "kvgate_response_affinity_entries") == 0
    post(stack, {"input": FOLLOW_UP, "previous_response_id": ids[0]})
    assert gateway(stack, "kvgate_response_affinity_requests_total", outcome="unknown") == 1
    assert gateway(stack, "kvgate_response_affinity_requests_total", outcome="hit") == 0


def test_a_killed_extproc_keeps_what_its_last_timed_snapshot_held(stack: Stack) -> None:
    """SIGKILL (a crash): no shutdown snapshot, but the timer wrote the table after the entry was learned."""
    learned = gateway(stack, "kvgate_response_affinity_learned_total")
    first = post(stack, {"input": "A crash is coming: 104729 is where we start. " + LONG})
    wait_learned(stack, learned + 1)
    rid = first.json()["id"]

    def snapshotted() -> bool | None:
        records = read(state_file(stack), 1 << 24)  # never torn (atomic rename): no StateError here
        return True if records and any(r[1] == rid for r in records) else None

    poll(snapshotted, 30, "a timed snapshot holding the new entry", interval_s=0.05)
    restart_extproc(stack, kill=True)
    assert gateway(stack, "kvgate_response_affinity_restored_total") >= 1
    hits = gateway(stack, "kvgate_response_affinity_requests_total", outcome="hit")
    nxt = post(stack, {"input": FOLLOW_UP, "previous_response_id": rid})
    assert nxt.headers["x-kvgate-endpoint"] == first.headers["x-kvgate-endpoint"]
    assert gateway(stack, "kvgate_response_affinity_requests_total", outcome="hit") == hits + 1


def test_each_worker_keeps_its_own_file(tmp_path: Path) -> None:
    """``[extproc] workers = 2``: each worker learns every answer (Envoy's completion log goes to both) and
    writes ``affinity-extproc-<i>.json``; one restarted alone reloads its own."""
    options = StackOptions(
        replicas=2,
        port=0,
        sim_args=FAST_SIM,
        workdir=tmp_path,
        extprocs=2,
        overlay={"response_affinity": {"snapshot_interval_s": 0.2}},
    )
    with Stack(options) as stack:
        metrics = [f"http://127.0.0.1:{p['metrics']}/metrics" for p in stack.extproc_listeners]

        def learned_by_both() -> bool | None:
            got = [samples(m).get(("kvgate_response_affinity_learned_total", ()), 0.0) for m in metrics]
            return True if min(got) >= 1 else None

        rid = post(stack, {"input": "Two workers: " + LONG}).json()["id"]
        poll(learned_by_both, 20, "the answer learned by both workers", interval_s=0.05)
        files = [tmp_path / "affinity" / f"affinity-{e.name}.json" for e in stack.extprocs]
        assert [e.name for e in stack.extprocs] == ["extproc-0", "extproc-1"]

        def both_written() -> bool | None:
            return True if all((read(f, 1 << 24) or []) for f in files) else None

        poll(both_written, 30, "both workers' snapshots", interval_s=0.05)
        assert all(any(r[1] == rid for r in read(f, 1 << 24) or []) for f in files)
        worker = stack.extprocs[1]
        assert worker.stop() == 0
        worker.spawn()
        worker.await_ready()
        assert samples(metrics[1])[("kvgate_response_affinity_restored_total", ())] == 1
