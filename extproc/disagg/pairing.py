"""One disaggregated request's handoff, from the decision to the decode body (sans IO).

:class:`Pairing` turns a planned :class:`~extproc.disagg.plan.Handoff` and the client's body into the
prefill sub-request (:attr:`Pairing.prefill`) and, by protocol (the client's body is the one every engine
gets: without the client's own handoff fields, dropped at parsing, and with the priority rewrite):

* vLLM: the decode body is known only from the prefill's answer: :meth:`Pairing.finish` with that answer
  (or the failure) gives the body for the decode endpoint: the client's body with the engine's
  ``kv_transfer_params``, or the client's body unchanged (served aggregated) when the prefill failed or
  its answer is unusable;
* SGLang: both bodies are known at once (:attr:`Pairing.decode_now`); the prefill half runs beside the
  routed request and :meth:`Pairing.beside_done` records how it ended.

Either way the prefill endpoint's in-flight slot is released exactly once (:meth:`release`). The prompt's
blocks are recorded at the prefill endpoint when its prefill succeeded (vLLM: before the decode half is
sent), except SGLang's: its prefill half runs beside the decode and its end may be seen after the client
has the answer (a repeat sent then would find nothing), so the processor records it when the pair is sent
(:meth:`Disaggregator.prefilled`); a failed SGLang prefill fails the request anyway.
"""

from __future__ import annotations

import logging
from typing import Any

from extproc.disagg.errors import HandoffFailed
from extproc.disagg.plan import Disaggregator, Handoff
from extproc.disagg.protocol import (
    bootstrap_bodies,
    decode_body,
    parse_request,
    prefill_body,
    transfer_params,
)
from extproc.upstream.request import SubRequest

log = logging.getLogger(__name__)


class Pairing:
    """The handoff of one request (module docstring). ``body``: the client's body (JSON, validated
    already); ``path``: its API path; ``request_id``: the ``x-request-id`` both engines get (``None``:
    none); ``log_id``: how log lines name the request. :class:`HandoffFailed` (``bad_request``) when
    ``body`` is not a JSON object."""

    def __init__(
        self,
        pd: Disaggregator,
        pair: Handoff,
        body: bytes,
        path: str,
        request_id: str | None,
        log_id: str,
    ) -> None:
        self._pd = pd
        self.pair = pair
        self.body = body
        self._log_id = log_id
        try:
            self._doc: dict[str, Any] = parse_request(body)
        except HandoffFailed:
            pd.release(pair)
            raise HandoffFailed("bad_request", "the body is not a JSON object") from None
        headers = {} if request_id is None else {"x-request-id": request_id}
        #: The decode body to send at once (SGLang), ``None`` while it waits for the prefill (vLLM).
        self.decode_now: bytes | None = None
        if pair.protocol == "sglang":
            port, room = pair.prefill.endpoint.bootstrap_port, pair.room
            assert port is not None and room is not None, "planned with a bootstrap port and a room"
            host = pair.prefill.address.rpartition(":")[0].strip("[]")
            sent, self.decode_now = bootstrap_bodies(self._doc, host, port, room)
        else:
            sent = prefill_body(self._doc)
        #: The prefill half, for the shell to send.
        self.prefill = SubRequest(
            pair.prefill.address, path, sent, pair.timeout_s, headers, wait=self.decode_now is None
        )
        #: How the handoff ended: ``disaggregated``, else why not (``None`` while it runs).
        self.outcome: str | None = None

    def finish(self, answer: bytes | None, failure: str | None = None, *, now: float) -> bytes:
        """vLLM: the prefill ended with ``answer`` (its 2xx body) or ``failure`` (a reason) at ``now``; the
        body for the decode endpoint."""
        self.release()
        body = self.body
        if answer is not None:
            try:
                body = decode_body(self._doc, transfer_params(answer))
            except HandoffFailed as exc:
                failure = exc.reason
        self._ended(failure, "served aggregated on", now)
        return body

    def beside_done(self, failure: str | None, *, now: float) -> None:
        """SGLang: the prefill half sent beside the request ended at ``now`` (``failure``: its reason, or
        ``None``)."""
        if self.pair.released:
            return
        self.release()
        self._ended(failure, "the decode waits for its KV in vain on", now)

    def release(self) -> None:
        self._pd.release(self.pair)

    def _ended(self, failure: str | None, then: str, now: float) -> None:
        self.outcome = "disaggregated" if failure is None else failure
        if failure is None and self.decode_now is None:
            self._pd.prefilled(self.pair, now)  # only a prefill that succeeded holds the prompt's blocks
        else:
            log.warning(
                "request %s: prefill on %s failed (%s); %s %s",
                self._log_id,
                self.pair.prefill.endpoint.id,
                failure,
                then,
                self.pair.decode.endpoint.id,
            )
