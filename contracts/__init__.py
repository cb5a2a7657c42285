"""Contracts: the pure shapes every kvgate process shares (DESIGN.md "Contracts").

The block digest chain (:mod:`contracts.digest`); index events, their wire encoding and the feed's header
(:mod:`contracts.events`); the etcd key schema, settings and value codecs (:mod:`contracts.etcd`); the
names Envoy and the ext_proc agree on (:mod:`contracts.epp`); the kvcached local API
(:mod:`contracts.kvcached`); the generic config reader (:mod:`contracts.config`) and
:class:`~contracts.errors.ConfigError`. No IO, no clock, nothing of kvgate's other packages: the gateway,
the agent and kvcached all build on these and never on each other.
"""
