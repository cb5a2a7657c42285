"""The forward decision (formulas: ``README.md``). Pure: summaries, health and budgets are passed in.

For each linked peer with a fresh summary of the model, that is up and whose digests use the request's
block size::

    lead_p    = deepest sampled depth of the prompt's chain in p's summary (blocks, a lower bound)
    saving_p  = (lead_p - lead_local) x block_size x prefill_s_per_token          seconds of prefill saved
    cost_p    = rtt_p + queue_wait_p                                               seconds added
    queue_wait_p = max(0, published_wait_p - age_p)     the summary's wait, drained since it arrived
    net_p     = saving_p - cost_p - margin_s

The request goes to the peer with the largest ``net_p > 0`` whose egress budget takes one request and the
body's bytes (else the next); otherwise it stays local.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contracts.digest import Digest
from contracts.federation import ModelSummary
from extproc.federation.links import Link
from extproc.federation.summary import lead


@dataclass(frozen=True, slots=True)
class Candidate:
    """A peer as the decision sees it: its link, its fresh summary of the model (``None``: none fresh),
    whether it is up, and the summary's age (seconds since it arrived: its queue wait has drained by as
    much since, README.md "The decision")."""

    link: Link
    summary: ModelSummary | None
    up: bool
    age_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Verdict:
    """``peer``: where to forward (``None``: serve locally); ``reason``: why (metrics label);
    ``lead``: the peer's lead (blocks); ``net_s``: its predicted net gain."""

    peer: Link | None
    reason: str
    lead: int = 0
    net_s: float = 0.0


# Reasons (the label values of kvgate_federation_decisions_total).
FORWARD, HOP, NO_PEER, SHORT, NO_GAIN, BUDGET = "forward", "hop", "no_peer", "short", "no_gain", "budget"


@dataclass(frozen=True, slots=True)
class Gain:
    link: Link
    lead: int
    net_s: float


def queue_wait(summary: ModelSummary, age_s: float) -> float:
    """The peer's queue wait ``age_s`` seconds after its summary arrived: the published wait less the
    time since, never below 0 (its model drains the backlog at one second of wait per second; README.md,
    "The decision")."""
    return max(0.0, summary.queue_wait_s - max(0.0, age_s))


def gains(
    digests: Sequence[Digest],
    local_lead: int,
    block_size: int,
    candidates: Sequence[Candidate],
    *,
    prefill_s_per_token: float,
    margin_s: float,
    min_blocks: int,
) -> tuple[list[Gain], str]:
    """Peers whose net gain is positive, best first; with none, the reason it stays local."""
    out: list[Gain] = []
    reason = NO_PEER
    for c in candidates:
        s = c.summary
        if not c.up or s is None or s.block_size != block_size or s.endpoints <= 0:
            continue
        peer_lead = lead(s, digests)
        if peer_lead < min_blocks or peer_lead <= local_lead:
            reason = SHORT if reason == NO_PEER else reason
            continue
        saving = (peer_lead - local_lead) * block_size * prefill_s_per_token
        net = saving - (c.link.rtt_ms / 1000.0 + queue_wait(s, c.age_s)) - margin_s
        if net <= 0:
            reason = NO_GAIN
            continue
        out.append(Gain(c.link, peer_lead, net))
    out.sort(key=lambda g: g.net_s, reverse=True)
    return out, reason
