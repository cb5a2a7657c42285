"""The engine core on a fake clock: TTFT, prefix reuse, chunked prefill, queueing, batch slowdown."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from contracts.digest import chain_seed
from load.sim.engine import Engine, EngineConfig, TokenEvent
from load.sim.timing import TimingModel

TIMING = TimingModel()


def make(**kw: int | bool | str) -> Engine:
    return Engine(EngineConfig(**kw), TIMING, chain_seed("m"))  # type: ignore[arg-type]


def drain(engine: Engine, t: float = 0.0) -> tuple[dict[str, list[tuple[float, TokenEvent]]], float]:
    """Run steps until idle; returns each request's (time, event) list and the end time."""
    out: dict[str, list[tuple[float, TokenEvent]]] = {}
    while engine.has_work():
        step = engine.schedule(t)
        assert step is not None
        t = step.end
        for event in engine.complete(step):
            out.setdefault(event.request_id, []).append((t, event))
    return out, t


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def out(n: int) -> list[int]:
    return [7] * n


def ttft(events: Sequence[tuple[float, TokenEvent]]) -> float:
    first = events[0][1].ttft_s
    assert first is not None
    return first


@pytest.mark.parametrize("n", [1, 100, 2048])
def test_ttft_of_a_lone_prompt_is_one_prefill_step(n: int) -> None:
    engine = make()
    engine.add_request("r", prompt(n), out(3), now=0.0)
    events, _ = drain(engine)
    assert ttft(events["r"]) == pytest.approx(TIMING.step_s(0, n))
    assert [e.token_ids for _, e in events["r"]] == [(7,), (7,), (7,)]
    assert events["r"][-1][1].finished


def test_ttft_grows_with_uncached_tokens_and_long_prompts_prefill_in_chunks() -> None:
    times = []
    for n in (500, 2000, 5000):
        engine = make()
        engine.add_request("r", prompt(n), out(1), now=0.0)
        times.append(ttft(drain(engine)[0]["r"]))
    assert times == sorted(times)
    chunks = TIMING.step_s(0, 2048) * 2 + TIMING.step_s(0, 5000 - 4096)
    assert times[-1] == pytest.approx(chunks)


def test_cached_prefix_cuts_ttft_and_is_reported() -> None:
    engine = make()
    engine.add_request("a", prompt(1000), out(4), now=0.0)
    events, t = drain(engine)
    assert events["a"][0][1].cached_tokens == 0
    engine.add_request("b", [*prompt(1000), 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], out(4), now=t)
    events, _ = drain(engine, t)
    assert events["b"][0][1].cached_tokens == 992  # 62 full blocks of a's prompt
    assert ttft(events["b"]) == pytest.approx(TIMING.step_s(0, 18))
    assert engine.stats.prefix_cache_queries == 2010
    assert engine.stats.prefix_cache_hits == 992


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    engine = make()
    engine.add_request("a", prompt(32), out(1), now=0.0)
    _, t = drain(engine)
    engine.add_request("b", prompt(32), out(1), now=t)
    events, _ = drain(engine, t)
    assert events["b"][0][1].cached_tokens == 16


def test_output_blocks_are_cached_for_the_next_turn() -> None:
    engine = make()
    first_out = list(range(50, 90))
    engine.add_request("turn1", prompt(24), first_out, now=0.0)
    _, t = drain(engine)
    engine.add_request("turn2", prompt(24) + first_out + prompt(20, 5000), out(1), now=t)
    events, _ = drain(engine, t)
    assert events["turn2"][0][1].cached_tokens == 48  # 24 + 39 computed tokens -> 3 full blocks


def test_prefix_caching_can_be_disabled() -> None:
    engine = make(enable_prefix_caching=False)
    for name in ("a", "b"):
        engine.add_request(name, prompt(100), out(1), now=0.0)
    events, _ = drain(engine)
    assert events["b"][0][1].cached_tokens == 0
    assert engine.cache.num_cached == 0


