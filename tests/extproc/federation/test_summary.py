"""Prefix summaries: sampled depths, Bloom filter sizing, false-positive rate, leads, the builder."""

from __future__ import annotations

import math
import random

import pytest

from contracts.digest import Digest, block_digests, chain_seed
from contracts.federation import (
    MAX_REPORT_BYTES,
    MAX_REPORT_MODELS,
    FederationWireError,
    ModelSummary,
    Report,
    decode_report,
    encode,
)
from extproc.federation.summary import (
    DEFAULT_BITS_PER_ENTRY,
    ModelLoad,
    SummaryBuilder,
    build_bits,
    contains,
    depths,
    false_positive_rate,
    lead,
    sampled,
    sizing,
)

SEED = chain_seed("m")


def chain(n_blocks: int, start: int = 0, block: int = 4) -> list[Digest]:
    return block_digests(SEED, list(range(start, start + n_blocks * block)), block)


def summary(entries: list[bytes], bits_per_entry: int = DEFAULT_BITS_PER_ENTRY) -> ModelSummary:
    size, k = sizing(len(entries), bits_per_entry)
    return ModelSummary("m", 4, k, len(entries), build_bits(entries, size, k), 0.0, 1)


@pytest.mark.parametrize(
    ("blocks", "expected"), [(0, []), (1, [1]), (3, [1, 2]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8])]
)
def test_depths(blocks: int, expected: list[int]) -> None:
    assert depths(blocks) == expected


def test_sampled_takes_the_digest_at_each_depth() -> None:
    c = chain(10)
    assert sampled(c) == [c[0], c[1], c[3], c[7]]


@pytest.mark.parametrize(
    ("entries", "size", "k"), [(0, 64, 16), (10, 64, 16), (1000, 2048, 11), (1024, 2048, 11)]
)
def test_sizing(entries: int, size: int, k: int) -> None:
    assert sizing(entries) == (size, k)


def test_sizing_caps_the_size() -> None:
    size, k = sizing(10**8)
    assert size == 4 * 1024 * 1024 and k == 1


def test_no_false_negatives_and_measured_rate_near_the_formula() -> None:
    rng = random.Random(1)
    members = [rng.randbytes(16) for _ in range(2000)]
    s = summary(members, bits_per_entry=8)  # a loose filter, so the rate is measurable
    assert all(contains(s, d) for d in members)
    trials = 100_000
    hits = sum(contains(s, rng.randbytes(16)) for _ in range(trials))
    expected = false_positive_rate(len(members), len(s.bits), s.hashes)
    assert 0.5 * expected < hits / trials < 1.5 * expected
    # the documented default: 16 bits per entry, 11 probes -> about 0.046 %
    assert false_positive_rate(1000, 2000, 11) == pytest.approx((1 - math.exp(-11 * 1000 / 16000)) ** 11)
    assert false_positive_rate(1000, 2000, 11) < 0.0005


def test_lead_is_the_deepest_sampled_depth_held() -> None:
    c = chain(40)
    s = summary(sampled(c[:20]))  # the peer holds 20 blocks: depths 1, 2, 4, 8, 16 noted
    assert lead(s, c) == 16
    assert lead(s, c[:3]) == 2
    assert lead(s, chain(40, start=10_000)) == 0  # another prompt
    assert lead(summary([]), c) == 0


def test_summary_round_trips_the_wire() -> None:
    s = summary(sampled(chain(16)))
    r = decode_report(encode(Report("b", 1.0, 3.0, [s])))
    assert r.models[0] == s


def test_builder_keeps_only_held_digests_per_model_and_forgets_the_rest() -> None:
    b = SummaryBuilder(capacity=100)
    c1, c2 = chain(8), chain(8, start=500)
    b.note("m", c1)
    b.note("other", c2)
    held = set(sampled(c1)) | set(sampled(c2)[:2])
    loads = {"m": ModelLoad(0.1, 2), "other": ModelLoad(0.0, 1), "idle": ModelLoad(0.0, 0)}
    out = {s.model: s for s in b.build(4, loads, held.__contains__)}
    assert lead(out["m"], c1) == 8 and out["m"].queue_wait_s == 0.1 and out["m"].endpoints == 2
    assert lead(out["other"], c2) == 2
    assert out["idle"].entries == 0
    assert len(b) == 4 + 4  # the unheld ones are kept, only left out of this summary
    everything = {s.model: s for s in b.build(4, loads, lambda d: True)}
    assert lead(everything["other"], c2) == 8  # held again (an index resync): back in the summary


def test_builder_is_bounded() -> None:
    b = SummaryBuilder(capacity=3)
    b.note("m", chain(16))  # 5 sampled
    assert len(b) == 3


@pytest.mark.parametrize(
    "report",
    [
        Report("b", 1.0, 3.0, [ModelSummary("m", 16, 11, 1, bytes(64), math.nan, 1)]),  # NaN read as 0 before
        Report("b", 1.0, 3.0, [ModelSummary("m", 16, 11, 1, bytes(64), math.inf, 1)]),
        Report("b", 1.0, 3.0, [ModelSummary("m", 16, 11, 1, bytes(64), -math.inf, 1)]),
        Report("b", 1.0, 3.0, [ModelSummary("m", 16, 11, 1, bytes(64), -1.0, 1)]),
        Report("b", 1.0, math.inf, []),
        Report("b", 1.0, math.nan, []),
        Report("b", math.nan, 3.0, []),
        Report("b", 1.0, 3.0, [ModelSummary("m", 16, 11, 1, bytes(64), 0.0, 1)] * 2),  # one model twice
        Report("b", 1.0, 3.0, [ModelSummary(f"m{i}", 16, 1, 1, bytes(1), 0.0, 1) for i in range(4097)]),
        Report("b", 1.0, 3.0, [ModelSummary("m", 16, 11, 1, bytes(8 * 1024 * 1024), 0.0, 1)]),  # over 4 MiB
    ],
)
def test_a_report_out_of_bounds_is_refused(report: Report) -> None:
    with pytest.raises(FederationWireError):
        decode_report(encode(report))


def test_a_report_at_the_bounds_is_read_and_looked_up_by_model() -> None:
    models = [ModelSummary(f"m{i}", 16, 1, 1, bytes(64), 0.0, 1) for i in range(MAX_REPORT_MODELS)]
    data = encode(Report("b", 1.0, 3.0, models))
    assert len(data) <= MAX_REPORT_BYTES
    report = decode_report(data)
    assert len(report.models) == MAX_REPORT_MODELS
