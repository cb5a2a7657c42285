"""Routing an obviously hard request straight to a cascade's last step (``preroute``), sans IO.

A request the gate escalates costs the small step's work for nothing and waits for it. The gateway learns,
online and from nothing but the gate's own verdicts, which kinds of request it escalates. A request's
features are the first :data:`MAX_WORDS` whitespace-separated words of its last user message (or prompt),
lower-cased, each hashed with CRC-32, plus a length bucket. Two tables of :data:`SLOTS` counters each
(a count-min sketch) count, per feature ``f``, the verdicts on requests carrying it, ``n_f``, and how many
escalated, ``e_f``: ``f`` updates slot ``low 16 bits of its hash`` of the first and ``high 16 bits`` of the
second, and its counts are the smaller of the two slots' (a word that shares one slot with another, e.g.
``r32w48`` and ``[hard]`` in their low bits, is not confused with it unless it shares both). A slot's
counts are halved when they reach :data:`CAP`, so old verdicts fade. A feature's escalation rate, and a
request's::

    r_f  = (e_f + 1) / (n_f + 2)                       (Laplace's rule: 1/2 before any verdict)
    p(x) = max of r_f over the features f of x with n_f >= min_seen     (0 when none has)

A request goes straight to the last step when ``p(x) >= above``: some feature of it has been seen at least
``min_seen`` times and nearly always escalated (with the defaults, ``min_seen`` 10 and ``above`` 0.9: 10
verdicts all escalated, 11/12; or 19 of 20, 29 of 30).
One in ``round(1 / explore)`` of those (deterministic) still takes the small step, so the learner keeps
getting verdicts for the kind of request it skips: with ``explore`` 0 a feature once learnt hard stays so.
The rule is deliberately conservative: a feature shared by easy and hard requests never reaches ``above``,
and a word seen once decides nothing.

A request skipped by mistake (an easy one) is answered by the large model: never a worse answer, only the
large model's cost; a hard one missed takes the small step as before. Nothing of a request is kept but its
features' counts; nothing is logged.
"""

from __future__ import annotations

import math
import sys
import zlib
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from contracts.errors import ConfigError

#: Words of a request read as features (the start of the message: cheap, and where instructions sit).
MAX_WORDS = 64
#: Characters read to find them.
MAX_CHARS = 2_000
BITS = 16
SLOTS = 1 << BITS
#: Verdicts per feature before its counts are halved.
CAP = 1_000
#: What a learner's counts are counts of (the words read, their hash, the tables, the cap): counts kept
#: across a restart (:meth:`EscalationPrior.dump`) are taken back only by a learner of the same. Change it
#: with any of those.
FEATURES = f"crc32 lower words {MAX_WORDS} of {MAX_CHARS} chars, len bucket; 2 x {SLOTS} slots; cap {CAP}"
#: The size of :meth:`EscalationPrior.dump`: four tables of float64.
COUNTS_BYTES = 4 * SLOTS * 8
_KEYS = ("above", "min_seen", "explore")


@dataclass(frozen=True, slots=True)
class PrerouteSpec:
    """``above``: the predicted escalation probability at or above which the small step is skipped;
    ``min_seen``: verdicts on a feature before it counts; ``explore``: the share of would-be skips that
    still take the small step."""

    above: float = 0.9
    min_seen: int = 10
    explore: float = 0.1

    def __post_init__(self) -> None:
        if not 0.5 <= self.above < 1:
            raise ConfigError(f"above must be in [0.5, 1), got {self.above}")
        if self.min_seen < 1:
            raise ConfigError(f"min_seen must be an integer >= 1, got {self.min_seen}")
        if not 0 <= self.explore < 1:
            raise ConfigError(f"explore must be in [0, 1), got {self.explore}")
        if self.explore > 0 and not math.isfinite(1 / self.explore):  # one in round(1 / explore): skip()
            raise ConfigError(f"explore must be 0 or have a finite 1 / explore, got {self.explore}")

    def to_json(self) -> dict[str, object]:
        return {"above": self.above, "min_seen": self.min_seen, "explore": self.explore}


