"""The cascades in force and one request's way through its cascade (sans IO).

:class:`Cascader` holds the policy's cascades (virtual model -> :class:`~extproc.cascade.spec.CascadeSpec`),
swapped whole when a policy is put in force. :class:`Run` is one request for a virtual model: at each gated
step the processor routes the step's body (:meth:`Run.body`) KV-aware among the step model's endpoints and
the shell sends it; :meth:`Run.judge` takes the answer (or the reason there was none) and says whether it
goes to the client (:class:`Answered`) or the request moves on to the next step (:meth:`Run.escalate`).
The last step is never gated: its request goes through Envoy as any other. A cascade with ``preroute``
(:mod:`extproc.cascade.prior`) may start a run at its last step (:attr:`Run.preskipped`), and learns from
every verdict of its first step (:meth:`Cascader.learn`). A ``replay`` cascade's streaming request that
passes on its first ``k`` tokens is :class:`Replayed`: the same step's model again, with the ``seed`` the
gated step ran with (the client's own, or one the cascader drew), through Envoy like a last step.
"""

from __future__ import annotations

import logging
import random
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from extproc.cascade.answer import client_answer, step_body, well_shaped
from extproc.cascade.gate import Verdict, judge
from extproc.cascade.prior import EscalationPrior, SavedPrior, features, request_text
from extproc.cascade.spec import CascadeSpec
from extproc.cascade.stream import StepStream

log = logging.getLogger(__name__)


