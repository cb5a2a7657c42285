"""The cascades' preroute learners across restarts (extproc/cascade/persist.py, Cascader.saved/restore and
runtime/statefile.py): round trip, a changed cascade starts afresh, learners waiting for their policy, bad
files ignored, file modes, the ``[cascade]`` config."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import stat
import types
import zlib
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from contracts.errors import ConfigError
from extproc.cascade.gate import Verdict
from extproc.cascade.metrics import PrerouteCollector
from extproc.cascade.persist import PrerouteState, decode, encode, read, state_path
from extproc.cascade.plan import CascadePolicy, Cascader, Run
from extproc.cascade.prior import COUNTS_BYTES, FEATURES, SLOTS, PrerouteSpec, SavedPrior, features
from extproc.cascade.spec import CascadeSpec, parse_cascade_config
from extproc.config import parse_config
from runtime.statefile import StateError

PREROUTE = PrerouteSpec(above=0.7, min_seen=2, explore=0.0)
SPEC = CascadeSpec(("small", "large"), -0.5, preroute=PREROUTE)
HARD = "[hard] an uncertain question"


def cascader(**cascades: CascadeSpec) -> Cascader:
    return Cascader(CascadePolicy(types.MappingProxyType(cascades)))


def judged(c: Cascader, text: str, *, escalated: bool, model: str = "auto") -> None:
    """One request for ``model`` whose first step the gate judged."""
    run = c.start(model, {"model": model, "messages": [{"role": "user", "content": text}]}, chat=True, now=0)
    assert isinstance(run, Run) and not run.preskipped
    run.verdicts.append(("small", Verdict(-2.0 if escalated else -0.1, not escalated, "gate")))
    c.learn(run)


def skips(c: Cascader, text: str, model: str = "auto") -> bool:
    run = c.start(model, {"model": model, "messages": [{"role": "user", "content": text}]}, chat=True, now=0)
    assert run is not None
    return run.preskipped


async def taught(path: Path) -> tuple[Cascader, PrerouteState]:
    """A process whose learner for ``auto`` skips hard requests, its file (none before) read first."""
    c = cascader(auto=SPEC)
    state = PrerouteState(c, path, 30.0, wall=lambda: 1e9)
    assert await state.load() == 0
    assert not await state.save()  # nothing learnt: nothing written
    for i in range(2):
        judged(c, f"{HARD} {i}", escalated=True)
    judged(c, "[easy] hello", escalated=False)
    assert skips(c, f"{HARD} 9")
    return c, state


async def test_a_restarted_gateway_skips_what_it_had_learnt_to_skip(tmp_path: Path) -> None:
    path = state_path(tmp_path / "state", "extproc-0")
    before, state = await taught(path)
    assert await state.save() and state.saves == 1
    assert not await state.save()  # unchanged: not written again

    after = cascader(auto=SPEC)  # a new process, the same policy
    assert not skips(after, f"{HARD} 9")  # a cold learner
    after = cascader(auto=SPEC)
    assert await PrerouteState(after, path, 30.0).load() == 1
    assert after.priors["auto"].dump() == before.priors["auto"].dump()
    assert after.priors["auto"].verdicts == 3
    assert skips(after, f"{HARD} 9") and not skips(after, "[easy] hello")


@pytest.mark.parametrize(
    "changed",
    [
        CascadeSpec(("tiny", "large"), -0.5, preroute=PREROUTE),  # another first step
        CascadeSpec(("small", "large"), -0.5, preroute=PrerouteSpec(above=0.8, min_seen=2, explore=0.0)),
        CascadeSpec(("small", "large"), -0.5),  # no preroute any more
        CascadeSpec(("small", "large"), -0.8, preroute=PREROUTE),  # another threshold
        CascadeSpec(("small", "large"), -0.5, "min", preroute=PREROUTE),  # another statistic
        CascadeSpec(("small", "large"), -0.5, "first_k", 4, preroute=PREROUTE),
    ],
)
async def test_a_changed_cascade_starts_afresh(tmp_path: Path, changed: CascadeSpec) -> None:
    """As a policy change would: the learner's counts were verdicts of another first step or gate, or
    counted under another preroute rule."""
    path = tmp_path / "preroute-extproc.json"
    _, state = await taught(path)
    await state.aclose()  # the last write of a graceful shutdown
    after = cascader(auto=changed)
    assert await PrerouteState(after, path, 30.0).load() == 0
    assert not after.pending
    if changed.preroute is not None:
        assert after.priors["auto"].verdicts == 0 and not skips(after, f"{HARD} 9")


@pytest.mark.parametrize(
    ("changed", "kept"),
    [
        (CascadeSpec(("small", "huge"), -0.5, preroute=PREROUTE), True),  # another last step
        (CascadeSpec(("small", "large"), -0.5, timeout_s=5, preroute=PREROUTE), True),
        (CascadeSpec(("small", "large"), -0.3, preroute=PREROUTE), False),  # escalates more now
        (CascadeSpec(("small", "large"), -0.5, "first_k", 4, preroute=PREROUTE), False),
        (CascadeSpec(("tiny", "large"), -0.5, preroute=PREROUTE), False),
    ],
)
def test_a_policy_change_keeps_a_learner_only_under_the_same_verdict_rule(
    changed: CascadeSpec, kept: bool
) -> None:
    """A verdict is the gate's on the first step: what the learner learnt holds while the first step and
    the gate (threshold, statistic, k) stay; a change of the later steps or the timeout keeps it."""
    c = cascader(auto=SPEC)
    for i in range(2):
        judged(c, f"{HARD} {i}", escalated=True)
    prior = c.priors["auto"]
    c.apply(CascadePolicy(types.MappingProxyType({"auto": changed})))
    assert (c.priors["auto"] is prior) is kept
    assert skips(c, f"{HARD} 9") is kept


async def test_a_learner_waits_for_etcds_policy(tmp_path: Path) -> None:
    """With etcd, the policy comes after the start: a learner whose cascade the policy in force does not
    name waits in ``pending`` (kept in every snapshot meanwhile) for the next policy applied, which holds
    the whole policy: it takes the learner back, or drops it when that cascade changed or is gone. Without
    etcd the policy in force is the last: such a learner is dropped at once."""
    path = tmp_path / "preroute-extproc.json"
    _, state = await taught(path)
    await state.aclose()
    early = cascader(other=SPEC)  # the policy file's cascade; auto's is in etcd
    early_state = PrerouteState(early, path, 30.0, wait=True)
    assert await early_state.load() == 0
    assert set(early.pending) == {"auto"}
    assert not await early_state.save()  # the file holds it
    judged(early, HARD, escalated=True, model="other")
    assert await early_state.save()  # a snapshot before etcd's policy came keeps the waiting one
    assert sorted(s.model for s in read(path) or []) == ["auto", "other"]

    restarted = cascader()
    assert await PrerouteState(restarted, path, 30.0, wait=True).load() == 0
    restarted.apply(CascadePolicy(types.MappingProxyType({"auto": SPEC})))  # etcd's, without "other"
    assert not restarted.pending and skips(restarted, f"{HARD} 9")
    assert [s.model for s in restarted.saved()] == ["auto"]  # "other" is gone

    changed = cascader()
    assert await PrerouteState(changed, path, 30.0, wait=True).load() == 0
    changed.apply(CascadePolicy(types.MappingProxyType({"auto": CascadeSpec(("tiny", "large"), -0.5)})))
    assert not changed.pending and "auto" not in changed.priors and changed.saved() == []

    static = cascader()
    assert await PrerouteState(static, path, 30.0).load() == 0
    assert not static.pending and static.saved() == []


async def test_a_learner_learnt_under_etcds_override_waits_for_it(tmp_path: Path) -> None:
    """The config file names ``auto`` with one gate, etcd overrides it with another, and the learner
    learnt under etcd's: at the next start (the file's policy first) it does not fit the policy in force,
    so it waits for etcd's, and every snapshot meanwhile holds it, not the empty learner serving the
    file's cascade."""
    path = tmp_path / "preroute-extproc.json"
    override = CascadeSpec(("small", "large"), -0.8, preroute=PREROUTE)
    learnt = cascader(auto=override)
    state = PrerouteState(learnt, path, 30.0)
    await state.load()
    for i in range(2):
        judged(learnt, f"{HARD} {i}", escalated=True)
    await state.aclose()

    restarted = cascader(auto=SPEC)  # the config file's gate
    again = PrerouteState(restarted, path, 30.0, wait=True)
    assert await again.load() == 0 and set(restarted.pending) == {"auto"}
    assert not skips(restarted, f"{HARD} 9")  # the file's cascade: its own (empty) learner
    judged(restarted, "[easy] hello", escalated=False)
    assert await again.save()
    assert [s.rule for s in read(path) or []] == [override.rule]  # the one etcd's policy may take back
    restarted.apply(CascadePolicy(types.MappingProxyType({"auto": override})))
    assert not restarted.pending and restarted.restored == 1 and skips(restarted, f"{HARD} 9")

    static = cascader(auto=SPEC)  # without etcd: the policy in force is the last, the learner is gone
    assert await PrerouteState(static, path, 30.0).load() == 0
    assert not static.pending and [s.rule for s in static.saved()] == [SPEC.rule]


