"""The engine core: continuous batching over a prefix cache, sans IO. Time is passed in, never read.

Requests wait in a FIFO queue and run, at most ``max_num_seqs`` at once, in steps. The driver calls
:meth:`Engine.schedule` with the current time, which plans one step and says when it ends (from
:class:`~load.sim.timing.TimingModel`), then, at that time, :meth:`Engine.complete`, which returns the
tokens the step produced. A step gives one token to every running sequence past its prefill and
spends what is left of ``max_num_batched_tokens`` on uncached prompt tokens (chunked prefill), first
for running sequences still in prefill, then for newly admitted ones. The step that computes a prompt's
last token samples its first output token, as in vLLM.

A request is admitted only when the cache can give it blocks for its whole prompt and output; the
longest cached prefix of its prompt is reused and never recomputed (at least one prompt token is
always computed, so a fully cached prompt still costs one token). Output tokens are fixed by the caller
up front: the engine only decides when each appears.

A request added with ``remote_prefill`` (a decode replica of a prefill/decode pair) had its prompt
computed elsewhere: on admission every prompt token but the last counts as computed (the KV arrived by
transfer, :meth:`TimingModel.transfer_s`, charged by the caller before it adds the request), its blocks
are registered at once, and the one step that computes the last token samples the first output token.

Priorities (``scheduling_policy = "priority"``, vLLM's ``--scheduling-policy priority``): each request
has an integer ``priority``, lower first; the waiting queue is ordered by ``(priority, arrival)``
instead of arrival alone. vLLM preempts only when the KV cache runs out; with ``priority_preemption``
(SGLang's ``--enable-priority-scheduling``, whose preemption is on by default, in vLLM's order: SGLang's
``--schedule-low-priority-values-first``) a waiting request also preempts when the running batch is full:
the running request of the highest ``(priority, arrival)`` is preempted when the waiting head's
priority is lower than its by more than ``priority_preemption_threshold``. A preempted request goes back
to the waiting queue and loses its KV (recompute, as both engines do); its full blocks stay in the
prefix cache, so on resumption it recomputes only the tokens past its last full block (prompt and
output so far: the step that computes them samples its next token).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from contracts.digest import Digest, block_digests
from load.sim.cache import CacheListener, PrefixCache
from load.sim.lora import LoraSlots
from load.sim.power import EnergyMeter, PowerModel
from load.sim.timing import TimingModel

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler and cache shape. ``num_blocks`` x ``block_size`` is the KV capacity in tokens
    (default ~450k tokens: an 8B bf16 model on an 80 GB GPU at 90% memory utilisation)."""

    block_size: int = 16
    num_blocks: int = 28_000
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    #: "fcfs" or "priority" (module docstring).
    scheduling_policy: str = "fcfs"
    priority_preemption: bool = False
    priority_preemption_threshold: int = 0
    #: LoRA adapter slots (vLLM ``--max-loras``; :mod:`load.sim.lora`).
    max_loras: int = 1

    def __post_init__(self) -> None:
        sizes = ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
        for name in (*sizes, "max_loras"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}")
        if self.priority_preemption and self.scheduling_policy != "priority":
            raise ValueError("priority_preemption needs scheduling_policy 'priority'")
        if self.priority_preemption_threshold < 0:
            raise ValueError("priority_preemption_threshold must be >= 0")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError("the KV cache (num_blocks * block_size) must hold max_model_len tokens")


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """The token one step sampled for one request. ``cached_tokens``: prompt tokens served from the
    prefix cache; ``ttft_s``: seconds from arrival to this token if it is the first, else ``None``."""

    request_id: str
    token_ids: tuple[int, ...]
    finished: bool
    cached_tokens: int
    ttft_s: float | None = None