def parse_preroute(value: object, where: str) -> PrerouteSpec:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected an object {{{', '.join(_KEYS)}}}, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(_KEYS)}")
    above, seen, explore = value.get("above", 0.9), value.get("min_seen", 10), value.get("explore", 0.1)
    for key, v in (("above", above), ("explore", explore)):
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            raise ConfigError(f"{where}.{key}: expected a number, got {v!r}")
    if not isinstance(seen, int) or isinstance(seen, bool):
        raise ConfigError(f"{where}.min_seen: expected an integer, got {seen!r}")
    try:
        return PrerouteSpec(float(above), seen, float(explore))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def request_text(client: Mapping[str, Any], *, chat: bool) -> str:
    """The text the features come from: a chat's last user message (its text parts joined), a
    completion's prompt (a string, or the first of a list of strings); ``""`` otherwise."""
    if chat:
        for message in reversed(client.get("messages") or []):
            if isinstance(message, Mapping) and message.get("role") == "user":
                content = message.get("content")
                if isinstance(content, str):
                    return content[:MAX_CHARS]
                if isinstance(content, list):
                    parts = [p.get("text") for p in content if isinstance(p, Mapping)]
                    return " ".join(p for p in parts if isinstance(p, str))[:MAX_CHARS]
                return ""
        return ""
    prompt = client.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt[:MAX_CHARS] if isinstance(prompt, str) else ""


def features(text: str) -> tuple[int, ...]:
    """The 32-bit hashes of ``text``'s features (module docstring), distinct, sorted."""
    words = text.lower().split(maxsplit=MAX_WORDS)[:MAX_WORDS]
    hashes = {zlib.crc32(w.encode()) for w in words}
    hashes.add(zlib.crc32(b"\x00len:%d" % min(16, len(text).bit_length())))
    return tuple(sorted(hashes))


def check_counts(counts: bytes) -> None:
    """:class:`ValueError` unless ``counts`` is what :meth:`EscalationPrior.dump` gives: the size, every
    count finite, in ``[0, CAP]``, no slot escalated more often than seen."""
    if len(counts) != COUNTS_BYTES:
        raise ValueError(f"expected {COUNTS_BYTES} bytes of counts, got {len(counts)}")
    tables = _tables(counts)
    for table in tables:
        if not (math.isfinite(sum(table)) and min(table) >= 0 and max(table) <= CAP):  # NaN, inf: the sum
            raise ValueError("a count is negative, over the cap or not finite")
    for seen, escalated in ((tables[0], tables[2]), (tables[1], tables[3])):
        if any(e > n for n, e in zip(seen, escalated, strict=True)):
            raise ValueError("a slot escalated more often than it was seen")


def _tables(counts: bytes) -> list[array[float]]:
    values = array("d")
    values.frombytes(counts)
    if sys.byteorder == "big":
        values.byteswap()
    return [values[i * SLOTS : (i + 1) * SLOTS] for i in range(4)]


def _slots(f: int) -> tuple[int, int]:
    return f & (SLOTS - 1), (f >> BITS) & (SLOTS - 1)


@dataclass(frozen=True, slots=True)
class VerdictRule:
    """What a learner's verdicts are verdicts of: the step judged and the gate that judged it (a cascade's
    first step, ``gate``, ``threshold``, ``stat``, ``k``). Counts learnt under one rule say nothing sure
    about another (a lower threshold escalates less), so a learner is kept only under the same rule."""

    first_step: str
    gate: str
    threshold: float
    stat: str
    k: int | None

    def to_json(self) -> dict[str, object]:
        return {
            "first_step": self.first_step,
            "gate": self.gate,
            "threshold": self.threshold,
            "stat": self.stat,
            "k": self.k,
        }


