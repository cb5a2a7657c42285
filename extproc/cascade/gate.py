"""The logprob gate (sans IO): a statistic over the token log-probabilities of a step's answer, and the
decision whether that answer is returned or the request goes to the next step.

For one choice with sampled-token log-probabilities ``l_1 .. l_n`` (nats, each <= 0):

    mean     s = (1/n) * sum(l_i)              log of the geometric-mean token probability
    min      s = min(l_i)                      the least confident token
    first_k  s = (1/m) * sum(l_1 .. l_m),      m = min(k, n): the mean over the first k tokens

An answer with several choices (``n`` > 1) is judged by its worst choice (the minimum of their
statistics). The answer passes when ``s >= threshold``. No statistic (no choice, a choice without
tokens, an engine that sent no logprobs) never passes: the request escalates.

A null entry (a token the engine gave no log-probability) is skipped: ``l_1 .. l_n`` are the numbers, in
order, and a choice with none has no statistic; an entry that is neither a number nor null makes the
answer unreadable (no statistic). The streamed ``first_k`` gate (:mod:`extproc.cascade.stream`) reads
the entries the same way (:func:`token_values`).

Where the log-probabilities are: chat ``choices[].logprobs.content[].logprob`` (OpenAI, vLLM,
llama.cpp's llama-server), completions ``choices[].logprobs.token_logprobs[]``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from extproc.cascade.spec import CascadeSpec


@dataclass(frozen=True, slots=True)
class Verdict:
    """The gate's decision: ``stat`` (nats; ``None``: no statistic), ``passed``, and ``reason``
    (``pass``, ``gate``: below the threshold, ``no_logprobs``)."""

    stat: float | None
    passed: bool
    reason: str


def statistic(logprobs: Sequence[float], stat: str, k: int | None = None) -> float | None:
    """``stat`` (module docstring) over one choice's token log-probabilities; ``None`` for no tokens."""
    values = [v for v in logprobs if math.isfinite(v)] if logprobs else []
    if len(values) != len(logprobs) or not values:
        return None  # a non-finite logprob (-inf: a token the engine thought impossible) judges nothing
    if stat == "min":
        return min(values)
    if stat == "first_k":
        assert k is not None and k >= 1, "first_k needs k"
        values = values[:k]
    return sum(values) / len(values)


def token_values(entries: Sequence[Any]) -> list[float] | None:
    """One choice's log-probability entries as the gate reads them (module docstring): nulls skipped;
    ``None`` when an entry is neither a number nor null."""
    out: list[float] = []
    for v in entries:
        if v is None:
            continue
        if not isinstance(v, int | float) or isinstance(v, bool):
            return None
        out.append(float(v))
    return out


def entry_logprob(entry: object) -> object:
    """A chat ``logprobs.content`` entry's ``logprob`` (absent: null); an entry that is not an object is
    unreadable (a stand-in that is neither a number nor null, for :func:`token_values`)."""
    return entry.get("logprob") if isinstance(entry, Mapping) else _UNREADABLE


_UNREADABLE = "unreadable"


def choice_logprobs(answer: Mapping[str, Any]) -> list[list[float]] | None:
    """Per choice, its sampled tokens' log-probabilities (chat or completions shape); ``None`` when some
    choice carries none (the engine ignored the request for them) or the answer has no choices."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices:
        return None
    out: list[list[float]] = []
    for choice in choices:
        lp = choice.get("logprobs") if isinstance(choice, Mapping) else None
        if not isinstance(lp, Mapping):
            return None
        content = lp.get("content")
        if isinstance(content, list):  # chat
            values = [entry_logprob(item) for item in content]
        elif isinstance(lp.get("token_logprobs"), list):  # completions
            values = list(lp["token_logprobs"])
        else:
            return None
        numbers = token_values(values)
        if numbers is None:
            return None
        out.append(numbers)
    return out


def judge(spec: CascadeSpec, answer: Mapping[str, Any]) -> Verdict:
    """The gate's verdict on a step's (non-streamed, JSON-decoded) answer under ``spec``."""
    per_choice = choice_logprobs(answer)
    if per_choice is None:
        return Verdict(None, False, "no_logprobs")
    stats = [statistic(values, spec.stat, spec.k) for values in per_choice]
    if any(s is None for s in stats):
        return Verdict(None, False, "no_logprobs")
    worst = min(s for s in stats if s is not None)
    passed = worst >= spec.threshold
    return Verdict(worst, passed, "pass" if passed else "gate")