async def test_a_snapshot_that_cannot_be_encoded_is_counted_and_the_timer_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    c = cascader(auto=SPEC)
    state = PrerouteState(c, tmp_path / "p.json", 0.01)
    await state.load()
    rounds, second = [], asyncio.Event()

    def capture() -> Callable[[], bytes]:
        rounds.append(1)
        if len(rounds) == 2:
            second.set()
        return lambda: orjson.dumps(2**64)  # what orjson refuses (as a count past 2**64 would be)

    state._capture = capture
    judged(c, HARD, escalated=True)
    state.start()
    with caplog.at_level(logging.WARNING, logger="runtime.statefile"):
        await asyncio.wait_for(second.wait(), 30)  # a second round: the timer outlived the first
        await state.aclose()  # and the shutdown goes on
    assert state.saves == 0 and state.errors["save"] >= 2 and "cannot encode a snapshot" in caplog.text


def test_a_fifo_at_the_path_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "preroute-extproc.json"
    os.mkfifo(fifo)
    with pytest.raises(StateError, match="not a regular file"):
        read(fifo)  # open() of a FIFO with no writer would block until one came


async def test_every_verdict_heard_from_a_sibling_is_a_change_to_write(tmp_path: Path) -> None:
    c = cascader(auto=SPEC)
    state = PrerouteState(c, tmp_path / "p.json", 30.0)
    await state.load()
    c.heard("auto", features(HARD), True)
    assert await state.save()
    c.heard("other", features(HARD), True)  # no learner for it: nothing changed
    assert not await state.save()