def parse_rule(value: object) -> VerdictRule:
    """A :class:`VerdictRule` as :meth:`VerdictRule.to_json` wrote it; :class:`ValueError` otherwise (the
    values themselves are not checked: a rule no cascade in force has keeps no learner)."""
    if not isinstance(value, Mapping) or set(value) != {"first_step", "gate", "threshold", "stat", "k"}:
        raise ValueError("a malformed verdict rule")
    first, gate, threshold, stat, k = (value[key] for key in ("first_step", "gate", "threshold", "stat", "k"))
    if not (
        isinstance(first, str)
        and isinstance(gate, str)
        and isinstance(threshold, int | float)
        and not isinstance(threshold, bool)
        and isinstance(stat, str)
        and (k is None or (isinstance(k, int) and not isinstance(k, bool)))
    ):
        raise ValueError("a malformed verdict rule")
    return VerdictRule(first, gate, float(threshold), stat, k)


@dataclass(frozen=True, slots=True)
class SavedPrior:
    """A learner kept across a restart: its virtual model, the rule its verdicts were taken under and the
    ``preroute`` of that model's cascade when it learned, its verdicts and its counts
    (:meth:`EscalationPrior.dump`)."""

    model: str
    rule: VerdictRule
    spec: PrerouteSpec
    verdicts: int
    counts: bytes


class EscalationPrior:
    """One virtual model's learner (module docstring)."""

    def __init__(self, spec: PrerouteSpec) -> None:
        self.spec = spec
        self.seen = (array("d", bytes(8 * SLOTS)), array("d", bytes(8 * SLOTS)))
        self.escalated = (array("d", bytes(8 * SLOTS)), array("d", bytes(8 * SLOTS)))
        self.verdicts = 0
        self.skips = 0
        self._would_skip = 0

    def counts(self, f: int) -> tuple[float, float]:
        """``(n_f, e_f)`` of feature ``f``: the smaller of its two slots' counts."""
        a, b = _slots(f)
        return min(self.seen[0][a], self.seen[1][b]), min(self.escalated[0][a], self.escalated[1][b])

    def p(self, x: tuple[int, ...]) -> float:
        """Predicted probability that the gate escalates a request with features ``x``."""
        least, rates = self.spec.min_seen, []
        for f in x:
            n, e = self.counts(f)
            if n >= least:
                rates.append((e + 1) / (n + 2))
        return max(rates, default=0.0)

    def skip(self, x: tuple[int, ...]) -> bool:
        """Whether a request with features ``x`` goes straight to the last step."""
        if self.p(x) < self.spec.above:
            return False
        self._would_skip += 1
        every = round(1 / self.spec.explore) if self.spec.explore > 0 else 0
        if every and self._would_skip % every == 0:
            return False
        self.skips += 1
        return True

    def dump(self) -> bytes:
        """The counts: the two ``seen`` tables then the two ``escalated`` ones, float64 little-endian."""
        out = array("d")
        for table in (*self.seen, *self.escalated):
            out.extend(table)
        if sys.byteorder == "big":
            out.byteswap()
        return out.tobytes()

    def load(self, counts: bytes, verdicts: int) -> None:
        """Take back counts :meth:`dump` gave (a restarted gateway's learner, checked by
        :func:`check_counts`) and the verdicts they count."""
        tables = _tables(counts)
        self.seen, self.escalated = (tables[0], tables[1]), (tables[2], tables[3])
        self.verdicts = verdicts

    def learn(self, x: tuple[int, ...], escalated: bool) -> None:
        """One gate verdict on a request with features ``x``."""
        for f in x:
            for table, slot in enumerate(_slots(f)):
                seen, esc = self.seen[table], self.escalated[table]
                if seen[slot] >= CAP:
                    seen[slot] /= 2
                    esc[slot] /= 2
                seen[slot] += 1
                if escalated:
                    esc[slot] += 1
        self.verdicts += 1
