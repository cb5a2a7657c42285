"""End to end: a llama.cpp prefix saved into kvcached on its own, restored on another replica by the gateway.

Real parts: a local etcd; two node agents, each supervising one ``llama-server`` (SmolLM2-135M, one
thread, one slot) and each with its own kvcached daemon (node-0, node-1; QUIC peer fetch between them,
mTLS); Envoy + the ext_proc, which follows both daemons' index feeds. Requests are steered with the
conformance header (``[extproc] conformance``). A ~1,200-token chat goes to replica A (node-0); A's agent
sees the slot finish and saves it into node-0's kvcached (slot file + chain markers), with no admin call.
The same conversation with a new question then goes to replica B: the gateway sees node-0's kvcached
lead beat B's own by more than ``slot_restore.min_blocks``, asks B's agent to restore (which fetches the
file from node-0 over QUIC) and only then lets Envoy send the request, which B serves from cache. The
control: a prompt whose lead stays under ``min_blocks`` is saved too, but never restored, so B prefills it.
The agents have ``[agent.tls]`` (dev CA): their admin APIs are HTTPS, and the gateway's restore goes over
mTLS with its ``[feeds]`` client certificate; a POST without one is refused (401).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import httpx
import pytest

from contracts.digest import Digest, block_digests, chain_seed
from contracts.events import node_store_endpoint
from extproc.status.snapshot import decode
from kvgate.dev.up import Stack, StackOptions
from runtime.kvcached import KvcachedClient

pytestmark = pytest.mark.e2e
T = TypeVar("T")
MODEL = "SmolLM2-135M-Instruct"
PIN = "test-epp-endpoint-selection"
#: The gateway restores when kvcached leads by this many blocks (the default is 32: 512 tokens).
MIN_BLOCKS = 40
_SENTENCE = (
    "The river rises in the hills, passes old towns with stone bridges, turns the wheels of mills, "
    "feeds canals and fields, and reaches the sea through a wide delta full of birds. "
)
#: ~1,200 tokens with the chat template: about 7 s of prefill on one CPU thread.
LONG = [{"role": "system", "content": "You are a careful geography tutor. " + _SENTENCE * 32}]
#: ~430 tokens: saved (over slot_save_min_tokens) but its 26 blocks stay under MIN_BLOCKS.
SHORT = [{"role": "system", "content": "You are a patient history tutor. " + _SENTENCE * 11}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        port=0,
        agents=2,
        agent_engine="llama_cpp",
        agent_engine_options={"parallel": 1, "context": 2048, "threads": 1},
        kvcached=True,
        agent_options={"slot_save_min_tokens": 256},
        extproc={"conformance": True},
        # Below Envoy's 5 s ext_proc message timeout; generous for a busy 2-core machine.
        slot_restore={"min_blocks": MIN_BLOCKS, "timeout_s": 4.5},
        workdir=tmp_path_factory.mktemp("slots-auto"),
    )
    with Stack(options) as running:
        yield running


def wait_until(probe: Callable[[], T | None], timeout_s: float, what: str) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout_s} s")
        time.sleep(0.1)  # poll interval of the condition, not a stand-in for it


def chat(stack: Stack, engine: dict[str, str], messages: list[dict[str, str]]) -> dict[str, Any]:
    """A chat completion through Envoy, pinned to ``engine``."""
    resp = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0},
        headers={PIN: engine["address"]},
        timeout=180,
    )
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


def chain_of(engine: dict[str, str], messages: list[dict[str, str]]) -> tuple[int, list[Digest]]:
    """(prompt tokens, their digest chain) as the engine itself renders and tokenizes ``messages``."""
    base = f"http://{engine['address']}"
    prompt = httpx.post(f"{base}/apply-template", json={"messages": messages}, timeout=30).json()["prompt"]
    body = {"content": prompt, "parse_special": True}
    tokens = httpx.post(f"{base}/tokenize", json=body, timeout=30).json()["tokens"]
    return len(tokens), block_digests(chain_seed(MODEL), tokens, 16)


async def _ask(stack: Stack, node: int, call: Callable[[KvcachedClient], Awaitable[T]]) -> T:
    client = KvcachedClient(f"unix:{stack.kvcached[node]['unix']}", timeout_s=10.0)
    try:
        return await call(client)
    finally:
        await client.aclose()


def kvcached_holds(stack: Stack, node: int, chain: list[Digest]) -> bool:
    """Whether node ``node``'s kvcached holds every digest of ``chain``, asked of the daemon itself."""
    return all(asyncio.run(_ask(stack, node, lambda c: c.contains([bytes(d) for d in chain]))))


def kvcached_blocks(stack: Stack, node: int) -> float:
    """Blocks node ``node``'s kvcached holds now, over its tiers (its own stats)."""
    stats = asyncio.run(_ask(stack, node, lambda c: c.stats()))
    return stats.get("ram_blocks", 0.0) + stats.get("ssd_blocks", 0.0)