def saved_doc(table: bytes, **learner: object) -> bytes:
    """A snapshot of one learner for ``auto`` with counts ``table``, ``learner``'s fields replacing its
    own."""
    one = {
        "model": "auto",
        "rule": {"first_step": "small", "gate": "logprob", "threshold": -0.5, "stat": "mean", "k": None},
        "preroute": PREROUTE.to_json(),
        "verdicts": 3,
        "counts": base64.b64encode(zlib.compress(table)).decode(),
        **learner,
    }
    doc = {"format": "kvgate.cascade_preroute", "version": 2, "written_at": 0, "features": FEATURES}
    return orjson.dumps({**doc, "learners": [one]})


def counts_with(slot_seen: float, slot_escalated: float) -> bytes:
    values = array("d", bytes(COUNTS_BYTES))
    values[5], values[2 * SLOTS + 5] = slot_seen, slot_escalated
    return values.tobytes()


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b'{"format": "kvgate.cascade_preroute", "vers', "not JSON"),
        (b"[]", "not a preroute snapshot"),
        (orjson.dumps({"format": "kvgate.cascade_preroute", "version": 3}), "format version 3"),
        (saved_doc(counts_with(1, 1)).replace(b'"version":2', b'"version":1'), "format version 1"),
        (saved_doc(counts_with(1, 1), rule={"first_step": "small"}), "malformed verdict rule"),
        (saved_doc(counts_with(1, 1), rule=None), "malformed verdict rule"),
        (saved_doc(counts_with(1, 1)).replace(b"crc32", b"xxh64"), "other features"),
        (saved_doc(counts_with(1, 2)), "out of range"),  # escalated more often than seen
        (saved_doc(counts_with(-1, 0)), "out of range"),
        (saved_doc(counts_with(float("nan"), 0)), "out of range"),
        (saved_doc(counts_with(1, 1)[:-8]), "out of range"),  # cut short
        (saved_doc(counts_with(1, 1) + bytes(8)), "out of range"),  # longer
        (saved_doc(counts_with(1, 1), counts="not base64!"), "out of range"),
        (saved_doc(counts_with(1, 1), preroute={"above": 2}), "out of range"),
        (saved_doc(counts_with(1, 1), verdicts=-1), "malformed"),
        (saved_doc(counts_with(1, 1), verdicts=2**64 - 1), "malformed"),  # could not be written again
        (saved_doc(counts_with(1001, 0)), "out of range"),  # over the cap: never a learner's
        (orjson.loads(saved_doc(counts_with(1, 1))), "twice"),  # see below: two learners for "auto"
        (saved_doc(counts_with(1, 1), model=7), "malformed"),
    ],
)
async def test_a_bad_file_is_logged_without_its_content_and_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes | dict[str, Any], why: str
) -> None:
    path = tmp_path / "preroute-extproc.json"
    if isinstance(content, dict):  # one model's learner twice
        content = orjson.dumps({**content, "learners": content["learners"] * 2})
    path.write_bytes(content)
    c = cascader(auto=SPEC)
    state = PrerouteState(c, path, 30.0)
    with caplog.at_level(logging.WARNING, logger="extproc.cascade.persist"):
        assert await state.load() == 0
    assert state.errors == {"load": 1, "save": 0}
    assert why in caplog.text and "uncertain" not in caplog.text
    assert c.priors["auto"].verdicts == 0 and not c.pending
    assert await state.save()  # the next snapshot replaces it
    assert read(path) is not None