class Refused(ValueError):
    """A request a cascade cannot serve as asked (the processor answers it 400, ``param`` the field)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class CascadePolicy:
    """Virtual model name -> its cascade."""

    cascades: Mapping[str, CascadeSpec] = field(default_factory=lambda: types.MappingProxyType({}))


class Cascader:
    """The cascades in force (:meth:`apply` swaps them whole; a request keeps the spec it started with)."""

    #: Seeds drawn for ``replay`` are below this (every engine's ``seed`` takes a non-negative int32).
    SEEDS = 1 << 31

    def __init__(self, policy: CascadePolicy | None = None, rng: random.Random | None = None) -> None:
        self.policy = CascadePolicy()
        #: Draws the seeds of ``replay`` runs whose client sent none.
        self._rng = rng or random.Random()
        #: Told every verdict a learner takes (virtual model, features, escalated): the sibling workers'
        #: bus (:mod:`extproc.control.siblings`), which hands theirs to :meth:`heard`.
        self.on_verdict: Callable[[str, tuple[int, ...], bool], None] | None = None
        #: Per virtual model with ``preroute``: its learner (kept across policies while its verdict rule,
        #: the first step and the gate, and its ``preroute`` stay the same).
        self.priors: dict[str, EscalationPrior] = {}
        #: Learners a restarted gateway took back (:meth:`restore`) for virtual models the policy in force
        #: does not name: they wait for the next :meth:`apply` (etcd's), kept in every snapshot until then.
        self.pending: dict[str, SavedPrior] = {}
        #: Moves with every verdict learnt and every policy applied (when to write a snapshot).
        self.changes = 0
        #: Learners that took back a previous run's counts (:meth:`restore`, or a later :meth:`apply`).
        self.restored = 0
        self.apply(policy or CascadePolicy())

    def apply(self, policy: CascadePolicy) -> None:
        priors: dict[str, EscalationPrior] = {}
        pending, self.pending = self.pending, {}  # the whole policy in force: what it leaves out is gone
        for name, spec in policy.cascades.items():
            if spec.preroute is None:
                continue
            old, before = self.priors.get(name), self.policy.cascades.get(name)
            kept = old is not None and before is not None and before.rule == spec.rule
            if old is not None and kept and old.spec == spec.preroute:
                priors[name] = old
            else:
                priors[name] = EscalationPrior(spec.preroute)
                saved = pending.get(name)
                if saved is not None and _fits(saved, spec):
                    priors[name].load(saved.counts, saved.verdicts)
                    self.restored += 1
        self.policy, self.priors = policy, priors
        self.changes += 1

    def saved(self) -> list[SavedPrior]:
        """Every learner as a restarted gateway takes it back (:meth:`restore`), and those still pending."""
        out = [
            SavedPrior(name, self.policy.cascades[name].rule, prior.spec, prior.verdicts, prior.dump())
            for name, prior in self.priors.items()
            if name not in self.pending  # until etcd's policy: the learner it may take back
        ]
        return out + list(self.pending.values())

    def restore(self, saved: Iterable[SavedPrior], *, wait: bool = False) -> int:
        """Take back a previous run's learners (:meth:`saved`); how many took their counts back now. One
        whose virtual model's cascade in force has the same verdict rule (first step and gate) and
        ``preroute`` takes them. With ``wait`` (a policy still to come from etcd) every other one waits in
        :attr:`pending` for the next :meth:`apply`, which holds the whole policy and takes it back or
        drops it: etcd may name its model, or set its cascade as it was when it learnt (an override of
        the file's); until then it is what :meth:`saved` writes for its model. Without ``wait`` the rest
        are dropped (their cascade changed or is gone: a policy change would have started them afresh
        too)."""
        restored = 0
        for s in saved:
            spec = self.policy.cascades.get(s.model)
            if spec is not None and s.model in self.priors and _fits(s, spec):
                self.priors[s.model].load(s.counts, s.verdicts)
                restored += 1
            elif wait:  # etcd's policy may name it, or set its gate as when it learnt (an override)
                self.pending[s.model] = s
        self.changes += 1
        self.restored += restored
        return restored

    def lookup(self, model: str) -> CascadeSpec | None:
        return self.policy.cascades.get(model)

    def listed(self, served: Iterable[str]) -> list[str]:
        """The virtual models to list beside the ``served`` ones (``/v1/models``): those whose every step
        is served, sorted."""
        have = set(served)
        return sorted(n for n, spec in self.policy.cascades.items() if have.issuperset(spec.steps))

    def start(
        self, model: str, client: Mapping[str, Any], *, chat: bool, now: float, generative: bool = True
    ) -> Run | None:
        """A run for a request naming ``model`` (``None``: not a virtual model). :class:`Refused`: a request
        of a kind the gate cannot judge (``generative`` false: anything but chat completions and
        completions, e.g. embeddings or the Responses API, whose answers carry no ``choices`` with
        log-probabilities), or one that asks ``echo`` (the gate judges the tokens a step generates, and an
        answer the gateway returns from a gated step cannot carry the prompt's tokens and their
        log-probabilities)."""
        spec = self.lookup(model)
        if spec is None:
            return None
        if not generative:
            raise Refused(
                f"The cascade model {model!r} serves chat completions and completions only: its gate judges"
                " their answers' log-probabilities. Name one of its steps instead.",
                "model",
            )
        if client.get("echo") is True:
            raise Refused(
                f"'echo' is not supported with the cascade model {model!r}: its answer is judged and returned"
                " without the prompt. Send the request without 'echo', or name one of its steps.",
                "echo",
            )
        run = Run(spec, model, client, chat, now)
        if spec.replay and client.get("stream") is True:
            own = client.get("seed")
            own_ok = isinstance(own, int) and not isinstance(own, bool)
            run.seed = own if own_ok else self._rng.randrange(self.SEEDS)
        prior = self.priors.get(model)
        if prior is not None:
            run.features = features(request_text(client, chat=chat))
            if prior.skip(run.features):
                run.step, run.preskipped = len(spec.steps) - 1, True
        return run

    def learn(self, run: Run) -> None:
        """``run``'s first step was judged: its verdict (a statistic against the threshold; not a failed
        step) teaches its cascade's learner."""
        prior = self.priors.get(run.virtual)
        if prior is None or run.features is None or len(run.verdicts) != 1:
            return
        verdict = run.verdicts[0][1]
        if verdict.stat is not None:
            prior.learn(run.features, not verdict.passed)
            self.changes += 1
            if self.on_verdict is not None:
                self.on_verdict(run.virtual, run.features, not verdict.passed)

    def heard(self, model: str, features: tuple[int, ...], escalated: bool) -> None:
        """A sibling worker's learner took a verdict on ``model``'s first step: this worker's learns it
        too (none for ``model``: skipped)."""
        prior = self.priors.get(model)
        if prior is not None:
            prior.learn(features, escalated)
            self.changes += 1


def _fits(saved: SavedPrior, spec: CascadeSpec) -> bool:
    """Whether ``saved`` learnt what a learner of ``spec`` learns: verdicts under the same rule (first
    step and gate) and the same ``preroute``."""
    return saved.rule == spec.rule and saved.spec == spec.preroute


def _whole_only(client: Mapping[str, Any], *, chat: bool) -> bool:
    """Whether ``client`` (a non-streaming client's body: a streaming one's is refused these) asks what
    vLLM refuses with ``stream`` (400, ``extproc.routing.sampling``): ``prompt_logprobs`` (other than 0),
    or a completion's ``use_beam_search``."""
    if client.get("prompt_logprobs") not in (None, 0):
        return True
    return not chat and client.get("use_beam_search") is True


@dataclass(frozen=True, slots=True)
class Answered:
    """A gated step's answer passed: the client gets ``body`` (``content_type``) from step ``step``
    (1-based) ``model``."""

    body: bytes
    content_type: str
    step: int
    model: str


@dataclass(frozen=True, slots=True)
class Replayed:
    """A gated step passed on its first ``k`` tokens (``replay``): the client's request goes to step
    ``step`` (1-based) ``model`` again, with the gated step's seed (:meth:`Run.replay_body`), via Envoy."""

    step: int
    model: str


