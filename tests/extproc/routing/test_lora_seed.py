"""The digest seed is the same on both sides (issue 21, the seed bug): a LoRA request and a salted request
are routed to the engine whose KV events hold them.

In memory, every part real: two simulated engines (load/sim Engine) serve requests and publish vLLM's
KV events (KvEventBuffer, encoded as on the wire); the agent's decoder and Translator turn them into
index events; the gateway's PreciseIndex holds them and the Router decides. Before the fix the router
seeded ``chain_seed(model, salt=...)`` and the agent ``chain_seed(model, lora=...)``: neither request
could match.
"""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import orjson

from agent.kvevents import decode_payload
from agent.translate import Translator, vllm_salt
from contracts.digest import chain_seed
from contracts.events import EndpointId
from engines.endpoint import Endpoint
from extproc.fleet import Fleet
from extproc.index.precise import PreciseIndex
from extproc.models.registry import ModelAssets, ModelRegistry
from extproc.routing.request import Kind, parse_body
from extproc.routing.router import Router, RoutingPolicy
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile
from load.sim.engine import Engine, EngineConfig
from load.sim.kvevents import KvEventBuffer, _EventBatch
from load.sim.timing import TimingModel

BASE = "base"
ADAPTER = "tenant-adapter"
SALT = "tenant-secret"


def serve(
    engine: Engine, rid: str, prompt: list[int], lora: str | None = None, salt: str | None = None
) -> None:
    """Run one request to its end on a simulated engine (its blocks stay cached)."""
    seed = chain_seed(BASE, lora=lora, salt=salt)
    engine.add_request(rid, prompt, [7], 0.0, seed=seed, lora=lora, salt=salt)
    now = 0.0
    while engine.has_work():
        step = engine.schedule(now)
        assert step is not None
        engine.complete(step)
        now = step.end


def test_vllm_salt_reads_the_first_blocks_extra_keys() -> None:
    assert vllm_salt(None, None) is None
    assert vllm_salt(("salt",), None) == "salt"
    assert vllm_salt(("lora-a", "salt"), "lora-a") == "salt"
    assert vllm_salt(["lora-a"], "lora-a") is None
    assert vllm_salt((("mm-hash", 0), "salt", b"embeds"), None) == "salt"  # multimodal and embeddings skipped


def test_lora_and_salted_requests_go_to_the_engine_whose_events_hold_them(model_dir: str) -> None:
    assets = ModelAssets.load(BASE, Path(model_dir))
    text_p = "Adapters separate caches: the same words under a LoRA adapter are other blocks. " * 4
    text_q = "A cache salt isolates one tenant's prefix from every other tenant's prefix here. " * 4
    p = assets.tokenizer.encode(text_p, add_special_tokens=True)
    q = assets.tokenizer.encode(text_q, add_special_tokens=True)
    ids = [EndpointId("a"), EndpointId("b")]
    index = PreciseIndex()
    for n, endpoint in enumerate(ids):
        buffer = KvEventBuffer(16, hash_key=bytes([n + 1]) * 16)
        engine = Engine(EngineConfig(max_loras=2), TimingModel(time_scale=0.0), chain_seed(BASE), buffer)
        if endpoint == "a":  # a: P under the adapter, Q unsalted
            serve(engine, "p", p, lora=ADAPTER)
            serve(engine, "q", q)
        else:  # b: P on the base model, Q salted
            serve(engine, "p", p)
            serve(engine, "q", q, salt=SALT)
        payload = msgspec.msgpack.encode(_EventBatch(0.0, buffer.take()))
        events = decode_payload(payload).events
        index.apply(Translator(endpoint, BASE, 16).apply(events), 0.0)
    fleet = Fleet(
        Endpoint(
            e,
            f"127.0.0.{i + 1}:8000",
            frozenset({BASE, ADAPTER}),
            adapters=frozenset({ADAPTER}),
            kv_events=True,
        )
        for i, e in enumerate(ids)
    )
    router = Router(
        fleet,
        ModelRegistry([assets]),
        index,
        RoutingPolicy(build_profile(DEFAULT_SCHEDULING), block_size=16),
        rng=random.Random(0),
    )

    def pick(model: str, prompt: str, salt: str | None = None) -> tuple[str, int]:
        body: dict[str, object] = {"model": model, "prompt": prompt, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        decision = router.decide(parse_body(Kind.COMPLETION, orjson.dumps(body)), request_id="r", now=0.0)
        router.finish(decision)
        return decision.endpoints[0].id, decision.matched_blocks

    full_p, full_q = len(p) // 16, len(q) // 16
    assert pick(ADAPTER, text_p) == ("a", full_p)  # the LoRA request: where the adapter's blocks are
    assert pick(BASE, text_p) == ("b", full_p)
    assert pick(BASE, text_q, SALT) == ("b", full_q)  # the salted request: where the salted blocks are
    assert pick(BASE, text_q) == ("a", full_q)
    assert pick(ADAPTER, text_q, SALT)[1] == 0  # adapter and salt together: held nowhere