def test_requests_beyond_max_num_seqs_wait_fifo() -> None:
    engine = make(max_num_seqs=2, max_num_batched_tokens=64)
    for name in ("a", "b", "c"):
        engine.add_request(name, prompt(10), out(5), now=0.0)
    step = engine.schedule(0.0)
    assert step is not None
    assert (engine.num_running, engine.num_waiting) == (2, 1)
    first = {e.request_id: e.ttft_s for e in engine.complete(step)}
    assert first == {"a": step.end, "b": step.end}
    events, _ = drain(engine, step.end)
    assert ttft(events["c"]) > step.end
    assert events["c"][0][0] >= events["a"][-1][0]  # c ran only once a seat was free


def test_a_request_waits_until_blocks_are_free() -> None:
    engine = make(num_blocks=8, block_size=16, max_model_len=128)
    engine.add_request("a", prompt(100), out(10), now=0.0)  # 7 blocks
    engine.add_request("b", prompt(30, 3000), out(10), now=0.0)  # 3 blocks: must wait for a
    step = engine.schedule(0.0)
    assert step is not None
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    assert engine.kv_usage == pytest.approx(7 / 8)
    engine.complete(step)
    events, _ = drain(engine, step.end)
    assert events["b"][0][0] > events["a"][-1][0]
    assert engine.kv_usage == 0


def test_decode_slows_down_with_batch_size() -> None:
    def itl(batch: int) -> float:
        engine = make()
        for i in range(batch):
            engine.add_request(f"r{i}", prompt(16, 100 * i), out(20), now=0.0)
        times = [t for t, _ in drain(engine)[0]["r0"]]
        return (times[-1] - times[1]) / (len(times) - 2)

    assert itl(1) == pytest.approx(TIMING.step_s(1, 0))
    assert itl(32) == pytest.approx(TIMING.step_s(32, 0))
    assert itl(1) < itl(8) < itl(32)


def test_decodes_share_a_step_with_a_chunk_of_prefill() -> None:
    engine = make(max_num_batched_tokens=256)
    engine.add_request("short", prompt(16), out(10), now=0.0)
    step = engine.schedule(0.0)
    assert step is not None
    engine.complete(step)
    engine.add_request("long", prompt(1000, 5000), out(1), now=step.end)
    mixed = engine.schedule(step.end)
    assert mixed is not None
    assert len(mixed.decode) == 1 and mixed.n_prefill_tokens == 255
    assert mixed.end - mixed.start == pytest.approx(TIMING.step_s(1, 255))


def test_abort_frees_blocks_and_drops_in_flight_tokens() -> None:
    engine = make()
    engine.add_request("a", prompt(100), out(100), now=0.0)
    engine.add_request("w", prompt(100, 9000), out(1), now=0.0)
    step = engine.schedule(0.0)
    assert step is not None
    engine.abort("a")
    engine.abort("w")
    engine.abort("unknown")
    assert engine.complete(step) == []
    assert engine.kv_usage == 0 and not engine.has_work()
    assert engine.schedule(step.end) is None


def test_time_scale_stretches_every_step() -> None:
    slow = TimingModel(time_scale=10.0)
    assert slow.step_s(4, 1000) == pytest.approx(10 * TIMING.step_s(4, 1000))
    assert TimingModel(time_scale=0).step_s(64, 2048) == 0


def test_invalid_requests_and_configs_are_refused() -> None:
    engine = make(max_model_len=64, num_blocks=4, block_size=16)
    with pytest.raises(ValueError):
        engine.add_request("x", prompt(60), out(5), now=0.0)
    with pytest.raises(ValueError):
        engine.add_request("x", [], out(5), now=0.0)
    with pytest.raises(ValueError):
        EngineConfig(num_blocks=2, block_size=16, max_model_len=64)
    with pytest.raises(ValueError):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)


def run_until(engine: Engine, rid: str, t: float, n_tokens: int) -> float:
    """Step until ``rid`` has produced ``n_tokens`` tokens; the time then."""
    got = 0
    while got < n_tokens:
        step = engine.schedule(t)
        assert step is not None
        t = step.end
        got += sum(1 for e in engine.complete(step) if e.request_id == rid)
    return t


