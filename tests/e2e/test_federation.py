"""End to end: two kvgate clusters on loopback, each with its own etcd, Envoy, gateway, node agent and
simulated replica, linked by mTLS (``extproc/federation``).

The links are written into each cluster's etcd (``federation/<peer>``) once both run (the ports are
ephemeral), both pointing at each other. A long prompt warm only in cluster B, sent to A, is forwarded
through A's Envoy to B's federation listener and served from B's cache; a short or unshared one stays
in A; a client's forged hop, peer or tenant header changes nothing; the forwarded request is never
forwarded back; with B stopped, requests to A keep succeeding.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from certs.store import LeafFiles, dev_bundle
from contracts.etcd import EtcdSettings
from kvgate.dev.auth import StackAuth
from kvgate.dev.procs import http_get
from kvgate.dev.up import Stack, StackOptions
from runtime.etcd import connect
from tests.e2e.conftest import FAST_SIM
from tests.polling import poll

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
SHARED = "Federated clusters forward a request to the cluster whose fleet holds its prefix. " * 20
SHORT = "Hi."


def _stack(workdir: Path, name: str, leaf: LeafFiles, auth: StackAuth | None = None) -> Stack:
    section = {
        "cluster": name,
        "tls_cert": str(leaf.cert),
        "tls_key": str(leaf.key),
        "tls_ca": str(leaf.ca),
        "refresh_s": 0.2,
        "ttl_s": 2.0,
        "down_base_s": 0.5,
        "down_max_s": 2.0,
        # a slow engine's prefill (2 ms a token): the saving of a ~300-token prefix (0.6 s) dwarfs the
        # round trip and any queue the peer predicts, so the tests do not race the peer's predictor
        "prefill_s_per_token": 0.002,
    }
    options = StackOptions(
        port=0,
        agents=1,
        sim_args=FAST_SIM,
        agent_args=FAST_SIM,
        workdir=workdir,
        auth=auth,
        overlay={"federation": section},
    )
    return Stack(options).start()


def _link(peer: Stack, name: str) -> bytes:
    return json.dumps(
        {
            "ingress": f"127.0.0.1:{peer.federation_port}",
            "service": f"127.0.0.1:{peer.federation_service_port}",
            "identity": f"spiffe://kvgate.local/federation-{name}",
            "rtt_ms": 5,
            "egress_requests_per_s": 100,
            "egress_bytes_per_s": 10_000_000,
        }
    ).encode()


def _put(stack: Stack, key: str, value: bytes) -> None:
    assert stack.etcd is not None

    async def put() -> None:
        client = await connect(EtcdSettings(endpoints=(stack.etcd.address,)))  # type: ignore[union-attr]
        try:
            await client.kv.put(f"/kvgate/{key}", value)
        finally:
            await client.close()

    asyncio.run(put())


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Stack]]:
    pki = tmp_path_factory.mktemp("pki")
    leaves = dev_bundle(pki, ["federation-a", "federation-b"], dt.datetime.now(dt.UTC))
    a = _stack(tmp_path_factory.mktemp("a"), "a", leaves["federation-a"])
    try:
        b = _stack(tmp_path_factory.mktemp("b"), "b", leaves["federation-b"])
    except BaseException:
        a.stop()
        raise
    try:
        _put(a, "federation/b", _link(b, "b"))
        _put(b, "federation/a", _link(a, "a"))  # both point at each other
        yield a, b
    finally:
        b.stop()
        a.stop()


def samples(stack: Stack) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    got = http_get(f"http://127.0.0.1:{stack.extproc_ports['metrics']}/metrics")
    assert got is not None and got[0] == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(got[1].decode())
        for s in family.samples
    }


def metric(stack: Stack, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples(stack).items() if n == name and want <= set(ls))


def chat(stack: Stack, prompt: str, headers: dict[str, str] | None = None) -> httpx.Response:
    resp = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2},
        headers=headers,
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    return resp


def cached(resp: httpx.Response) -> int:
    doc: dict[str, Any] = resp.json()
    return int(doc["usage"]["prompt_tokens_details"]["cached_tokens"])


def warm_in_b(a: Stack, b: Stack, serve: Callable[[], object]) -> None:
    """Serve a prompt in B (``serve`` sends it there), then wait until A's copy of B's summary holds it
    (every digest B noted so far, this prompt's included: a count merely above the one before could be an
    earlier request's summary arriving late) and says B waits for nothing (the warm request's prefill,
    priced at the links' 2 ms a token, is no longer queued there: else A may keep the next request local,
    ``no_gain``). Shared by tests/e2e/test_federation_auth.py."""
    noted = metric(b, "kvgate_federation_noted_digests")
    serve()
    after = poll(
        lambda: v if (v := metric(b, "kvgate_federation_noted_digests")) > noted else None, 20, "noted in b"
    )

    def ready() -> bool | None:
        held = metric(a, "kvgate_federation_summary_entries", peer="b") >= after
        return (
            True if held and metric(a, "kvgate_federation_peer_queue_wait_seconds", peer="b") == 0 else None
        )

    poll(ready, 20, "summary")


def ingress(stack: Stack) -> str:
    return f"127.0.0.1:{stack.federation_port}"


def test_a_long_prefix_warm_only_in_b_is_forwarded_and_served_from_bs_cache(
    clusters: tuple[Stack, Stack],
) -> None:
    a, b = clusters
    poll(
        lambda: True if metric(a, "kvgate_federation_peer_up", peer="b") == 1 else None,
        20,
        "b's summaries at a",
    )
    prompt = f"1 {SHARED}"
    warm_in_b(a, b, lambda: chat(b, prompt))
    resp = chat(a, prompt)
    assert resp.headers["x-kvgate-endpoint"] == ingress(b)  # A's Envoy sent it to B's federation listener
    prompt_tokens = int(resp.json()["usage"]["prompt_tokens"])
    assert cached(resp) >= 0.8 * prompt_tokens  # B's replica held the prefix (all but the last block)
    assert metric(a, "kvgate_federation_forwards_total", peer="b") >= 1
    assert metric(a, "kvgate_federation_egress_requests_total", peer="b") >= 1
    ok = {"peer": "b", "outcome": "ok"}  # from Envoy's completion log (flushed every 20 ms)
    poll(lambda: True if metric(a, "kvgate_federation_forward_outcomes_total", **ok) >= 1 else None, 5, "ok")
    # B served it itself (the hop), never evaluating a forward back: no loop
    assert metric(b, "kvgate_federation_decisions_total", reason="hop") >= 1
    assert metric(b, "kvgate_federation_forwards_total") == 0


def test_short_or_unshared_requests_stay_local(clusters: tuple[Stack, Stack]) -> None:
    a, b = clusters
    for prompt in (SHORT, f"2 unshared {SHARED}"):
        resp = chat(a, prompt)
        assert resp.headers["x-kvgate-endpoint"] != ingress(b)
    assert metric(b, "kvgate_federation_forwards_total") == 0


def test_forged_hop_peer_or_tenant_headers_have_no_effect(clusters: tuple[Stack, Stack]) -> None:
    a, b = clusters
    prompt = f"3 {SHARED}"
    warm_in_b(a, b, lambda: chat(b, prompt))
    forged = {
        "x-kvgate-hop": "b",
        "x-kvgate-federation-peer": "spiffe://kvgate.local/federation-b",
        "x-kvgate-tenant": "acme",
    }
    hops = metric(a, "kvgate_federation_decisions_total", reason="hop")
    resp = chat(a, prompt, headers=forged)
    assert resp.headers["x-kvgate-endpoint"] == ingress(b)  # forwarded as any client request
    assert metric(a, "kvgate_federation_decisions_total", reason="hop") == hops
    # Straight to B's public listener: B does not take it for a forwarded request either.
    b_hops = metric(b, "kvgate_federation_decisions_total", reason="hop")
    chat(b, SHORT, headers={**forged, "x-kvgate-hop": "a"})
    assert metric(b, "kvgate_federation_decisions_total", reason="hop") == b_hops
    # B's federation listener refuses a client without a linked cluster's certificate.
    with pytest.raises(httpx.HTTPError):
        httpx.post(f"https://{ingress(b)}/v1/chat/completions", json={}, verify=False, timeout=5)


def test_a_forward_to_an_unreachable_ingress_falls_back_to_the_local_pick(
    clusters: tuple[Stack, Stack],
) -> None:
    """B's Envoy stops while its gateway still sends fresh summaries: A forwards, Envoy's connect failure
    sends the try on to A's own pick (the request succeeds), and the failed try marks B down at A."""
    a, b = clusters
    prompt = f"5 {SHARED}"
    warm_in_b(a, b, lambda: chat(b, prompt))
    assert b.envoy is not None
    b.envoy.stop()
    forwards = metric(a, "kvgate_federation_forwards_total", peer="b")
    resp = chat(a, prompt)
    assert metric(a, "kvgate_federation_forwards_total", peer="b") == forwards + 1  # it was forwarded
    assert resp.headers["x-kvgate-endpoint"] != ingress(b)
    poll(
        lambda: (
            True
            if metric(a, "kvgate_federation_forward_outcomes_total", peer="b", outcome="unreachable") >= 1
            else None
        ),
        5,
        "the failed try at a",
    )
    assert metric(a, "kvgate_federation_peer_up", peer="b") == 0


def test_with_b_stopped_requests_to_a_keep_succeeding(clusters: tuple[Stack, Stack]) -> None:
    """B stops whole (its Envoy already did, above): requests to A whose prefix B held succeed, in A."""
    a, b = clusters
    b.stop()
    for i in range(6):  # forwarded (the fallback catches it) or kept local: never an error
        resp = chat(a, f"{1 + 2 * (i % 3)} {SHARED}" if i % 2 == 0 else f"{i} other {SHARED}")
        assert resp.headers["x-kvgate-endpoint"] != ingress(b)
    poll(lambda: True if metric(a, "kvgate_federation_peer_up", peer="b") == 0 else None, 5, "b down at a")