@dataclass(slots=True)
class EngineStats:
    """Cumulative counters, in tokens unless named otherwise (the sources of the vLLM counters)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    #: Running requests sent back to the waiting queue (vLLM's ``num_preemptions``).
    preemptions: int = 0
    #: Requests decoded after a remote prefill, and the prompt tokens whose KV they received.
    remote_prefills: int = 0
    remote_prefill_tokens: int = 0
    #: Prefills answered with transfer params for a remote decode, and seconds spent receiving KV
    #: (both counted by the serving layer).
    remote_decodes: int = 0
    remote_prefill_seconds: float = 0.0
    #: Seconds of the engine's timeline spent in steps (busy; ``time_scale`` applied): its engine-seconds.
    busy_seconds: float = 0.0


@dataclass(eq=False, slots=True)
class _Seq:
    request_id: str
    prompt_len: int
    tokens: list[int]  # the prompt, then output tokens as they are sampled
    output: Sequence[int]  # every output token this request will produce
    arrival: float
    digests: list[Digest]  # chain digests of the full blocks of ``tokens`` known so far
    seed: Digest  # the chain's seed (model, adapter, salt)
    num_computed: int = 0  # tokens whose KV is computed (cached ones included)
    num_cached: int = 0
    num_output: int = 0
    num_committed: int = 0  # leading blocks registered in the cache (hits included)
    done: bool = False
    remote: bool = False  # prefilled elsewhere: the prompt's KV arrives by transfer
    priority: int = 0  # lower first ("priority" scheduling)
    prefill_len: int = 0  # tokens to compute before it decodes: the prompt, or all so far once preempted
    lora: str | None = None  # the LoRA adapter's name (None: the base model)
    salt: str | None = None  # the request's cache_salt

    def __post_init__(self) -> None:
        if not self.prefill_len:
            self.prefill_len = self.prompt_len

    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_len


@dataclass(frozen=True, slots=True)
class Step:
    """One planned forward pass from ``start`` to ``end`` (seconds on the driver's clock)."""

    start: float
    end: float
    decode: tuple[_Seq, ...]
    prefill: tuple[tuple[_Seq, int], ...] = field(default=())

    @property
    def n_prefill_tokens(self) -> int:
        """Uncached prompt tokens computed in this step."""
        return sum(n for _, n in self.prefill)


class Engine:
    """One simulated engine replica: scheduler, prefix cache and timing model."""

    def __init__(
        self,
        config: EngineConfig,
        timing: TimingModel,
        seed: Digest,
        listener: CacheListener | None = None,
        power: PowerModel | None = None,
    ) -> None:
        self.config = config
        self.timing = timing
        #: The GPU's power model (``None``: no power simulated, steps as the timing model says); with
        #: one, steps take ``1 / gpu.speed`` as long, and longer still when the power cap lowers clocks.
        self.power = power
        #: Energy and draw on the driver's clock (with a power model).
        self.meter = None if power is None else EnergyMeter(power.gpu.idle_w, 0.0)
        self.cache = PrefixCache(config.num_blocks, config.block_size, listener)
        #: The LoRA adapters in GPU slots.
        self.loras = LoraSlots(config.max_loras)
        self.stats = EngineStats()
        self._seed = seed
        self._seqs: dict[str, _Seq] = {}
        self._waiting: deque[_Seq] = deque()
        self._held: dict[str, list[_Seq]] = {}  # first choice's id -> its siblings, until its prefill ends
        self._running: list[_Seq] = []
        self._in_flight: Step | None = None

    @property
    def num_running(self) -> int:
        """Requests admitted (in prefill or decode)."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission."""
        return len(self._waiting)

    def lora_requests(self) -> tuple[list[str], list[str]]:
        """The adapters of running and of waiting requests (each once, sorted): vLLM's
        ``vllm:lora_requests_info`` labels."""
        running = sorted({s.lora for s in self._running if s.lora is not None})
        waiting = sorted({s.lora for s in self._waiting if s.lora is not None})
        return running, waiting

    @property
    def kv_usage(self) -> float:
        """Fraction 0..1 of KV blocks pinned by running requests."""
        return self.cache.kv_usage

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._running or self._waiting)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        now: float,
        siblings: Sequence[tuple[str, Sequence[int]]] = (),
        *,
        remote_prefill: bool = False,
        priority: int = 0,
        seed: Digest | None = None,
        lora: str | None = None,
        salt: str | None = None,
    ) -> None:
        """Queue a request that will produce exactly ``output_token_ids``; ``now`` is its arrival.
        ``remote_prefill``: its prompt was computed by another replica; ``priority``: lower first under
        the "priority" scheduling policy, else ignored (module docstring). ``seed``: its chain seed
        (``chain_seed(model, lora, salt)``; ``None``: the engine's), ``lora``/``salt`` its adapter and cache
        salt as its KV events name them.

        ``siblings`` (id, output) are the other choices of an ``n`` > 1 request: they share this
        request's prefill, so they wait until its prompt is computed, then go to the head of the queue
        and take its cached prompt blocks (vLLM's child requests hit the blocks the first one
        allocated); each then decodes as a sequence of its own."""
        seqs = [
            self._new_seq(rid, prompt_token_ids, out, now, seed or self._seed)
            for rid, out in ((request_id, output_token_ids), *siblings)
        ]
        for seq in seqs:
            seq.lora, seq.salt = lora, salt
            self._seqs[seq.request_id] = seq
            seq.priority = priority
        seqs[0].remote = remote_prefill
        self._enqueue(seqs[0])
        if len(seqs) > 1:
            self._held[request_id] = seqs[1:]

    def _new_seq(
        self, request_id: str, prompt: Sequence[int], output: Sequence[int], now: float, seed: Digest
    ) -> _Seq:
        if request_id in self._seqs:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not prompt or not output:
            raise ValueError("prompt and output must each hold at least one token")
        if len(prompt) + len(output) > self.config.max_model_len:
            raise ValueError("prompt plus output exceed max_model_len")
        tokens = list(prompt)
        digests = block_digests(seed, tokens, self.config.block_size)
        return _Seq(request_id, len(tokens), tokens, output, now, digests, seed)

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is and release its blocks; unknown ids are ignored. Siblings
        still waiting on an aborted request's prefill are queued at the head."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        seq.done = True
        if seq in self._running:
            self._running.remove(seq)
            self.cache.free(request_id)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        for held in self._held.values():
            if seq in held:
                held.remove(seq)
        self._release_siblings(seq)

    def _release_siblings(self, seq: _Seq) -> None:
        self._waiting.extendleft(reversed(self._held.pop(seq.request_id, [])))

    def _enqueue(self, seq: _Seq) -> None:
        """Queue ``seq``: at the tail (fcfs), or after every request of lower ``(priority, arrival)``."""
        if self.config.scheduling_policy == "fcfs":
            self._waiting.append(seq)
            return
        key = (seq.priority, seq.arrival)
        at = len(self._waiting)
        while at > 0 and (self._waiting[at - 1].priority, self._waiting[at - 1].arrival) > key:
            at -= 1
        self._waiting.insert(at, seq)

    def _preempt_for_head(self) -> bool:
        """With priority preemption and a full batch: preempt the running request of the highest
        ``(priority, arrival)`` for the waiting head if the head's priority beats it by more than the
        threshold; whether one was preempted."""
        cfg = self.config
        if not (cfg.priority_preemption and self._waiting and len(self._running) >= cfg.max_num_seqs):
            return False
        head = self._waiting[0]
        victim = max(self._running, key=lambda s: (s.priority, s.arrival))
        if victim.priority - head.priority <= cfg.priority_preemption_threshold:
            return False
        self._running.remove(victim)
        self.cache.free(victim.request_id)
        victim.num_computed = victim.num_committed = 0
        victim.prefill_len = max(victim.prompt_len, len(victim.tokens))
        victim.remote = False
        self.stats.preemptions += 1
        self._enqueue(victim)
        return True

    def schedule(self, now: float) -> Step | None:
        """Plan the next step starting at ``now``; ``None`` when nothing can run."""
        if self._in_flight is not None:
            raise RuntimeError("a step is already in flight")
        while self._preempt_for_head():
            pass
        decode = tuple(s for s in self._running if not s.in_prefill())
        budget = self.config.max_num_batched_tokens - len(decode)
        prefill: list[tuple[_Seq, int]] = []
        for seq in self._running:
            if budget <= 0:
                break
            if seq.in_prefill():
                chunk = min(budget, seq.prefill_len - seq.num_computed)
                prefill.append((seq, chunk))
                budget -= chunk
        skipped: list[_Seq] = []  # waiting for a LoRA slot: requests behind them may go first, as in vLLM
        loaded = 0
        while budget > 0 and self._waiting and len(self._running) < self.config.max_num_seqs:
            seq = self._waiting[0]
            busy = {s.lora for s in self._running if s.lora is not None}
            if seq.lora is not None and not self.loras.can_run(seq.lora, busy):
                skipped.append(self._waiting.popleft())
                continue
            if not self._admit(seq):
                break  # FIFO: the head waits for blocks, and so does everyone behind it
            self._waiting.popleft()
            self._running.append(seq)
            if seq.lora is not None:
                loaded += self.loras.use(seq.lora, busy)
            chunk = min(budget, seq.prefill_len - seq.num_computed)
            prefill.append((seq, chunk))
            budget -= chunk
        self._waiting.extendleft(reversed(skipped))
        if not decode and not prefill:
            return None
        n_prefill = sum(n for _, n in prefill)
        duration = self.timing.step_s(len(decode), n_prefill) + self.timing.lora_s(loaded)
        if self.power is not None and self.meter is not None:
            cfg = self.config
            watts, ratio = self.power.step(
                len(decode), n_prefill, cfg.max_num_seqs, cfg.max_num_batched_tokens
            )
            duration = duration / self.power.gpu.speed / ratio
            self.meter.begin(now, now + duration, watts, ratio)
        step = Step(now, now + duration, decode, tuple(prefill))
        self._in_flight = step
        return step

    def complete(self, step: Step) -> list[TokenEvent]:
        """Apply a finished step (at ``step.end``) and return the tokens it produced."""
        if step is not self._in_flight:
            raise RuntimeError("complete() must be given the step in flight")
        self._in_flight = None
        if self.meter is not None:
            self.meter.end(step.end)
        self.stats.busy_seconds += step.end - step.start
        events: list[TokenEvent] = []
        for seq in step.decode:
            if not seq.done:
                seq.num_computed += 1
                events.append(self._sample(seq, step.end))
        for seq, n in step.prefill:
            if seq.done:
                continue
            seq.num_computed += n
            if seq.num_computed == seq.prefill_len:
                first = seq.num_output == 0
                if first:
                    self.stats.prompt_tokens += seq.prompt_len
                events.append(self._sample(seq, step.end))
                if first:
                    self._release_siblings(seq)
            else:
                self._commit(seq)
        return events

    def _admit(self, seq: _Seq) -> bool:
        bs = self.config.block_size
        kv_tokens = seq.prompt_len + len(seq.output) - 1  # the last sampled token is never computed
        n_blocks = -(-kv_tokens // bs)
        prefix = seq.digests[: (seq.prefill_len - 1) // bs] if self.config.enable_prefix_caching else []
        hits = self.cache.allocate(seq.request_id, prefix, n_blocks)
        if hits is None:
            return False
        seq.num_computed = hits * bs
        if seq.num_output == 0:  # a resumed request keeps its first admission's figure (usage)
            seq.num_cached = seq.num_computed
        seq.num_committed = hits
        self.stats.prefix_cache_queries += seq.prefill_len
        self.stats.prefix_cache_hits += hits * bs
        if seq.remote:  # the KV of every prompt token but the last arrived from the prefill replica
            self.stats.remote_prefills += 1
            self.stats.remote_prefill_tokens += max(0, seq.prompt_len - 1 - seq.num_computed)
            seq.num_computed = max(seq.num_computed, seq.prompt_len - 1)
            self._commit(seq)
        return True

    def cached_prefix_tokens(self, prompt_token_ids: Sequence[int], seed: Digest | None = None) -> int:
        """Prompt tokens a request for ``prompt_token_ids`` (chain ``seed``, default the engine's) would
        find cached now (whole blocks, at most all but the last token, as on admission)."""
        if not self.config.enable_prefix_caching:
            return 0
        bs = self.config.block_size
        digests = block_digests(seed or self._seed, list(prompt_token_ids), bs)
        return self.cache.match(digests[: (len(prompt_token_ids) - 1) // bs]) * bs

    def prompt_blocks(self, prompt_token_ids: Sequence[int], seed: Digest | None = None) -> list[int]:
        """The cache's block numbers holding the prompt's leading full blocks now (a prefill replica's
        ``remote_block_ids``)."""
        bs = self.config.block_size
        return self.cache.block_ids(block_digests(seed or self._seed, list(prompt_token_ids), bs))

    def _sample(self, seq: _Seq, now: float) -> TokenEvent:
        token = seq.output[seq.num_output]
        seq.tokens.append(token)
        seq.num_output += 1
        self.stats.generation_tokens += 1
        self._commit(seq)
        finished = seq.num_output == len(seq.output)
        if finished:
            seq.done = True
            del self._seqs[seq.request_id]
            self._running.remove(seq)
            self.cache.free(seq.request_id)
            self.stats.requests_finished += 1
        ttft = max(0.0, now - seq.arrival) if seq.num_output == 1 else None
        return TokenEvent(seq.request_id, (token,), finished, seq.num_cached, ttft)

    def _commit(self, seq: _Seq) -> None:
        if not self.config.enable_prefix_caching:
            return
        bs = self.config.block_size
        n_full = seq.num_computed // bs
        if n_full == seq.num_committed:
            return
        have = len(seq.digests)
        if n_full > have:
            parent = seq.digests[-1] if have else None
            seq.digests += block_digests(
                seq.seed, seq.tokens[: n_full * bs], bs, start=have * bs, parent=parent
            )
        self.cache.commit(seq.request_id, seq.digests[:n_full], seq.tokens, seq.lora, seq.salt)
        seq.num_committed = n_full