def heard_blocks(stack: Stack, node: int) -> int:
    """Blocks the ext_proc knows node ``node``'s kvcached to hold (``/status.json``: what that daemon's
    index feed told it, some ms after the daemon stored them)."""
    url = f"http://127.0.0.1:{stack.extproc_ports['metrics']}/status.json"
    stores = decode(httpx.get(url, timeout=10).content).index.stores
    return sum(stores.get(node_store_endpoint(stack.kvcached[node]["node"]), {}).values())


def saved_and_heard(stack: Stack, chain: list[Digest], what: str) -> None:
    """Wait until A's agent has saved ``chain`` into node-0's kvcached and the ext_proc has heard it.

    The gateway's restore decision reads its own index of node-0's store, fed by the daemon's feed, which
    trails the daemon: a wait on the daemon alone can end before the feed's last batches have arrived, and
    B's request then finds no lead to restore (B prefills). The feed announces blocks in the order they
    were stored, and nothing leaves node-0's store here (512 MiB of RAM): once the gateway counts as many
    blocks as the daemon held when it held the whole chain, it has heard all of the chain."""
    wait_until(lambda: kvcached_holds(stack, 0, chain), 120, f"the {what} in node-0's kvcached")
    held = kvcached_blocks(stack, 0)
    wait_until(lambda: heard_blocks(stack, 0) >= held, 10, f"the {what} heard by the gateway")


def restores(stack: Stack) -> dict[str, float]:
    """``kvgate_slot_restores_total`` of the ext_proc by outcome."""
    text = httpx.get(f"http://127.0.0.1:{stack.extproc_ports['metrics']}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvgate_slot_restores_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = float(line.rsplit(" ", 1)[1])
    return out


def agent_admin(stack: Stack, node: int) -> tuple[str, ssl.SSLContext]:
    """The base URL of node ``node``'s agent admin API (HTTPS) and a client context that verifies it
    (no client certificate: enough for the GET routes)."""
    port = stack.agent_status[node]["admin_port"]
    return f"https://127.0.0.1:{port}", ssl.create_default_context(cafile=str(stack.certs["extproc"].ca))


def agent_status(stack: Stack, node: int) -> dict[str, Any]:
    base, tls = agent_admin(stack, node)
    status: dict[str, Any] = httpx.get(f"{base}/status", verify=tls, timeout=10).json()
    return status


def follow_up(messages: list[dict[str, str]], answer: dict[str, Any], question: str) -> list[dict[str, str]]:
    said = answer["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": said}, {"role": "user", "content": question}]


def test_long_prefix_saved_on_a_is_restored_on_b(stack: Stack) -> None:
    a, b = stack.engines
    first = [*LONG, {"role": "user", "content": "Which towns does the river pass?"}]
    prompt_tokens, chain = chain_of(a, first)
    assert prompt_tokens >= 1100 and len(chain) >= MIN_BLOCKS + 32
    before = restores(stack)
    on_a = chat(stack, a, first)
    assert on_a["usage"]["prompt_tokens"] == prompt_tokens
    assert on_a["timings"]["cache_n"] < 64  # a cold prefill on A

    saved_and_heard(stack, chain, "chain")
    autosave = agent_status(stack, 0)["engines"][0]["slot_autosave"]
    assert autosave["stored"] >= 1 and autosave["markers"] >= len(chain) - 1 and autosave["errors"] == 0
    assert not kvcached_holds(stack, 1, chain[:1])  # node-1 has nothing of it: B needs a peer fetch

    on_b = chat(stack, b, follow_up(first, on_a, "And which birds live in the delta?"))
    assert on_b["timings"]["cache_n"] >= prompt_tokens - 32, on_b["timings"]
    assert on_b["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 32
    after = restores(stack)
    assert after.get("restored", 0) == before.get("restored", 0) + 1, after
    restored = agent_status(stack, 1)["engines"][0]["slot_restores"]
    assert restored["restored"] == 1 and restored["failed"] == 0


def test_lead_under_min_blocks_is_not_restored(stack: Stack) -> None:
    a, b = stack.engines
    first = [*SHORT, {"role": "user", "content": "Which towns does the river pass?"}]
    prompt_tokens, chain = chain_of(a, first)
    assert 256 <= prompt_tokens < MIN_BLOCKS * 16
    before = restores(stack)
    on_a = chat(stack, a, first)
    saved_and_heard(stack, chain, "short chain")  # the gateway knows node-0's lead, and does not restore

    on_b = chat(stack, b, follow_up(first, on_a, "And which birds live in the delta?"))
    assert on_b["timings"]["cache_n"] < 64, on_b["timings"]  # B prefilled it: no restore was asked
    assert restores(stack) == before


def test_agent_admin_needs_a_client_certificate_for_changes(stack: Stack) -> None:
    base, tls = agent_admin(stack, 1)
    assert httpx.get(f"{base}/healthz", verify=tls, timeout=10).status_code == 200
    body = {"engine": stack.engines[1]["id"], "digests": ["00" * 16]}
    resp = httpx.post(f"{base}/slots/restore-chain", json=body, verify=tls, timeout=10)
    assert resp.status_code == 401 and resp.json()["error"]["code"] == 401