def test_priority_policy_orders_the_waiting_queue_lower_first() -> None:
    engine = make(max_num_seqs=1, scheduling_policy="priority")
    engine.add_request("running", prompt(16), out(2), now=0.0, priority=5)
    t = run_until(engine, "running", 0.0, 1)
    engine.add_request("late-low", prompt(16, 2000), out(1), now=t, priority=5)
    engine.add_request("later-high", prompt(16, 3000), out(1), now=t + 0.001, priority=-1)
    events, _ = drain(engine, t)
    assert events["later-high"][0][0] < events["late-low"][0][0]
    assert engine.stats.preemptions == 0  # vLLM preempts only when KV runs out


def test_fcfs_ignores_priority() -> None:
    engine = make(max_num_seqs=1)
    engine.add_request("running", prompt(16), out(2), now=0.0)
    t = run_until(engine, "running", 0.0, 1)
    engine.add_request("first", prompt(16, 2000), out(1), now=t, priority=5)
    engine.add_request("second", prompt(16, 3000), out(1), now=t + 0.001, priority=-1)
    events, _ = drain(engine, t)
    assert events["first"][0][0] < events["second"][0][0]


def test_priority_preemption_runs_a_higher_request_at_once_and_resumes_the_victim() -> None:
    engine = make(max_num_seqs=2, scheduling_policy="priority", priority_preemption=True)
    engine.add_request("old", prompt(40), out(30), now=0.0, priority=0)
    engine.add_request("new", prompt(40, 2000), out(30), now=0.001, priority=0)
    t = run_until(engine, "new", 0.0, 10)
    engine.add_request("urgent", prompt(40, 3000), out(5), now=t, priority=-1)
    step = engine.schedule(t)
    assert step is not None
    assert engine.stats.preemptions == 1
    # the latest arrival of the lowest priority is the victim; urgent prefills in this very step
    assert [s.request_id for s, _ in step.prefill] == ["urgent"]
    assert {s.request_id for s in step.decode} == {"old"}
    engine.complete(step)
    events, _ = drain(engine, step.end)
    assert len(events["new"]) == 20  # every output token of the victim still comes, once each
    assert events["urgent"][-1][1].finished
    assert events["new"][-1][1].finished
    # on resumption it recomputes only what is past its last full block: 50 tokens, 48 of them cached
    assert engine.stats.prefix_cache_hits >= 48
    assert engine.cache.kv_usage == 0


def test_priority_preemption_needs_a_margin_over_the_threshold() -> None:
    engine = make(
        max_num_seqs=1,
        scheduling_policy="priority",
        priority_preemption=True,
        priority_preemption_threshold=1,
    )
    engine.add_request("batch", prompt(16), out(5), now=0.0, priority=0)
    t = run_until(engine, "batch", 0.0, 1)
    engine.add_request("close", prompt(16, 2000), out(1), now=t, priority=-1)
    step = engine.schedule(t)
    assert step is not None and engine.stats.preemptions == 0
    engine.complete(step)
    engine.add_request("far", prompt(16, 3000), out(1), now=step.end, priority=-2)
    assert engine.schedule(step.end) is not None
    assert engine.stats.preemptions == 1


def test_priority_configs_are_checked() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="needs scheduling_policy"):
        EngineConfig(priority_preemption=True)
    with pytest.raises(ValueError, match="threshold"):
        EngineConfig(scheduling_policy="priority", priority_preemption_threshold=-1)


def test_busy_seconds_sum_the_steps_and_not_the_idle_time() -> None:
    engine = make()
    engine.add_request("a", prompt(100), out(4), now=0.0)
    _, end = drain(engine)
    assert engine.stats.busy_seconds == pytest.approx(end)  # from 0, no gap
    engine.add_request("b", prompt(50, start=5000), out(2), now=end + 10.0)  # idle for 10 s first
    _, later = drain(engine, end + 10.0)
    assert engine.stats.busy_seconds == pytest.approx(end + (later - end - 10.0))
