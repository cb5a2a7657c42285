"""TTFT with and without a restored llama.cpp slot: what :mod:`agent.slots` saves a replica.

``python -m load.bench.slots --out results/slots.json [--quick] [--kvcached TARGET]`` starts two real
llama-servers (SmolLM2-135M Q4, one thread, one slot each) under :class:`~agent.supervisor.EngineSupervisor`
and sends one long chat prompt. Replica A serves it once and its slot is saved through
:class:`~agent.slots.SlotCache` into kvcached; then, ``repeats`` times, in this order:

- ``local_hit``: the prompt again on A, which still holds it (the best case: llama.cpp's own cache);
- ``save``: A's slot saved into kvcached (engine save + file read + put), timed;
- ``cold``: B's slot erased (``POST /slots/0?action=erase``), the prompt on B: a full prefill (the
  baseline: what B costs without kvcached);
- ``restored``: B's slot erased, the saved prefix restored from kvcached (fetch + file write + engine
  restore, timed as ``restore_ms``), the prompt on B.

TTFT: request sent -> first streamed chunk with content, client side (streaming, ``max_tokens`` 4,
temperature 0). Every sample keeps the engine's ``timings.cache_n`` (prompt tokens served from cache),
so a case that was not what it claims shows it. ``restored_total_ms`` is restore + TTFT: what a gateway
that restores before routing would see. kvcached: the daemon at ``--kvcached`` (a
``kvcached.service.KvcachedClient`` target, e.g. ``unix:/run/kvcached.sock``) when given, else
kvcached's own API (TieredStore, service, gRPC on a unix socket) served in this process for the run.
Benchmarks are not tests: this measures, writes JSON and prints a table; it asserts nothing.

``--gateway``: the automatic flow instead, through the whole stack (:mod:`load.bench.slots_auto`: A's
agent saves the slot by itself, the gateway asks B's agent to restore it before routing; TTFT on B cold
against restored).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from agent.config import AgentSection
from agent.slots import SlotCache, SlotStore, slot_dir
from agent.supervisor import EngineSupervisor
from engines.config import EngineConfig
from kvcached.service import ApiServer, KvcachedService
from kvcached.tiers import TieredStore
from load.bench import machine, revision, slots_auto, summary, write_json
from load.bench.first_token import ttft
from runtime.kvcached import KvcachedClient

log = logging.getLogger(__name__)

MODEL = "SmolLM2-135M-Instruct"
_FILLER = (
    "The river rises in the hills, passes old towns with stone bridges, turns the wheels of mills, "
    "feeds canals and fields, and reaches the sea through a wide delta full of birds. "
)


@dataclass(frozen=True, slots=True)
class Options:
    """Run size: measured repeats, the prompt's approximate length (tokens), the engines' context."""

    repeats: int = 7
    prompt_tokens: int = 1000
    context: int = 2048


@contextlib.asynccontextmanager
async def kvcached_client(target: str | None, workdir: Path) -> AsyncIterator[KvcachedClient]:
    """A client of the daemon at ``target``; without one, of kvcached's API (store, service, gRPC on a
    unix socket) served in this process for the run."""
    if target is not None:
        client = KvcachedClient(target)
        try:
            yield client
        finally:
            await client.aclose()
        return
    store = TieredStore(256 << 20, workdir / "kvcached-ssd", 1 << 30)
    sock = workdir / "kvcached.sock"
    server = ApiServer(KvcachedService(store), listen_unix=str(sock))
    await server.start()
    client = KvcachedClient(f"unix:{sock}")
    try:
        yield client
    finally:
        await client.aclose()
        await server.aclose()
        store.close()


def messages_for(prompt_tokens: int) -> list[dict[str, Any]]:
    """A chat request of roughly ``prompt_tokens`` tokens (about 30 per filler sentence)."""
    filler = _FILLER * max(1, prompt_tokens // 32)
    return [
        {"role": "system", "content": "You are a careful geography tutor. " + filler},
        {"role": "user", "content": "Summarise the passage in one short sentence."},
    ]


async def erase(session: aiohttp.ClientSession, url: str) -> None:
    async with session.post(url + "/slots/0?action=erase") as resp:
        resp.raise_for_status()


async def measure(opts: Options, workdir: Path, command: str, kvcached: str | None) -> dict[str, Any]:
    agent = AgentSection(id="bench", state_dir=str(workdir / "state"))
    sups: list[EngineSupervisor] = []
    try:
        for name in ("a", "b"):
            cfg = EngineConfig(
                id=f"bench-{name}", kind="llama_cpp", model=MODEL, model_path="smollm2",
                context=opts.context, parallel=1, threads=1, metrics=False, ready_timeout_s=120,
            )  # fmt: skip
            sups.append(EngineSupervisor(cfg, agent, stop_grace_s=3.0))
            await sups[-1].start()
        for sup in sups:
            await sup.wait_ready(timeout_s=120)
        async with kvcached_client(kvcached, workdir) as store:
            return await _run(opts, sups, store, command, kvcached)
    finally:
        for sup in sups:
            await sup.aclose()


async def _run(
    opts: Options, sups: list[EngineSupervisor], store: SlotStore, command: str, kvcached: str | None
) -> dict[str, Any]:
    a, b = sups
    assert a.launch is not None and b.launch is not None
    url_a, url_b = a.launch.base_url, b.launch.base_url
    messages = messages_for(opts.prompt_tokens)
    samples: dict[str, list[float]] = {k: [] for k in ("local_hit", "cold", "restored", "restored_total")}
    cache_n: dict[str, list[int]] = {k: [] for k in ("local_hit", "cold", "restored")}
    save_ms: list[float] = []
    restore_ms: list[float] = []
    timeout = aiohttp.ClientTimeout(total=600)
    # A fresh connection per request: llama-server closes a connection after a streamed answer, and
    # reusing it fails; the same loopback connect (well under a millisecond) is in every case.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        cache_a = SlotCache(store, url_a, slot_dir(a.engine, agent_dir(a)), session=session, engine_id="a")
        cache_b = SlotCache(store, url_b, slot_dir(b.engine, agent_dir(b)), session=session, engine_id="b")
        tokens = await cache_a.prompt_tokens(messages)
        await ttft(session, url_a, messages)  # A computes the prefix once
        restored_tokens, key = 0, b""
        for _ in range(opts.repeats):
            ms, hit = await ttft(session, url_a, messages)
            samples["local_hit"].append(ms)
            cache_n["local_hit"].append(hit)
            began = time.perf_counter()
            saved = await cache_a.save(0, tokens, MODEL)
            save_ms.append((time.perf_counter() - began) * 1000)
            if saved is None:
                raise RuntimeError("slot A did not hold the prompt; nothing saved")
            key = saved
            await erase(session, url_b)
            ms, hit = await ttft(session, url_b, messages)
            samples["cold"].append(ms)
            cache_n["cold"].append(hit)
            await erase(session, url_b)
            began = time.perf_counter()
            restored_tokens = await cache_b.restore(0, tokens, MODEL)
            restore_ms.append((time.perf_counter() - began) * 1000)
            ms, hit = await ttft(session, url_b, messages)
            samples["restored"].append(ms)
            samples["restored_total"].append(ms + restore_ms[-1])
            cache_n["restored"].append(hit)
        slot_bytes = await _value_size(store, key)
    cases: dict[str, dict[str, Any]] = {}
    for name, values in samples.items():
        cases[name] = {"ttft_ms": summary(values, 2)}
        if name in cache_n:
            cases[name]["cache_n"] = cache_n[name]
    cold_p50 = float(cases["cold"]["ttft_ms"]["p50"])
    restored_p50 = float(cases["restored_total"]["ttft_ms"]["p50"])
    return {
        "benchmark": "slots",
        "command": command,
        "machine": machine(),
        "revision": revision(),
        "parameters": {
            "repeats": opts.repeats,
            "context": opts.context,
            "prompt_tokens": len(tokens),
            "model": MODEL,
            "threads": 1,
            "store": f"kvcached daemon at {kvcached}" if kvcached else "kvcached API in-process (unix)",
        },
        "cases": cases,
        "restored_tokens": restored_tokens,
        "slot_value_bytes": slot_bytes,
        "save_ms": summary(save_ms, 2),
        "restore_ms": summary(restore_ms, 2),
        "speedup_cold_over_restored_p50": round(cold_p50 / restored_p50, 2) if restored_p50 else None,
    }


def agent_dir(sup: EngineSupervisor) -> str:
    return sup.agent.state_dir


async def _value_size(store: SlotStore, key: bytes) -> int:
    value = await store.get(key)
    return 0 if value is None else len(value)


def table(result: dict[str, Any]) -> str:
    rows = ["| case | TTFT p50 (ms) | TTFT p90 (ms) | cache_n |", "|---|---|---|---|"]
    for name, case in result["cases"].items():
        hits = case.get("cache_n")
        cached = "-" if hits is None else f"{min(hits)}..{max(hits)}"
        rows.append(f"| {name} | {case['ttft_ms']['p50']} | {case['ttft_ms']['p90']} | {cached} |")
    p = result["parameters"]
    rows.append(
        f"\nprompt {p['prompt_tokens']} tokens, restored {result['restored_tokens']}, slot value "
        f"{result['slot_value_bytes'] / 1e6:.2f} MB; save p50 {result['save_ms']['p50']} ms, restore p50 "
        f"{result['restore_ms']['p50']} ms; store: {p['store']}"
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m load.bench.slots", description="TTFT cold vs restored slot vs local hit (llama.cpp)."
    )
    parser.add_argument("--out", type=Path, default=Path("results/slots.json"))
    parser.add_argument("--quick", action="store_true", help="2 repeats of a ~150-token prompt (a smoke run)")
    parser.add_argument("--repeats", type=int, help="measured repeats (default 7; quick 2)")
    parser.add_argument("--prompt-tokens", type=int, help="approximate prompt length (default 1000)")
    parser.add_argument("--kvcached", help="a kvcached daemon's gRPC target (default: in-process stand-in)")
    parser.add_argument("--workdir", type=Path, help="engine state and logs (default: a temp dir)")
    parser.add_argument(
        "--gateway",
        action="store_true",
        help="the automatic flow through Envoy + ext_proc + agents + kvcached (load.bench.slots_auto)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = Options(repeats=2, prompt_tokens=150, context=512) if args.quick else Options()
    if args.repeats is not None:
        opts = Options(args.repeats, opts.prompt_tokens, opts.context)
    if args.prompt_tokens is not None:
        context = max(opts.context, 1 << (args.prompt_tokens * 2 - 1).bit_length())
        opts = Options(opts.repeats, args.prompt_tokens, context)
    command = " ".join(["python -m load.bench.slots", *(argv if argv is not None else sys.argv[1:])])
    if args.gateway:
        repeats = args.repeats or (2 if args.quick else 5)
        tokens = args.prompt_tokens or (600 if args.quick else 1200)
        result = slots_auto.run(
            repeats=repeats,
            prompt_tokens=tokens,
            context=max(2048, 2 * tokens),
            command=command,
            workdir=args.workdir,
        )
        write_json(args.out, result)
        print(slots_auto.table(result))
        print(f"wrote {args.out}")
        return 0
    with tempfile.TemporaryDirectory(prefix="kvgate-slots-") as tmp:
        workdir = args.workdir or Path(tmp)
        result = asyncio.run(measure(opts, workdir, command, args.kvcached))
    write_json(args.out, result)
    print(table(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
