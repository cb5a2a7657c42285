"""Burst to a hosted OpenAI-compatible endpoint when the local fleet cannot take a request in time
(README.md). Sans IO (:mod:`extproc.burst.core`): the endpoints' config, the rule and the per-minute
token bucket, ``now`` passed in; the processor asks it, Envoy sends the request (its own cluster per
hosted endpoint, TLS and the upstream key injected: :mod:`kvgate.envoy.burst`)."""
