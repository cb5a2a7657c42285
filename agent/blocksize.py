"""The gateways' index block size as the agent follows it, sans IO.

An agent turns its engines' KV events into kvgate block digests (:mod:`agent.translate`), and llama.cpp
slot chains into keys (:mod:`agent.slot_api`), in blocks of the gateways' index block size: the size the
gateways hash prompts with (their routing policy's ``block_size``). Both must match or nothing matches.
It lives in etcd as the policy path ``index/block_size`` (key ``<prefix>policy/index/block_size``,
:func:`contracts.etcd.policy_key`; ``kvgate policy set index/block_size 32``).

:class:`IndexBlockSize` is the core a :class:`runtime.watch.PrefixWatcher` drives on that key: each
snapshot or batch returns the size in force. An absent key means :data:`DEFAULT_INDEX_BLOCK_SIZE` (the
gateways' default, ``[index] block_size``; a gateway configured with another default must publish the
key for its agents). A value that is not a positive integer is refused with a logged reason and the last
good one stays (the default before any).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from contracts.errors import ConfigError
from contracts.etcd import Change, decode_value

log = logging.getLogger(__name__)

DEFAULT_INDEX_BLOCK_SIZE = 16
"""Tokens per index block when etcd has no ``index/block_size`` (the gateways' default)."""

PATH = "index/block_size"
"""The policy path followed."""


class IndexBlockSize:
    """The value of the etcd key ``key`` (:func:`contracts.etcd.policy_key` of :data:`PATH`), as a block
    size in tokens: :attr:`value`; ``rejected`` counts refused values."""

    def __init__(self, key: str, default: int = DEFAULT_INDEX_BLOCK_SIZE) -> None:
        self.key = key
        self.default = default
        self.value = default
        self.rejected = 0

    def snapshot(
        self, kvs: Iterable[tuple[str, bytes]], revision: int, created: Mapping[str, int] | None = None
    ) -> int:
        """The size in force after a full read of the prefix (the key absent: the default)."""
        raw = next((value for key, value in kvs if key == self.key), None)
        return self._set(raw)

    def apply(self, changes: Iterable[Change], revision: int) -> int:
        """The size in force after watch changes (a deleted key: the default)."""
        for change in changes:
            if change.key == self.key:
                self._set(change.value)
        return self.value

    def _set(self, raw: bytes | None) -> int:
        if raw is None:
            self.value = self.default
            return self.value
        try:
            value = decode_value(PATH, raw)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"policy {PATH}: expected an integer >= 1, got {value!r}")
        except ConfigError as exc:
            self.rejected += 1
            log.warning("%s; keeping block size %d", exc, self.value)
            return self.value
        self.value = value
        return value