def test_a_well_formed_file_reads_back() -> None:
    """The bad files above are this one, each with one thing wrong."""
    (got,) = decode(saved_doc(counts_with(2, 1)))
    assert got == SavedPrior("auto", SPEC.rule, PREROUTE, 3, counts_with(2, 1))


async def test_the_file_is_private_and_compressed(tmp_path: Path) -> None:
    directory = tmp_path / "state"
    path = state_path(directory, "extproc-1")
    assert path == directory / "preroute-extproc-1.json"
    _, state = await taught(path)
    old = os.umask(0)
    try:
        assert await state.save()
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert os.listdir(directory) == [path.name]
    assert path.stat().st_size < 64 * 1024  # 2 MiB of counts, mostly zeros
    doc = orjson.loads(path.read_bytes())
    assert doc["format"] == "kvgate.cascade_preroute" and doc["written_at"] == 1e9
    assert HARD.encode() not in path.read_bytes()  # counts of hashed words, never the text


async def test_a_failed_write_is_counted_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    c = cascader(auto=SPEC)
    state = PrerouteState(c, blocker / "p.json", 30.0)
    assert await state.load() == 0 and state.errors["load"] == 1
    judged(c, HARD, escalated=True)
    assert not await state.save() and state.errors["save"] == 1


def test_encode_keeps_every_learner(tmp_path: Path) -> None:
    c = cascader(auto=SPEC, other=SPEC)
    path = tmp_path / "p.json"
    path.write_bytes(encode(c.saved(), 5.0))
    assert sorted(s.model for s in read(path) or []) == ["auto", "other"]


def test_the_config_names_a_directory_and_an_interval() -> None:
    assert parse_cascade_config(None).state_dir is None
    got = parse_cascade_config({"state_dir": "/var/lib/kvgate/cascade", "snapshot_interval_s": 5})
    assert got.state_dir == "/var/lib/kvgate/cascade" and got.snapshot_interval_s == 5.0
    assert parse_cascade_config({"state_dir": ""}).state_dir is None
    for bad, where in [
        ({"snapshot_interval_s": 0}, "snapshot_interval_s"),
        ({"state_dir": 7}, "state_dir"),
        ({"state_dir": "a\0b"}, "state_dir"),
        ({"stat_dir": "/x"}, "stat_dir"),
    ]:
        with pytest.raises(ConfigError, match=where):
            parse_cascade_config(bad)
    assert parse_config({"cascade": {"state_dir": "/s"}}).cascade.state_dir == "/s"
    with pytest.raises(ConfigError, match=r"cascade\.snapshot_interval_s"):
        parse_config({"cascade": {"snapshot_interval_s": -1}})


async def test_the_learners_and_their_file_are_in_the_metrics(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    _, state = await taught(path)
    await state.aclose()
    c = cascader(auto=SPEC)
    kept = PrerouteState(c, path, 30.0)
    await kept.load()
    registry = CollectorRegistry()
    registry.register(PrerouteCollector(c, kept))
    value = registry.get_sample_value
    assert value("kvgate_cascade_preroute_verdicts", {"model": "auto"}) == 3
    assert value("kvgate_cascade_preroute_restored_total") == 1
    assert value("kvgate_cascade_preroute_snapshots_total") == 0
    assert value("kvgate_cascade_preroute_state_errors_total", {"op": "load"}) == 0
    alone = CollectorRegistry()
    alone.register(PrerouteCollector(c))  # no state_dir: the learners only
    assert alone.get_sample_value("kvgate_cascade_preroute_verdicts", {"model": "auto"}) == 3
    assert alone.get_sample_value("kvgate_cascade_preroute_snapshots_total") is None