@dataclass(slots=True)
class Run:
    """One request's way through ``spec`` (module docstring). ``client``: the client's body (validated,
    JSON-decoded); ``chat``: a chat request (else completions); ``arrived``: when the request arrived
    (seconds of the processor's clock). ``verdicts``: per gated step so far, its model and verdict."""

    spec: CascadeSpec
    virtual: str
    client: Mapping[str, Any]
    chat: bool
    arrived: float
    step: int = 0
    verdicts: list[tuple[str, Verdict]] = field(default_factory=list)
    #: The current step read as a stream (a ``first_k`` gate), else ``None``.
    stream: StepStream | None = None
    #: The request's hashed features, when its cascade learns (``preroute``).
    features: tuple[int, ...] | None = None
    #: Sent straight to the last step (``preroute``): no gated step ran.
    preskipped: bool = False
    #: The seed of every request of a ``replay`` run (a streaming client's; ``None``: not replayed).
    seed: int | None = None
    #: The current step passed on its first tokens and goes again through Envoy (:class:`Replayed`).
    replaying: bool = False

    @property
    def model(self) -> str:
        """The current step's model."""
        return self.spec.steps[self.step]

    @property
    def gated(self) -> bool:
        """Whether the current step is gated: every step but the last, unless it is being replayed."""
        return self.step < len(self.spec.steps) - 1 and not self.replaying

    @property
    def number(self) -> int:
        """The current step, 1-based (what ``x-kvgate-cascade-step`` says)."""
        return self.step + 1

    @property
    def streamed(self) -> bool:
        """Whether the gated steps are read as streams (``first_k``: decided after ``k`` tokens), unless the
        client's body asks what vLLM refuses streamed (:func:`_whole_only`): then sent whole, the first
        ``k`` tokens judged on the whole answer."""
        return self.spec.stat == "first_k" and not _whole_only(self.client, chat=self.chat)

    def body(self) -> bytes:
        """The current gated step's request body (a ``first_k`` gate: streamed, read by :meth:`feed`)."""
        replays = self.seed is not None
        n = self.client.get("n")  # checked (an integer >= 1) before the run starts; else one choice
        choices = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
        self.stream = (
            StepStream(self.spec, chat=self.chat, stop_on_pass=replays, n=choices) if self.streamed else None
        )
        return step_body(self.client, self.model, chat=self.chat, stream=self.streamed, seed=self.seed)

    def replay_body(self) -> dict[str, Any]:
        """The client's body for the replayed step: its own fields and the seed (the step's ``model`` is
        set where every step's is, ``rewrite_model``)."""
        assert self.replaying and self.seed is not None, "replay_body() only for a replayed step"
        return {**self.client, "seed": self.seed}

    def feed(self, line: bytes) -> bool:
        """One line of a streamed step's answer; false: the gate failed on its first tokens, stop reading."""
        assert self.stream is not None, "feed() only for a streamed step"
        return self.stream.feed(line)

    def judge(self, answer: bytes | None, failure: str | None = None) -> Answered | Replayed | None:
        """The current gated step ended: ``answer`` its 2xx body (a streamed step: ``None``, its lines went
        to :meth:`feed`), else ``failure`` (``timeout``, ``unreachable``, ``status``). :class:`Answered`
        when the gate passes (:class:`Replayed` when it passed on the first tokens of a replayed run), else
        ``None`` (call :meth:`escalate`)."""
        doc: Any = None
        stream, self.stream = self.stream, None
        if stream is not None and failure is None:  # a streamed step: judged early, or assembled now
            if stream.cut and stream.verdict is not None:
                self.verdicts.append((self.model, stream.verdict))
                if stream.verdict.passed:  # stop_on_pass: this run replays
                    self.replaying = True
                    return Replayed(self.number, self.model)
                return None
            doc = stream.answer()
            answer = None
            if doc is None:
                failure = "bad_answer"
        if answer is not None:
            try:
                doc = orjson.loads(answer)
            except orjson.JSONDecodeError:
                failure = "bad_answer"
            else:
                if not isinstance(doc, dict) or not well_shaped(doc, chat=self.chat):
                    failure = "bad_answer"
        if failure is not None or doc is None:
            self.verdicts.append((self.model, Verdict(None, False, failure or "bad_answer")))
            return None
        verdict = judge(self.spec, doc)
        self.verdicts.append((self.model, verdict))
        if not verdict.passed:
            return None
        body, content_type = client_answer(doc, self.client, self.model, chat=self.chat)
        return Answered(body, content_type, self.number, self.model)

    def escalate(self) -> str:
        """Move to the next step; its model."""
        assert self.gated, "the last step has nowhere to go"
        self.step += 1
        return self.model
