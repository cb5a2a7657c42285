"""A byte budget shared by every connection of a server: what kvcached's QUIC peer server may buffer for
requests and responses, all connections and streams together.

Per-stream bounds (a request's receive window, a response's queue) do not bound their sum: N clients, or
one client opening many streams, would make the server hold N times them. Each buffer is charged here
before it is made and given back when it is freed, and a charge that does not fit is refused (the caller
answers "busy"). Sans-IO: no clock, no socket, no lock (one event loop calls it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ByteBudget:
    """At most ``capacity_bytes`` held at once. :attr:`held_bytes` is what is charged now,
    :attr:`peak_bytes` its highest value, :attr:`refused` how many charges did not fit."""

    capacity_bytes: int
    held_bytes: int = 0
    peak_bytes: int = 0
    refused: int = 0

    def __post_init__(self) -> None:
        if self.capacity_bytes < 1:
            raise ValueError("a byte budget needs a positive capacity")

    def take(self, nbytes: int) -> bool:
        """Charge ``nbytes`` if they fit (True); otherwise charge nothing, count a refusal (False)."""
        if nbytes < 0:
            raise ValueError("cannot charge a negative size")
        if self.held_bytes + nbytes > self.capacity_bytes:
            self.refused += 1
            return False
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return True

    def give(self, nbytes: int) -> None:
        """Give back ``nbytes`` charged earlier (each charge is given back once, by its owner)."""
        if not 0 <= nbytes <= self.held_bytes:
            raise ValueError(f"giving back {nbytes} bytes of {self.held_bytes} held")
        self.held_bytes -= nbytes
