"""kvcached.memory: the daemon's malloc settings apply on glibc (CI runs on Linux with glibc)."""

from __future__ import annotations

import platform

import pytest

from kvcached.memory import tune_malloc


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc",
    reason="mallopt's options are glibc's; runs on any glibc Linux (this machine and CI do run it),"
    " skipped only on musl or macOS, where tune_malloc is a documented no-op",
)
def test_tune_malloc_applies_on_glibc() -> None:
    assert tune_malloc() is True
    assert tune_malloc() is True  # idempotent: a second call (another entry point) changes nothing
