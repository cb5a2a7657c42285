"""TTFT on replica B: a cold prefill against the automatic flow (auto-save on A, gateway-triggered restore).

``python -m load.bench.slots --gateway --out results/slots_gateway.json [--quick] [--repeats N]
[--prompt-tokens N]`` starts what ``kvgate up --agents 2 --agent-engine llama_cpp --kvcached`` starts
(:class:`kvgate.dev.up.Stack`: etcd, two node agents each supervising one llama-server, SmolLM2-135M Q4, one
thread, one slot, each node with its own kvcached daemon, QUIC peer fetch between them; Envoy + the
ext_proc with ``[slot_restore]`` at its defaults, ``min_blocks`` 32, and a 4.5 s deadline) and steers
requests with the conformance header. Each repeat uses two fresh chats of the same shape and length, ``R``
and ``C`` (``[system ~prompt_tokens, user q1]``; their follow-up adds a fixed assistant answer and a second
question), in this order:

- ``cold_a``: ``R`` on A (a full prefill; A's agent then saves the slot into node-0's kvcached by itself);
  the run waits until node-0's kvcached holds ``R``'s chain (polled);
- ``cold_b``: the follow-up of ``C`` on B: nobody ever saw ``C``, so no restore is asked: a full prefill
  (the baseline, in the same run);
- ``restored_b``: the follow-up of ``R`` on B: the gateway sees node-0's kvcached lead, B's agent fetches
  the slot file from node-0 over QUIC and restores it, then Envoy sends the request (the restore wait is in
  this TTFT; it is also read from the ext_proc's ``kvgate_slot_restore_seconds`` per request as
  ``restore_wait_ms``);
- ``local_hit_a``: the follow-up of ``R`` on A, which still caches ``R`` (llama.cpp's own cache, the
  best case).

TTFT: request sent to Envoy -> first streamed chunk with content, client side (``max_tokens`` 4,
temperature 0); each sample keeps the engine's ``timings.cache_n``. ``other_cpu_cores``: CPU used by
other tenants of the machine during the measured requests (``/proc/stat`` less this process tree). A
benchmark, not a test: it measures, writes JSON, prints a table, asserts nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from contracts.digest import Digest, block_digests, chain_seed
from kvgate.dev.up import Stack, StackOptions
from load.bench import CpuSample, first_token, machine, revision, summary
from runtime.kvcached import KvcachedClient

log = logging.getLogger(__name__)

MODEL = "SmolLM2-135M-Instruct"
PIN = "test-epp-endpoint-selection"
DEADLINE_S = 4.5
_FILLER = (
    "The river rises in the hills, passes old towns with stone bridges, turns the wheels of mills, "
    "feeds canals and fields, and reaches the sea through a wide delta full of birds. "
)
CASES = ("cold_a", "cold_b", "restored_b", "local_hit_a")


def chat(session_id: str, prompt_tokens: int) -> list[dict[str, str]]:
    """A fresh chat of about ``prompt_tokens`` tokens (about 37 per filler sentence) starting with its id."""
    filler = _FILLER * max(1, prompt_tokens // 37)
    return [
        {"role": "system", "content": f"Session {session_id}. You are a careful geography tutor. {filler}"},
        {"role": "user", "content": "Which towns does the river pass?"},
    ]


def follow_up(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    return [
        *messages,
        {"role": "assistant", "content": "It passes several old towns with stone bridges."},
        {"role": "user", "content": "And which birds live in the delta?"},
    ]


def start_stack(workdir: Path, context: int) -> Stack:
    options = StackOptions(
        port=0,
        agents=2,
        agent_engine="llama_cpp",
        agent_engine_options={"parallel": 1, "context": context, "threads": 1},
        kvcached=True,
        agent_options={"slot_save_min_tokens": 256},
        extproc={"conformance": True},
        slot_restore={"timeout_s": DEADLINE_S},
        workdir=workdir,
    )
    return Stack(options).start()


async def ttft(
    session: aiohttp.ClientSession, url: str, address: str, messages: list[dict[str, str]]
) -> tuple[float, int]:
    """(TTFT in ms, ``timings.cache_n``) of one streamed chat through Envoy, pinned to ``address``."""
    return await first_token.ttft(session, url, list(messages), model=MODEL, headers={PIN: address})


async def chain_of(
    session: aiohttp.ClientSession, address: str, messages: list[dict[str, str]]
) -> list[Digest]:
    """The digest chain of ``messages`` as the engine at ``address`` renders and tokenizes them."""
    async with session.post(f"http://{address}/apply-template", json={"messages": messages}) as resp:
        prompt = (await resp.json())["prompt"]
    body = {"content": prompt, "parse_special": True}
    async with session.post(f"http://{address}/tokenize", json=body) as resp:
        tokens = (await resp.json())["tokens"]
    return block_digests(chain_seed(MODEL), tokens, 16)


async def wait_held(client: KvcachedClient, chain: list[Digest], timeout_s: float) -> float:
    """Poll kvcached until it holds all of ``chain``; the seconds it took."""
    began = time.monotonic()
    while True:
        if all(await client.contains([bytes(d) for d in chain])):
            return time.monotonic() - began
        if time.monotonic() - began > timeout_s:
            raise TimeoutError(f"kvcached did not hold the chain within {timeout_s} s")
        await asyncio.sleep(0.05)  # poll interval of the condition


async def restore_metrics(session: aiohttp.ClientSession, port: int) -> dict[str, float]:
    """The ext_proc's ``kvgate_slot_restores_total`` by outcome and ``kvgate_slot_restore_seconds_sum``."""
    async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvgate_slot_restores_total{"):
            out[line.split('outcome="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvgate_slot_restore_seconds_sum "):
            out["seconds_sum"] = float(line.rsplit(" ", 1)[1])
    return out


async def measure(stack: Stack, repeats: int, prompt_tokens: int, command: str) -> dict[str, Any]:
    a, b = (e["address"] for e in stack.engines)
    samples: dict[str, list[float]] = {case: [] for case in CASES}
    cache_n: dict[str, list[int]] = {case: [] for case in CASES}
    restore_wait_ms: list[float] = []
    saved_after_s: list[float] = []
    outcomes: list[str] = []
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(force_close=True)
    kvcached = KvcachedClient(f"unix:{stack.kvcached[0]['unix']}", timeout_s=30.0)
    metrics_port = stack.extproc_ports["metrics"]
    tokens = 0
    cpu_busy_s = cpu_wall_s = 0.0
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            # Warm-up: one short request per replica (model pages, connections), not measured.
            for address in (a, b):
                await ttft(session, stack.url, address, chat(f"warm-{address}", 64))
            for i in range(repeats):
                r, c = chat(f"r{i}", prompt_tokens), chat(f"c{i}", prompt_tokens)
                chain = await chain_of(session, a, r)
                tokens = len(chain) * 16
                before_cpu, before_tree = CpuSample.take(), _tree_cpu_s()
                ms, hit = await ttft(session, stack.url, a, r)
                samples["cold_a"].append(ms)
                cache_n["cold_a"].append(hit)
                saved_after_s.append(await wait_held(kvcached, chain, 120))
                for case, address, messages in (("cold_b", b, follow_up(c)), ("restored_b", b, follow_up(r))):
                    before = await restore_metrics(session, metrics_port)
                    ms, hit = await ttft(session, stack.url, address, messages)
                    after = await restore_metrics(session, metrics_port)
                    samples[case].append(ms)
                    cache_n[case].append(hit)
                    if case == "restored_b":
                        wait = after.get("seconds_sum", 0.0) - before.get("seconds_sum", 0.0)
                        restore_wait_ms.append(wait * 1000)
                        moved = [k for k in after if k != "seconds_sum" and after[k] != before.get(k, 0.0)]
                        outcomes.append(",".join(moved) or "none")
                ms, hit = await ttft(session, stack.url, a, follow_up(r))
                samples["local_hit_a"].append(ms)
                cache_n["local_hit_a"].append(hit)
                after_cpu, after_tree = CpuSample.take(), _tree_cpu_s()
                cpu_busy_s += (after_cpu.busy - before_cpu.busy) - (after_tree - before_tree)
                cpu_wall_s += after_cpu.wall - before_cpu.wall
    finally:
        await kvcached.aclose()
    ttfts = {case: summary(samples[case], 2) for case in CASES}
    cases = {case: {"ttft_ms": ttfts[case], "cache_n": cache_n[case]} for case in CASES}
    cold, restored = float(ttfts["cold_b"]["p50"]), float(ttfts["restored_b"]["p50"])
    return {
        "benchmark": "slots_gateway",
        "command": command,
        "machine": machine(),
        "revision": revision(),
        "parameters": {
            "repeats": repeats,
            "prompt_tokens_full_blocks": tokens,
            "model": MODEL,
            "threads": 1,
            "slot_restore": {"min_blocks": 32, "timeout_s": DEADLINE_S},
            "kvcached": "one daemon per node, QUIC peer fetch (65,000-byte datagrams, loopback)",
        },
        "cases": cases,
        "restore_wait_ms": summary(restore_wait_ms, 2),
        "restore_outcomes": outcomes,
        "auto_saved_within_s": summary(saved_after_s, 3),
        "speedup_cold_over_restored_p50": round(cold / restored, 2) if restored else None,
        "other_cpu_cores": round(max(0.0, cpu_busy_s) / cpu_wall_s, 3) if cpu_wall_s else None,
    }


def run(
    *, repeats: int, prompt_tokens: int, context: int, command: str, workdir: Path | None = None
) -> dict[str, Any]:
    """Start the stack (in ``workdir``, default a temporary directory), measure, stop it."""
    with tempfile.TemporaryDirectory(prefix="kvgate-slots-gw-") as tmp:
        stack = start_stack(workdir or Path(tmp), context)
        try:
            return asyncio.run(measure(stack, repeats, prompt_tokens, command))
        finally:
            stack.stop()


def table(result: dict[str, Any]) -> str:
    rows = ["| case | TTFT p50 (ms) | TTFT p90 (ms) | cache_n |", "|---|---|---|---|"]
    for name, case in result["cases"].items():
        hits = case["cache_n"]
        rows.append(
            f"| {name} | {case['ttft_ms']['p50']} | {case['ttft_ms']['p90']} | {min(hits)}..{max(hits)} |"
        )
    p = result["parameters"]
    rows.append(
        f"\nprompt {p['prompt_tokens_full_blocks']} tokens in full blocks; restore wait p50 "
        f"{result['restore_wait_ms']['p50']} ms; outcomes {result['restore_outcomes']}; cold/restored p50 "
        f"{result['speedup_cold_over_restored_p50']}x; other tenants {result['other_cpu_cores']} cores"
    )
    return "\n".join(rows)


def _tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and all its descendants now (from ``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        used[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    ours = {os.getpid()}
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in ours and pid not in ours:
                ours.add(pid)
                grew = True
    return sum(used.get(pid, 0.0) for pid in ours)
