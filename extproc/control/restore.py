"""Gateway-triggered llama.cpp slot restores: bring a prefix from kvcached into the picked engine first.

llama-server cannot read kvcached itself; its agent can restore a slot file from kvcached into an idle
slot (``POST <slot_restore>`` = the agent's ``/slots/restore-chain``, :mod:`agent.slot_api`). After
:meth:`extproc.routing.router.Router.decide`, and before Envoy gets its answer, the ext_proc asks for that
restore when it pays off:

- **When** (:func:`plan`, pure): the pick's endpoint offers ``slot_restore``, and the longest run of
  leading blocks some node's kvcached holds (``Decision.kv_lead_blocks``: ``CycleState.warm_blocks`` of
  the pick's own node or ``peer_warm_blocks`` of any node) exceeds what the pick holds itself
  (``Decision.matched_blocks``, its GPU lead) by at least ``slot_restore.min_blocks`` (default 32
  blocks = 512 tokens of prefill saved).
- **What**: ``{"engine": id, "digests": [hex, ...]}``, the request's chain up to that lead (the agent
  then fetches the value under the last digest, from a peer if its own kvcached lacks it).
- **How long**: ``slot_restore.timeout_s`` (default 2 s), then the request is routed as usual. A restore
  that fails, finds nothing, finds no idle slot or runs late never fails the request; the agent finishes
  a late restore anyway, so later requests find the prefix. One shared aiohttp session. A redirect is not
  followed (only the endpoint record names the agent to ask): it counts as ``failed``.
- Counted in the ext_proc's metrics: ``kvgate_slot_restores_total{outcome}`` (``restored``, ``miss``,
  ``busy``, ``failed``, ``timeout``) and ``kvgate_slot_restore_seconds``.

The hop follows the agent: ``http://`` where the agent runs without ``[agent.tls]`` (plaintext: bind its
admin API to a management network); ``https://`` in the secure profile, where the agent requires a
client certificate for every ``POST`` (:mod:`agent.admin`) and the restorer presents the ext_proc's
``[feeds]`` client certificate and verifies the agent's against ``[feeds] tls_ca`` (``tls``, built by
:mod:`extproc.server`: a :class:`~runtime.tls.ReloadingClientCerts`, asked per restore, so a rotated
certificate is presented by the next new connection; pooled ones finish with the old). A gateway
without ``[feeds]`` TLS does not try an ``https`` URL: the restore counts as ``failed`` (the request is
routed as usual). Requests carry digests only, never tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import orjson

from contracts.digest import Digest
from contracts.events import EndpointId
from extproc.config import SlotRestoreConfig
from extproc.metrics import GatewayMetrics
from extproc.routing.router import Decision
from runtime.tls import ClientTls, current_context

log = logging.getLogger(__name__)

OUTCOMES = ("restored", "miss", "busy", "failed", "timeout")


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """One restore to ask for: the agent's URL, the engine, the chain up to kvcached's lead, and the
    blocks it would add to what the engine holds."""

    url: str
    engine: EndpointId
    digests: tuple[Digest, ...]
    gain_blocks: int

    def body(self) -> bytes:
        """The JSON body of the request to the agent."""
        return orjson.dumps({"engine": self.engine, "digests": [d.hex() for d in self.digests]})


def plan(decision: Decision, config: SlotRestoreConfig) -> RestorePlan | None:
    """The restore ``decision`` calls for (module docstring), ``None`` when none does."""
    if not config.enabled or not decision.endpoints:
        return None
    pick = decision.endpoints[0]
    url = pick.endpoint.slot_restore
    if url is None:
        return None
    lead = min(decision.kv_lead_blocks, len(decision.digests))
    gain = lead - decision.matched_blocks
    if gain < config.min_blocks:
        return None
    return RestorePlan(url, pick.id, tuple(decision.digests[:lead]), gain)


class SlotRestorer:
    """Asks agents for the restores :func:`plan` finds, within ``config.timeout_s`` (module docstring).

    ``tls``: the client context for ``https`` agent URLs (verifies the agent, presents the gateway's
    certificate); ``None``: ``https`` URLs are not tried. ``clock``: seconds, for the duration histogram.
    Call :meth:`aclose` to close its HTTP session.
    """

    def __init__(
        self,
        config: SlotRestoreConfig,
        metrics: GatewayMetrics | None = None,
        *,
        tls: ClientTls | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        self._metrics = metrics
        self._tls = tls
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._warned_no_tls = False

    async def before_routing(
        self, decision: Decision, headers: Mapping[str, str] | None = None
    ) -> str | None:
        """Restore into ``decision``'s pick if it pays off; the outcome (``None``: nothing asked).
        ``headers``: sent with the agent's request besides its content type (a trace's ``traceparent``)."""
        wanted = plan(decision, self.config)
        if wanted is None:
            return None
        began = self._clock()
        outcome = await self.restore(wanted, headers)
        seconds = self._clock() - began
        if self._metrics is not None:
            self._metrics.slot_restores.labels(outcome).inc()
            self._metrics.slot_restore_seconds.observe(seconds)
        level = logging.INFO if outcome in ("restored", "miss") else logging.WARNING
        log.log(level, "request %s: slot restore on %s: %s (%d blocks asked, %.1f ms)", decision.request_id,
                wanted.engine, outcome, len(wanted.digests), seconds * 1000)  # fmt: skip
        return outcome

    async def restore(self, wanted: RestorePlan, headers: Mapping[str, str] | None = None) -> str:
        """POST ``wanted`` to its agent; one of :data:`OUTCOMES`. Never raises for the agent's failures."""
        if self._tls is None and urlsplit(wanted.url).scheme == "https":
            if not self._warned_no_tls:  # once: every such restore is counted as failed anyway
                self._warned_no_tls = True
                log.warning("agents offer https slot restores but [feeds] has no TLS client certificate")
            return "failed"
        sent = {**(headers or {}), "content-type": "application/json"}
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            async with asyncio.timeout(self.config.timeout_s):
                tls = True if self._tls is None else current_context(self._tls)
                async with self._session.post(  # only the record names the agent: a redirect is a failure
                    wanted.url, data=wanted.body(), headers=sent, ssl=tls, allow_redirects=False
                ) as resp:
                    if resp.status == 409:
                        return "busy"
                    if resp.status != 200:
                        return "failed"
                    answer = orjson.loads(await resp.read())
        except TimeoutError:
            return "timeout"
        except (aiohttp.ClientError, orjson.JSONDecodeError, OSError):
            return "failed"
        if not isinstance(answer, dict):
            return "failed"
        return "restored" if answer.get("restored") is True else "miss"

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
