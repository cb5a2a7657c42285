"""Shared by the agent's tests: a fake engine's KV event sockets (a real ZMQ PUB socket and replay
ROUTER, speaking vLLM's wire format) for the subscriber and the agent's event pump to follow."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq
import zmq.asyncio

#: One batch clearing every block (vLLM's ``KVEventBatch`` as msgpack: timestamp, events, dp rank).
CLEARED = msgspec.msgpack.encode([1.5, [{"type": "AllBlocksCleared"}], 0])


class FakeEngine:
    """A PUB socket and a ROUTER standing in for an engine's KV event sockets. The ROUTER never answers
    until :meth:`answer_replays` is called; from then on it answers every replay request with
    ``batches`` batches from the start asked for (:data:`CLEARED`; none by default), then the end
    marker."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:0")
        self.replays = 0
        self.replay_batches = 0
        self.seq = 0
        self._task: asyncio.Task[None] | None = None

    def answer_replays(self, batches: int = 0) -> None:
        self.replay_batches = batches
        if self._task is None:
            self._task = asyncio.create_task(self._answer())

    async def _answer(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            self.replays += 1
            start = int.from_bytes(frames[-1], "big")
            for seq in range(start, start + self.replay_batches):
                await self.router.send_multipart([frames[0], b"", seq.to_bytes(8, "big"), CLEARED])
            await self.router.send_multipart([frames[0], b"", (-1).to_bytes(8, "big", signed=True), b""])

    def endpoints(self) -> tuple[str, str]:
        """The PUB and ROUTER addresses."""
        return self.pub.getsockopt_string(zmq.LAST_ENDPOINT), self.router.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(self, seq: int | None = None, payload: bytes = CLEARED) -> None:
        """Publish ``payload`` numbered ``seq``; without one, the next number (then counted)."""
        if seq is None:
            seq = self.seq
            self.seq += 1
        self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


@pytest.fixture
async def fake_engine() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine()
    yield engine
    await engine.close()
