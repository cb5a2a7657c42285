"""Replay of a JSONL request trace in the Mooncake shape.

One JSON object per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, 2353]}

``timestamp``: milliseconds since the trace start; ``input_length`` / ``output_length``: tokens;
``hash_ids``: one id per ``block_tokens``-token block of the prompt (512 in Mooncake's traces), equal ids
meaning equal content (and, as ids are prefix hashes there, equal prefixes). The replay turns each id
into a fixed block of text of ``block_tokens`` tokens, cuts the last block so the prompt is
``input_length`` tokens, and sends it as one user message at ``timestamp / speedup``. ``block_tokens``
may be smaller than the trace's block to shrink every prompt by the same factor (lengths are scaled by
``block_tokens / trace_block_tokens``).

Optional keys ``session`` / ``turn`` are ignored. :func:`synthesize` writes a small trace of this shape
(tool-agent style: a few applications each with a shared prefix, conversations extending their own
history) for runs without a real trace.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from load.workloads.session import Session, Turn
from load.workloads.text import TokenText


class TraceError(ValueError):
    """A trace line that is not a Mooncake-shaped record; the message names the line."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace, lengths in the trace's tokens."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: Path, limit: int | None = None) -> list[TraceRecord]:
    """Parse a JSONL trace; raises :class:`TraceError` naming the first bad line."""
    records: list[TraceRecord] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                records.append(_record(raw))
            except (ValueError, TypeError, KeyError) as exc:
                raise TraceError(f"{path}:{n}: {exc}") from exc
            if limit is not None and len(records) >= limit:
                break
    return records


def _record(raw: Any) -> TraceRecord:
    if not isinstance(raw, dict):
        raise TypeError("not a JSON object")
    ids = raw["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise TypeError("hash_ids must be a list of integers")
    record = TraceRecord(
        float(raw["timestamp"]), int(raw["input_length"]), int(raw["output_length"]), tuple(ids)
    )
    if record.input_length < 1 or record.output_length < 1:
        raise ValueError("input_length and output_length must be positive")
    return record


@dataclass(frozen=True, slots=True)
class Trace:
    """A trace replayed at ``speedup`` x its pace with ``block_tokens``-token blocks (see module doc)."""

    name: ClassVar[str] = "trace"
    records: tuple[TraceRecord, ...]
    trace_block_tokens: int = 512
    block_tokens: int = 512
    speedup: float = 1.0
    max_output: int = 256

    def _scale(self, n: int) -> int:
        return max(1, round(n * self.block_tokens / self.trace_block_tokens))

    def working_set_tokens(self, sessions: int = 0) -> int:
        return len({h for r in self.records for h in r.hash_ids}) * self.block_tokens

    def largest_request_tokens(self) -> int:
        return max((self._scale(r.input_length) + self.max_output for r in self.records), default=0) + 32

    def sessions(self, text: TokenText, arrivals: Sequence[float], seed: int) -> list[Session]:
        """One session per record; ``arrivals`` are ignored (the trace has its own timestamps)."""
        blocks: dict[int, str] = {}
        t0 = min((r.timestamp_ms for r in self.records), default=0.0)
        out = []
        for i, r in enumerate(self.records):
            length = self._scale(r.input_length)
            parts = []
            for j, h in enumerate(r.hash_ids):
                if h not in blocks:
                    blocks[h] = text.block(self.block_tokens, f"{seed}-hash-{h}")
                take = min(self.block_tokens, length - j * self.block_tokens)
                if take <= 0:
                    break
                parts.append(blocks[h] if take == self.block_tokens else _first_words(blocks[h], take))
            turn = Turn(
                ({"role": "user", "content": "".join(parts)},),
                min(self._scale(r.output_length), self.max_output),
            )
            start = (r.timestamp_ms - t0) / 1e3 / self.speedup
            key = f"hash-{r.hash_ids[0]}" if r.hash_ids else f"req-{i}"
            out.append(Session(f"trace-{i}", key, start, (), (turn,)))
        return out


def _first_words(block: str, n: int) -> str:
    """The first ``n`` words (= tokens) of a block built by :meth:`TokenText.block`."""
    words = block.split(" ")  # block starts with a space: words[0] == ""
    return " " + " ".join(words[1 : n + 1])


def synthesize(
    path: Path, *, requests: int, rate_per_s: float, seed: int, apps: int = 4, block_tokens: int = 512
) -> Path:
    """Write a Mooncake-shaped trace: ``apps`` applications, each with a 4-block shared prefix; each
    request either continues a live conversation of its app (its history plus 1-2 new blocks) or
    starts a new one; Poisson arrivals at ``rate_per_s``; outputs 16-128 tokens."""
    rng = random.Random(f"{seed}-trace")
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    prefixes = [fresh(4) for _ in range(apps)]
    live: list[list[int]] = []
    t = 0.0
    lines = []
    for _ in range(requests):
        t += rng.expovariate(rate_per_s)
        if live and rng.random() < 0.6:
            conv = live[rng.randrange(len(live))]
            conv += fresh(rng.randint(1, 2))
            if len(conv) > 12:
                live.remove(conv)
        else:
            conv = prefixes[rng.randrange(apps)] + fresh(rng.randint(1, 3))
            live.append(conv)
        ids = list(conv)
        length = (len(ids) - 1) * block_tokens + rng.randint(block_tokens // 4, block_tokens)
        record = {"timestamp": round(t * 1e3), "input_length": length, "output_length": rng.randint(16, 128)}
        lines.append(json.dumps({**record, "hash_ids": ids}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
