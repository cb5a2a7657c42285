"""What the gateway asks of an engine itself, as data (sans IO): :class:`SubRequest`. The processor and the
features that need a sub-request build it; :mod:`extproc.upstream.client` sends it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SubRequest:
    """POST ``body`` (JSON) to ``path`` at ``address`` (``ip:port``) within ``timeout_s`` seconds, with
    ``headers``. ``wait``: the request's replies wait for its answer; else they are out already and it runs
    beside the request (SGLang's prefill half); ``stream``: the answer is an SSE stream read line by line
    (a cascade step gated on its first tokens)."""

    address: str
    path: str
    body: bytes
    timeout_s: float
    headers: dict[str, str] = field(default_factory=dict)
    wait: bool = True
    #: The answer is a stream the caller reads line by line (:meth:`UpstreamClient.post_stream`).
    stream: bool = False
