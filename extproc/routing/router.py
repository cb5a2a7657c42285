"""The routing core: one request in, an ordered list of endpoints out.

parse (done by :mod:`extproc.routing.request`) -> render + tokenize (refusing prompts over the model's
context, :mod:`extproc.routing.length`) -> chained digests -> index lookup -> filters -> scorers -> picker.
Pure bookkeeping on top of the fleet and the index: no IO, no clock reads (``now`` is passed in), so the
same object serves the gRPC shell, tests and benchmarks.

Tokenize only what can match: digests are chained, so once a block is held by no endpoint nor node store
(:meth:`~extproc.index.interface.PrefixIndex.held`), no later block can be. :meth:`Router.tokens`
tokenizes piece by piece (long pieces in chunks, :class:`~extproc.models.tokenizer.PrefixCursor`) and
hashes each block as soon as it is complete, stopping at the first one nobody holds
(:class:`LazyPrompt`). The index match over that prefix equals the match over the whole window, and so
does every lead (GPU or kvcached), so a follow-up turn (its history held, its new reply and message not)
stops one block into its new text. The rest of the window is tokenized only when something needs it,
after the answer where it can: :meth:`Router.commit` (off the request's critical path; the gRPC shell
first finishes it in a worker thread when much is left to tokenize, :meth:`LazyPrompt.settle`) records
the whole window, so the index learns exactly what it learned before.

A follow-up does not walk its held history either: the commit remembers the lazy path's state at the
previous prompt's last turn boundary (:class:`~extproc.routing.history.HistoryMemo`), and the next turn,
whose rendered prompt starts with those pieces, resumes there when every digest of it is still held
(:meth:`LazyPrompt.resume`): the same ids, digests and decision as the walk.

Which prompt length each consumer uses:

- token budgets (admission, ``exact_count``): the exact count, the whole prompt tokenized;
- the context-length check: exact as far as it needs (:mod:`extproc.routing.length`: a byte bound, or the
  leading ``allowed + 1`` tokens counted);
- the ``prefix`` and ``kv-tier`` scorers' denominator (``SchedulingRequest.prompt_blocks``,
  :meth:`Router.scored_blocks`): the window's exact blocks when a lead covers it all, else the blocks
  estimated from the rendered prompt's UTF-8 bytes at the model's tokens-per-byte ratio
  (:attr:`Tokens.estimated`, :meth:`Router.ratio`), at least one past the longest lead: a function of
  the prompt, the index and the learned ratio, never of how far the prompt was tokenized, so the pick is
  the one full tokenization would make (``tests/extproc/routing/test_lazy_tokens.py``);
- ``SchedulingRequest.prompt_tokens`` and ``Decision.prompt_tokens`` (:attr:`Tokens.count`; the TTFT
  predictor, the SLO check): exact when the whole prompt was tokenized, else estimated from the
  characters left at the tokenized part's characters-per-token ratio
  (:meth:`~extproc.models.tokenizer.PrefixCursor.estimate`: a prompt past the digest window, or one whose
  tokenization stopped at the first unheld block). Disaggregation's uncached tokens (``prompt_tokens -
  matched x block_size``, its conditional threshold) count the window exactly
  (:meth:`extproc.disagg.plan.Disaggregator.plan`): a follow-up's new turn may be far denser in tokens
  than its history, so a request that may be paired (or forwarded: federation's check hashes the
  window) has its window tokenized whole where it is prepared (:meth:`Router.tokens` ``window``, in the
  ext_proc's worker thread for a large body);
- ``Decision.prompt_blocks`` (the prefix hit-ratio metric, the access log's ``blocks``, federation's
  ``worth_hashing``): ``len(digests)``, or with ``rest`` set the larger of that and ``prompt_tokens``'s
  blocks;
- work that needs the whole window's chain gets it by finishing ``rest``: the speculative index record
  and federation's ``note`` after the answer; federation's forward (when ``worth_hashing`` says a peer
  could win) and disaggregation's prefill pick (:mod:`extproc.disagg.plan`, which records the window at
  the prefill endpoint) before it; the slot restore (:mod:`extproc.control.restore`) needs only the
  blocks up to its lead, which the digests always reach.

What it decides by (the scheduling profile, per-model routes and the index block size) is one frozen
:class:`RoutingPolicy`, swapped as a whole by :meth:`Router.apply` when the policy in force changes
(:mod:`extproc.control.cluster` builds it); a request reads it once, so it never sees half a change.
"""

from __future__ import annotations

import logging
import random
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple, Protocol

import orjson

from contracts.digest import ChainCache, Digest, chain_seed
from contracts.errors import ConfigError
from contracts.events import EndpointId, node_store_endpoint
from contracts.tracing import Timeline
from extproc.errors import NotFound, Unavailable
from extproc.fleet import EndpointState, Fleet
from extproc.index.interface import PrefixIndex
from extproc.index.working_set import WorkingSet
from extproc.models.registry import ModelAssets, ModelRegistry
from extproc.models.tokenizer import PrefixCursor, SegmentTokenizer
from extproc.routing.history import HistoryMemo, Holdings
from extproc.routing.length import ContextLimit, Verdict, triage
from extproc.routing.request import CHAT_KINDS, POOLING_KINDS, Kind, ParsedRequest
from extproc.scheduling.interface import CycleState, SchedulingRequest
from extproc.scheduling.predict import TTFTPredictor
from extproc.scheduling.profile import Profile

log = logging.getLogger(__name__)

#: For models served by the fleet but with no tokenizer configured, digests are taken over the
#: request's UTF-8 bytes, one "token" per byte, in blocks of ``block_size * BYTES_PER_TOKEN`` bytes.
#: Approximate (no chat template), but prefix affinity still works for engines kvgate knows nothing of.
BYTES_PER_TOKEN = 4
#: Requests remembered between their decision and their completion (:meth:`Router.completed`), at most;
#: beyond it the oldest is forgotten, so completions Envoy never reports (a lost log entry, a request
#: refused after its decision) cost a bounded table, and their routed counts end at the next scrape.
MAX_OPEN_REQUESTS = 65_536
#: Seconds a routed request counts as outstanding without a completion (a lost log, a stream Envoy
#: never proxied): longer than any request's own bound.
OPEN_TTL_S = 900.0
#: The role of endpoints that only compute prompts for a decode endpoint (:mod:`extproc.disagg`).
PREFILL_ROLE = "prefill"
#: ``Endpoint.engine`` of SGLang's server (``engines.sglang.KIND``).
SGLANG = "sglang"


def alone(state: EndpointState) -> bool:
    """Whether the endpoint serves a request by itself, with no prefill half beside it: all but an SGLang
    server of role decode (started with ``--disaggregation-mode decode``, it answers a request without a
    bootstrap room 400 ``Disaggregated request received without bootstrap room id``)."""
    return not (state.endpoint.engine == SGLANG and state.endpoint.role == "decode")


#: Prompts a model's learned tokens-per-byte ratio averages over, about (:meth:`Router.ratio`).
RATIO_MEMORY = 32
#: Characters left to tokenize in a prompt's rest of the window (:attr:`LazyPrompt.chars_left`) from which
#: the ext_proc settles it in a worker thread after the answer (``[extproc] offload_rest_chars``;
#: extproc/README.md: the measurement).
OFFLOAD_REST_CHARS = 1024


class Unattainable(Exception):
    """Every candidate is predicted, from a confident line (:meth:`TTFTPredictor.confident`), to send the
    first token later than the request's TTFT budget allows: ``predicted_s`` the best prediction,
    ``budget_s`` the budget. Flow control sheds such a request (429 ``slo_unattainable``)."""

    def __init__(self, predicted_s: float, budget_s: float) -> None:
        super().__init__(f"predicted TTFT {predicted_s:.3f} s over the budget {budget_s:.3f} s")
        self.predicted_s = predicted_s
        self.budget_s = budget_s


@dataclass(slots=True)
class Decision:
    """A routing decision and its bookkeeping until the request finishes.

    ``endpoints``: the pick then the fallbacks. ``matched_blocks``: leading blocks the pick was known
    to hold. ``kv_lead_blocks``: the longest run of leading blocks some node's kvcached holds (0 when
    none, or no kvcached is followed). ``served``: where Envoy really sent it (read back on the response
    path). ``rest``: set when ``digests`` stop at the first block nobody held (the lazy path);
    :meth:`Router.commit` then hashes the rest of the window before recording, and ``digests`` becomes
    the whole window's chain. ``prompt_blocks``: the prompt's full blocks within the window (``max_blocks``
    at most), what hit ratios divide by: ``len(digests)``, or with ``rest`` set an estimate from the
    prompt's estimated length. ``scored_blocks``: what the ``prefix`` and ``kv-tier`` scorers divided by
    (:meth:`Router.scored_blocks`). ``prompt_bytes`` and ``counted``: the rendered prompt's UTF-8 bytes
    and whether ``prompt_tokens`` is its exact length (:attr:`Tokens.counted`), from which
    :meth:`Router.commit` learns the model's tokens-per-byte ratio.
    """

    request_id: str
    model: str
    endpoints: list[EndpointState]
    digests: Sequence[Digest]
    prompt_tokens: int
    matched_blocks: int
    kv_lead_blocks: int = 0
    served: EndpointState | None = None
    finished: bool = field(default=False)
    recorded: bool = field(default=False)
    rest: LazyPrompt | None = None
    prompt_blocks: int = 0
    scored_blocks: int = 0
    prompt_bytes: int = 0
    counted: bool = False

    @property
    def destination(self) -> str:
        """The EPP destination value: ``ip:port`` of the pick, then fallbacks, comma-separated."""
        return ",".join(s.address for s in self.endpoints)


@dataclass(frozen=True, slots=True)
class Route:
    """A per-model route (etcd ``models/<name>``): only endpoints carrying all of ``labels`` serve the model,
    scheduled by ``profile``."""

    labels: tuple[tuple[str, str], ...]
    profile: Profile

    def admits(self, state: EndpointState) -> bool:
        held = state.endpoint.labels
        return all(label in held for label in self.labels)


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """What the router decides by, applied as one value (:meth:`Router.apply`).

    ``profile``: the scheduling profile of models without a route; ``routes``: per-model routes (model
    name -> :class:`Route`); ``block_size``: tokens per index block, the gateway's one block size
    (prompts are hashed in blocks of it; the policy path ``index/block_size``, default
    ``[index] block_size``; a change means prefixes are learned again).
    """

    profile: Profile
    routes: Mapping[str, Route] = field(default_factory=lambda: MappingProxyType({}))
    block_size: int = 16

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")


@dataclass(frozen=True, slots=True)
class Tokens:
    """The prompt as the engine will see it.

    ``ids``: token ids (or, when not ``exact``, bytes standing in for them), possibly only the leading
    ones the digests use; ``block_size``: units per index block; ``count``: the prompt length in tokens
    (estimated when not ``exact`` or when ``ids`` stop early). ``rest``: set when ``ids`` stop at the
    first block nobody held (:class:`LazyPrompt`, which tokenizes on when asked; its chain, for the
    request the tokens were made for, is ``rest.digests``), or when the window was tokenized whole for a
    paired request (:meth:`Router.tokens` ``window``: ``rest`` complete); ``None`` when ``ids`` cover the
    digest window or the whole prompt. ``chain``: the digests already hashed for these ids by the lazy path
    (what :meth:`Router.digests` returns then, instead of hashing again); ``None`` otherwise.
    ``estimated``: the prompt's length in tokens estimated from its rendered UTF-8 bytes (``nbytes``) at
    the model's tokens-per-byte ratio (:meth:`Router.ratio`): a function of the prompt alone, the same
    however far it was tokenized, which the ``prefix`` and ``kv-tier`` scorers' denominator is taken
    from (:meth:`Router.decide`); ``None``: use ``count``. ``counted``: ``count`` is the exact length of
    the whole prompt (it was tokenized to its end).
    """

    ids: Sequence[int]
    block_size: int
    exact: bool
    count: int
    rest: LazyPrompt | None = None
    chain: Sequence[Digest] | None = None
    estimated: int | None = None
    nbytes: int = 0
    counted: bool = False


class LazyPrompt:
    """A prompt tokenized and hashed block by block on demand, up to the digest window.

    Invariants: ``cursor.ids`` is exactly a prefix of the prompt's full tokenization, and ``digests`` is
    exactly the chain of its complete blocks within the window (``window`` blocks at most), so a prefix
    of the full chain. Not thread-safe: one request uses it at a time.
    """

    __slots__ = (
        "_chains",
        "block_size",
        "cursor",
        "digests",
        "estimated",
        "history",
        "nbytes",
        "origin",
        "seed",
        "text",
        "window",
    )

    def __init__(
        self,
        cursor: PrefixCursor,
        seed: Digest,
        block_size: int,
        window: int,
        chains: ChainCache,
        *,
        estimated: int | None = None,
        nbytes: int = 0,
        history: HistoryMemo | None = None,
    ) -> None:
        self.cursor = cursor
        self.seed = seed
        self.block_size = block_size
        self.window = window
        self._chains = chains
        self.digests: list[Digest] = []
        #: :attr:`Tokens.estimated` and :attr:`Tokens.nbytes` of the prompt (fixed when it is made).
        self.estimated = estimated
        self.nbytes = nbytes
        #: Where a chat prompt's state is resumed from and remembered (:mod:`extproc.routing.history`).
        self.history = history
        #: The prompt's text when known (a chat prompt's: its state is then remembered by text too).
        self.text: str | None = None
        #: The key of the remembered state this prompt was resumed from (or found unheld), if any.
        self.origin: int | None = None

    @classmethod
    def open(
        cls,
        tokenizer: SegmentTokenizer,
        text: str,
        special: bool,
        seed: Digest,
        block_size: int,
        window: int,
        chains: ChainCache,
        index: Holdings,
        *,
        estimated: int | None = None,
        nbytes: int = 0,
        history: HistoryMemo | None = None,
    ) -> LazyPrompt:
        """A lazy prompt over ``text`` (``special``: with the post-processor's tokens) resumed at the
        longest boundary ``history`` remembers for it whose digests are all held: found by its text
        (:meth:`HistoryMemo.open`, cutting only the text after it) or else by its pieces (the text cut
        whole, :meth:`resume`)."""
        opened = None
        if history is not None and not special:
            opened = history.open(tokenizer, text, seed, block_size, window, index)
        cursor = tokenizer.cursor(text, add_special_tokens=special) if opened is None else opened[0]
        lazy = cls(
            cursor, seed, block_size, window, chains, estimated=estimated, nbytes=nbytes, history=history
        )
        lazy.text = text
        if opened is None:
            lazy.resume(index)
            return lazy
        found, lazy.origin = opened[1], opened[2]
        if found is not None:
            lazy.digests = list(found)
        return lazy

    def resume(self, index: Holdings) -> bool:
        """Start a fresh prompt at the longest boundary :attr:`history` remembers for it whose digests
        are all held (the state the walk there would reach); returns whether it did."""
        if self.history is None or self.digests:
            return False
        found = self.history.resume(self.cursor, self.seed, self.block_size, self.window, index)
        if found is None:
            return False
        self.digests = list(found[0])
        self.origin = found[1]
        return True

    @property
    def chars_left(self) -> int:
        """Characters of the prompt not tokenized yet: a bound on what :meth:`settle` tokenizes (it stops
        at the window's end, or the end of the piece the window filled in), which the gRPC shell weighs
        to settle it off the event loop (``ProcessorConfig.offload_rest_chars``)."""
        return self.cursor.chars_left

    def settle(self) -> None:
        """:meth:`finish`, then the work :meth:`remember` starts with (:meth:`HistoryMemo.settle`: the
        piece in which a full window ended, tokenized to its end): what the commit of a prompt with much
        left to tokenize (:attr:`chars_left`) does off the event loop. Safe in a worker thread while the
        loop runs other requests: it changes only this prompt, the tokenizer's segment cache (locked) and
        the chain memo (whose entries are what BLAKE3 returns: a race between threads can lose an entry
        or a hit count, never change a digest), and reads the history memo's bound; the index and the
        history memo are written by the commit after it, on the loop."""
        self.finish()
        if self.history is not None:
            self.history.settle(self.cursor, self.block_size, self.window, self.digests)

    def remember(self, held: tuple[int, int] | None = None) -> None:
        """Remember this prompt's state for the next turn (after :meth:`finish`): at the boundary after
        the piece in which a full window ended, else at its last boundary before the window is full.
        ``held``: ``(generation, n)``, the first ``n`` digests known held at that index generation
        (:meth:`HistoryMemo.remember`)."""
        if self.history is not None:
            self.history.remember(
                self.cursor,
                self.seed,
                self.block_size,
                self.window,
                self.digests,
                text=self.text,
                held=held,
                parent=self.origin,
            )

    @property
    def complete(self) -> bool:
        """Whether ``digests`` is the whole window's chain (the window is full or the prompt ends)."""
        return len(self.digests) >= self.window or self.cursor.done

    def extend(self, unheld: Callable[[Sequence[Digest], int], int]) -> bool:
        """Tokenize and hash on until a digest nobody holds is in ``digests`` (from the last one known
        on; ``unheld(digests, start)``: the index of the first such from ``start``, else
        ``len(digests)``, :meth:`~extproc.index.interface.PrefixIndex.unheld`), or :attr:`complete`.
        Every digest before that one is held, so the index match over ``digests`` equals the match over
        the whole chain. Returns whether it hashed more."""
        start = max(len(self.digests) - 1, 0)  # those before were held when hashed
        before = len(self.digests)
        while True:
            digests = self.digests
            if unheld(digests, start) < len(digests):
                return len(digests) > before
            start = len(digests)
            if self.complete:
                return len(digests) > before
            self._hash_step()

    def finish(self) -> None:
        """Tokenize and hash the rest of the window."""
        while not self.complete:
            self._hash_step()

    def tokens(self, keep: bool = False) -> Tokens:
        """A snapshot: the ids so far, the length estimate (exact once the prompt is done) and, unless
        :attr:`complete`, this prompt as ``rest`` (with ``keep``: always, so the commit still remembers its
        state for the next turn, :meth:`remember`)."""
        cursor = self.cursor
        rest = None if self.complete and not keep else self
        return Tokens(
            cursor.ids[:],  # an array's copy: one buffer copy
            self.block_size,
            True,
            cursor.estimate(),
            rest,
            list(self.digests),
            self.estimated,
            self.nbytes,
            cursor.done,
        )

    def _hash_step(self) -> None:
        """Tokenizer steps until a block completes (or the prompt ends), then the digests of the blocks
        they completed (within the window). Short pieces (a role marker, a cached message) go in one call:
        no digest can be asked for before its block is complete."""
        cursor, size = self.cursor, self.block_size
        have = len(self.digests)
        cursor.advance((have + 1) * size)
        full = min(len(cursor.ids) // size, self.window)
        if full > have:
            parent = self.digests[-1] if have else self.seed
            self.digests.extend(self._chains.digests(parent, cursor.ids[have * size : full * size], size))


class RoutingListener(Protocol):
    """Hears of the router's bookkeeping (:mod:`extproc.control.siblings` shares it with sibling workers).
    Called on the router's thread, after Envoy has its answer; must be cheap and never raise."""

    def recorded(self, endpoint: EndpointId, digests: Sequence[Digest], now: float) -> None:
        """``digests`` were recorded for ``endpoint`` at ``now`` (a decision, or the move to where Envoy
        served it); in-flight counts changed with it."""

    def released(self, endpoint: EndpointId) -> None:
        """A request's in-flight slot at ``endpoint`` was released, or a request routed there completed
        (:meth:`Router.completed`): its counts changed."""


class Router:
    """Decides where requests go and keeps in-flight counts and the speculative index up to date."""

    def __init__(
        self,
        fleet: Fleet,
        models: ModelRegistry,
        index: PrefixIndex,
        policy: RoutingPolicy,
        *,
        max_blocks: int = 256,
        rng: random.Random | None = None,
        working_set: WorkingSet | None = None,
        chain_memo_entries: int = 200_000,
        history: HistoryMemo | None = None,
    ) -> None:
        self.fleet = fleet
        self.models = models
        self.index = index
        self._policy = policy
        self.max_blocks = max_blocks
        self._rng = rng or random.Random()
        #: What ``cache-spread`` reads (``CycleState.cached_blocks``): the blocks routed to each endpoint
        #: lately; ``None``: the index's occupancy instead.
        self.working_set = working_set
        self._chains = ChainCache(chain_memo_entries)  # ``[index] chain_memo_entries``
        #: Chat prompts' lazy-path states at turn boundaries (:mod:`extproc.routing.history`).
        self.history = history if history is not None else HistoryMemo()
        #: Model name -> learned tokens per byte (:meth:`ratio`).
        self._ratios: dict[str, float] = {}
        self._node_stores: frozenset[str] = frozenset()
        self._store_nodes: dict[EndpointId, str] = {}  # each node store's index id -> its node
        #: Told of each record and release (``None``: nobody listens).
        self.listener: RoutingListener | None = None
        #: Routed, not yet reported complete: request id -> the endpoint serving it (oldest first).
        self._open: OrderedDict[str, tuple[EndpointState, float]] = OrderedDict()
        #: The open table's bound (:data:`MAX_OPEN_REQUESTS`; tests lower it).
        self.max_open = MAX_OPEN_REQUESTS
        #: TTFT per endpoint, learned from the engines' TTFT histograms and this router's requests.
        self.predictor = TTFTPredictor()
        #: LoRA adapter -> its base model, from the fleet's endpoints (``None``: rebuild at next use).
        self._adapter_bases: dict[str, str] | None = None
        fleet.watch(self._fleet_changed)

    def _fleet_changed(self) -> None:
        self._adapter_bases = None
        # An endpoint that leaves the fleet takes what was learned of it along (no growth with churn).
        self.predictor.retain({state.id for state in self.fleet})

    @property
    def policy(self) -> RoutingPolicy:
        """The policy in force (replace it with :meth:`apply`)."""
        return self._policy

    def apply(self, policy: RoutingPolicy) -> None:
        """Put ``policy`` in force for every request decided from now on (one swap: a request in
        progress keeps the policy it started with)."""
        self._policy = policy

    @property
    def node_stores(self) -> frozenset[str]:
        """Nodes whose kvcached reports its tiers to the index (set by :mod:`extproc.control.cluster`); empty:
        the warm-tier lookup is skipped."""
        return self._node_stores

    @node_stores.setter
    def node_stores(self, nodes: frozenset[str]) -> None:
        self._node_stores = nodes
        self._store_nodes = {EndpointId(node_store_endpoint(node)): node for node in nodes}

    def tokens(
        self,
        request: ParsedRequest,
        *,
        exact_count: bool = False,
        timeline: Timeline | None = None,
        window: bool = False,
    ) -> Tokens:
        """Render and tokenize exactly as the engine does (or the byte fallback for unknown tokenizers).

        With ``exact_count`` (token budgets need the real length) the whole prompt is tokenized; when
        the context-length check must count (:mod:`extproc.routing.length`), the leading ``allowed + 1``
        tokens or the digest window, whichever is more. Otherwise only up to the first block that no
        endpoint nor node store holds (``rest`` is then set, see :class:`LazyPrompt`) or the digest
        window (``max_blocks`` blocks), and the length is estimated. With ``window`` (a request
        disaggregation may plan, whose uncached count is exact within the window:
        :meth:`extproc.disagg.plan.Disaggregator.plan`; or one federation may forward, whose check hashes
        the window: :meth:`extproc.federation.forwarding.Forwarder.may_forward`) the lazy path goes on to
        the window's end here, where the caller tokenizes (the ext_proc: in a worker thread for large
        bodies), not in the plan or the forward check on the event loop; ``rest`` then stays set,
        complete, for the commit's record and memory. Raises
        :class:`~extproc.errors.ContextLengthExceeded` (400) when the model's context length is known and
        the prompt leaves no room in it for an output token.

        ``timeline`` (a traced request): the phases ``render`` and ``tokenize`` are marked on it (on the
        lazy path ``tokenize`` includes hashing each block as it completes and asking the index for it).
        """
        block_size = self._policy.block_size
        assets = self.models.find(request.model)
        if assets is None:  # a LoRA adapter tokenizes as its base model
            base = self.adapter_base(request.model)
            assets = None if base is None else self.models.find(base)
        if assets is None:
            tokens = self._byte_tokens(request, block_size)
        else:
            llama = request.kind is Kind.CHAT and self._llama_renders(request)
            found, nbytes = _token_ids(
                assets, request, self.max_blocks * block_size, exact_count, timeline, llama=llama
            )
            estimated = None if nbytes is None else round(nbytes * self.ratio(assets))
            if isinstance(found, _Pending):
                lazy = LazyPrompt.open(
                    assets.tokenizer,
                    found.text,
                    found.special,
                    self.seed(request),
                    block_size,
                    self.max_blocks,
                    self._chains,
                    self.index,
                    estimated=estimated,
                    nbytes=nbytes or 0,
                    # a chat with add_special_tokens starts with the post-processor's ids, which the
                    # memo's states (keyed by pieces) do not carry: it neither reads nor feeds the memo
                    history=self.history if request.kind in CHAT_KINDS and not found.special else None,
                )
                lazy.extend(self.index.unheld)
                if window:
                    lazy.finish()
                tokens = lazy.tokens(keep=window)
            else:
                ids, count = found  # exact: a prompt that fits is counted to its end (_token_ids)
                if estimated is None:
                    estimated = count
                tokens = Tokens(ids, block_size, True, count, None, None, estimated, nbytes or 0, True)
        if timeline is not None:
            timeline.mark("tokenize")
        return tokens

    def _llama_renders(self, request: ParsedRequest) -> bool:
        """Whether the chat is one llama-server renders apart from vLLM (its last message the assistant's,
        or a ``developer`` message: :func:`_llama_render`) and every endpoint serving its model is
        llama.cpp."""
        messages = request.messages
        last = messages[-1] if messages else None
        prefill = isinstance(last, Mapping) and last.get("role") == "assistant" and len(messages) > 1
        if not prefill and not any(isinstance(m, Mapping) and m.get("role") == "developer" for m in messages):
            return False
        engines = {s.endpoint.engine for s in self.fleet if request.model in s.endpoint.models}
        return engines == {LLAMA_CPP}

    def ratio(self, assets: ModelAssets) -> float:
        """Tokens per UTF-8 byte of ``assets``'s prompts: learned from the prompts this router tokenized to
        their end (:meth:`commit`, after each answer: an average over about the last
        :data:`RATIO_MEMORY` of them), starting from the calibrated :attr:`ModelAssets.tokens_per_byte`."""
        return self._ratios.get(assets.name, assets.tokens_per_byte)

    def _learn(self, model: str, tokens: int, nbytes: int) -> None:
        """A prompt for ``model`` was ``tokens`` tokens in ``nbytes`` bytes: move its ratio towards it."""
        assets = self.models.find(model)
        if assets is None:  # a LoRA adapter tokenizes as its base model
            base = self.adapter_base(model)
            assets = None if base is None else self.models.find(base)
        if assets is None or nbytes <= 0 or tokens <= 0:
            return
        ratio = self.ratio(assets)
        self._ratios[assets.name] = ratio + (tokens / nbytes - ratio) / RATIO_MEMORY

    def seed(self, request: ParsedRequest) -> Digest:
        """The request's chain seed (:func:`contracts.digest.chain_seed`): for a model some endpoint lists
        as a LoRA adapter (``Endpoint.adapters``), that endpoint's base model with the adapter; else the
        model itself; with the request's ``cache_salt`` either way. The same fields the agent reads from
        the engine's events, so a LoRA or salted prompt matches what engines report."""
        base = self.adapter_base(request.model)
        if base is None:
            return chain_seed(request.model, salt=request.cache_salt)
        return chain_seed(base, lora=request.model, salt=request.cache_salt)

    def knows(self, model: str) -> bool:
        """Whether ``model`` is a name this gateway serves: some endpoint of the fleet declares it (a model
        or a LoRA adapter, whatever the endpoint's health, drain or ejection), the config's ``[[models]]``
        name it (:attr:`models`, aliases included), or a route is declared for it (``[routing]`` or etcd
        ``models/<name>``). A request for a name it does not know is 404 ``model_not_found``
        (:meth:`decide`; flow control's waiting room never holds it); one it knows with no endpoint now is
        503 ``no_endpoint`` (or waits in the waiting room: scale-from-zero, a restart)."""
        return (
            model in self._policy.routes
            or self.models.find(model) is not None
            or any(model in state.endpoint.models for state in self.fleet)
        )

    def adapter_base(self, model: str) -> str | None:
        """The base model of ``model`` when some endpoint lists it as a LoRA adapter, else ``None``."""
        bases = self._adapter_bases
        if bases is None:  # rebuilt after each fleet change (membership goes through Fleet's methods)
            bases = {}
            for state in self.fleet:
                base = state.endpoint.base_model
                if base is not None:
                    for adapter in state.endpoint.adapters:
                        bases.setdefault(adapter, base)
            self._adapter_bases = bases
        return bases.get(model)

    def digests(self, request: ParsedRequest, tokens: Tokens) -> list[Digest]:
        """The prompt's chained block digests: only the leading ``max_blocks`` blocks, the only ones that
        can ever match (memoised: a follow-up turn re-hashes only its new blocks). Tokens of the lazy
        path carry their chain (``chain``), already hashed as far as they were tokenized."""
        if tokens.chain is not None:
            return list(tokens.chain)
        hashed = tokens.ids[: self.max_blocks * tokens.block_size]
        seed = self.seed(request)
        return self._chains.digests(seed, hashed, tokens.block_size)

    def check_deadline(self, request: ParsedRequest, tokens: Tokens, budget_s: float, now: float) -> None:
        """Raise :class:`Unattainable` when ``request``, dispatched right now, would miss ``budget_s``
        seconds on every endpoint its route admits that serves requests itself (not prefill-only), each
        confidently predicted with its prefix match: a lower bound for a request about to wait in flow
        control's queue, so one shed here could not have been served in time later. Healthy, not
        draining; nothing is recorded."""
        predictor = self.predictor
        route = self._policy.routes.get(request.model)
        candidates = [
            s
            for s in self.fleet
            if request.model in s.endpoint.models
            and s.healthy
            and not s.draining
            and s.endpoint.role != PREFILL_ROLE
            and (route is None or route.admits(s))
        ]
        if not candidates or not all(predictor.confident(c.id) for c in candidates):
            return
        digests = self.digests(request, tokens)
        matched = self.index.match(digests, now)
        block_size = self._policy.block_size
        best = min(
            predictor.predict(c, max(0, tokens.count - matched.get(c.id, 0) * block_size), now)
            for c in candidates
        )
        if best > budget_s:
            raise Unattainable(best, budget_s)

    def decide(
        self,
        request: ParsedRequest,
        *,
        request_id: str,
        now: float,
        subset: frozenset[str] | None = None,
        pinned: Sequence[str] | None = None,
        tokens: Tokens | None = None,
        admit: Callable[[EndpointState], bool] | None = None,
        ttft_budget_s: float | None = None,
        timeline: Timeline | None = None,
        prefer: str | None = None,
        paired: bool = False,
    ) -> Decision:
        """Pick endpoints for ``request``.

        ``subset``: EPP subset hint (``ip:port`` addresses allowed; applied here as well as by the
        ``subset`` filter, so a profile without that filter still honours it). ``pinned``: conformance-test
        selection (``ip`` or ``ip:port`` entries); only ever narrows the fleet. ``tokens``: the prompt
        if already tokenized by the caller (:meth:`tokens`; admission counts it before routing).
        ``admit``: flow control's test of an endpoint's room; when some candidate passes it, only those
        are scheduled (a saturated endpoint is never picked while another has room).
        ``ttft_budget_s``: seconds left of the request's TTFT deadline; the candidates' TTFT is then
        predicted (:attr:`predictor`) for the ``slo`` filter.
        ``prefer``: an endpoint id put first (the others scheduled stay its fallbacks) when it is a candidate
        (the model's, the route's labels, subset and pinned) and routable now (healthy, not draining, not
        ejected), whatever flow control's room filter says (``previous_response_id`` affinity:
        :mod:`extproc.affinity`); else it changes nothing.
        ``paired``: the decision may be paired with a prefill half (``extproc/disagg`` plans it next, its
        model's serving spec not aggregated); only then are SGLang servers of role decode candidates, since
        one refuses a request that comes without a bootstrap room (400).
        Raises :class:`NotFound` for a model it does not know (:meth:`knows`), :class:`Unavailable` when no
        endpoint is ready (none serves a model it knows, none is routable),
        :class:`Unattainable` when every candidate is confidently predicted to miss ``ttft_budget_s``.
        """
        candidates = [s for s in self.fleet if request.model in s.endpoint.models]
        if not candidates:
            if not self.knows(request.model):
                raise NotFound(
                    f"The model `{request.model}` does not exist.", code="model_not_found", param="model"
                )
            raise Unavailable(f"No ready endpoint for model `{request.model}`.", code="no_endpoint")
        # Prefill-only endpoints never serve a request themselves (extproc/disagg pairs them), nor do
        # SGLang decode servers unless the request may be paired.
        candidates = [
            s
            for s in candidates
            if (role := s.endpoint.role) != PREFILL_ROLE and (paired or role != "decode" or alone(s))
        ]
        policy = self._policy
        route = policy.routes.get(request.model)
        profile = policy.profile
        if route is not None:
            candidates = [s for s in candidates if route.admits(s)]
            profile = route.profile
        if subset is not None:  # the protocol's MUST, whatever filters the profile lists
            candidates = [s for s in candidates if s.endpoint.address in subset]
        if pinned is not None:
            candidates = [s for s in candidates if is_pinned(s.address, pinned)]
        eligible = candidates
        if admit is not None:  # flow control: only endpoints with room, while some has room
            roomy = [s for s in candidates if admit(s)]
            candidates = roomy or candidates
        if tokens is None:
            tokens = self.tokens(request, timeline=timeline)
        elif tokens.rest is not None and tokens.rest.extend(self.index.unheld):
            tokens = tokens.rest.tokens()  # made earlier: the index has since learned the stopping block
            if timeline is not None:
                timeline.mark("tokenize")
        digests = self.digests(request, tokens)
        if timeline is not None:
            timeline.mark("digest")
        working_set = self.working_set
        state = CycleState(
            prefix_blocks=self.index.match(digests, now),
            cached_blocks=self.index.occupancy() if working_set is None else working_set.sizes(now),
        )
        is_precise = self.index.is_precise
        state.exact = all(is_precise(c.id) for c in candidates)
        if self.node_stores:
            self._warm(state, candidates, digests)
        if timeline is not None:
            timeline.mark("lookup")
        predictor = self.predictor
        block_size = policy.block_size  # tokens per block, whatever stands in for tokens
        scored_blocks = self.scored_blocks(tokens, digests, state)
        if ttft_budget_s is not None or profile.predicts:
            matched = state.prefix_blocks
            predicted = {
                c.id: predictor.predict(c, max(0, tokens.count - matched.get(c.id, 0) * block_size), now)
                for c in candidates
            }
            state.predicted_ttft = predicted
            if ttft_budget_s is not None and predicted:
                best = min(predicted.values())
                if best > ttft_budget_s and all(predictor.confident(c.id) for c in candidates):
                    raise Unattainable(best, ttft_budget_s)
        sched = SchedulingRequest(
            request_id=request_id,
            model=request.model,
            digests=digests,
            prompt_tokens=tokens.count,
            now=now,
            subset=subset,
            ttft_budget_s=ttft_budget_s,
            prompt_blocks=scored_blocks,
        )
        result = profile.schedule(sched, state, candidates, self._rng)
        if timeline is not None:
            timeline.mark("schedule")
        endpoints = list(result.endpoints)
        if prefer is not None:
            endpoints = _preferred(endpoints, eligible, prefer, now)
        if not endpoints:
            raise Unavailable(f"No ready endpoint for model `{request.model}`.", code="no_endpoint")
        primary = endpoints[0]
        primary.in_flight += 1
        primary.routed_since_scrape += 1
        primary.count_routed(now)
        if request.model in primary.endpoint.adapters or request.model in primary.lora_recent:
            primary.saw_adapter(request.model, now)  # the adapter will be loaded there (LoRA affinity)
        self._opened(request_id, primary, now)
        uncached = max(0, tokens.count - state.prefix_blocks.get(primary.id, 0) * block_size)
        predictor.routed(request_id, primary, uncached, now)
        return Decision(
            request_id=request_id,
            model=request.model,
            endpoints=endpoints,
            digests=digests,
            prompt_tokens=tokens.count,
            matched_blocks=state.prefix_blocks.get(primary.id, 0),
            kv_lead_blocks=max(state.peer_warm_blocks, state.warm_blocks.get(primary.id, 0)),
            served=primary,
            rest=tokens.rest,
            prompt_blocks=(
                len(digests)
                if tokens.rest is None
                else max(len(digests), min(self.max_blocks, tokens.count // tokens.block_size))
            ),
            scored_blocks=scored_blocks,
            prompt_bytes=tokens.nbytes,
            counted=tokens.counted,
        )

    def scored_blocks(self, tokens: Tokens, digests: Sequence[Digest], state: CycleState) -> int:
        """The prompt's blocks as the ``prefix`` and ``kv-tier`` scorers divide by
        (``SchedulingRequest.prompt_blocks``), the same whether ``tokens`` stop at the first block nobody
        holds (the lazy path) or cover the window: with ``lead`` the longest lead anywhere (GPU or either
        kvcached tier) and ``T`` the window's blocks,

        - ``T`` when some lead covers the whole window (a full hit scores 1); the lazy path then reached
          the window's end, since every block was held;
        - else ``max(min(max_blocks, estimated // block_size), lead + 1)``: the estimate from the
          prompt's bytes (:attr:`Tokens.estimated`), never below one block past the longest lead, so
          every score stays below 1. No lead reaches the lazy path's stopping block, so neither figure
          depends on how far it tokenized.
        """
        lead = max(
            max(state.prefix_blocks.values(), default=0),
            max(state.warm_blocks.values(), default=0),
            state.peer_warm_blocks,
        )
        if (tokens.rest is None or tokens.rest.complete) and lead >= len(digests):
            return len(digests)
        estimated = tokens.count if tokens.estimated is None else tokens.estimated
        return max(min(self.max_blocks, estimated // tokens.block_size), lead + 1)

    def _warm(
        self, state: CycleState, candidates: Sequence[EndpointState], digests: Sequence[Digest]
    ) -> None:
        """Fill ``state.warm_blocks`` (each candidate's lead in its own node's kvcached) and
        ``state.peer_warm_blocks`` (the longest lead in any node's kvcached)."""
        leads = self.index.node_leads(self._store_nodes, digests)
        if not leads:
            return
        by_node = {self._store_nodes[key]: n for key, n in leads.items()}
        state.peer_warm_blocks = max(by_node.values())
        state.warm_blocks = {s.id: by_node[s.endpoint.node] for s in candidates if s.endpoint.node in by_node}

    def commit(self, decision: Decision, now: float) -> None:
        """Record the decision in the index as speculative entries for the pick (and in the working set).

        Separate from :meth:`decide` so the gRPC shell can send Envoy its answer first and do this
        bookkeeping (about as costly as hashing the prompt) off the request's critical path.
        """
        if not decision.recorded and decision.served is not None:
            decision.recorded = True
            rest = decision.rest
            self._record_window(decision, decision.served.id, now)
            counted = decision.prompt_tokens if decision.counted else None
            if rest is not None and rest.cursor.done:  # the window held the whole prompt
                counted = len(rest.cursor.ids)
            if counted is not None and decision.prompt_bytes:
                self._learn(decision.model, counted, decision.prompt_bytes)

    def served(self, decision: Decision, address: str, now: float) -> None:
        """Envoy reports where the request really went; move the bookkeeping if it was a fallback."""
        current = decision.served
        if current is not None and current.address == address:
            return
        state = self.fleet.by_address(address)
        if state is None:
            log.warning("request %s served by unknown address %s", decision.request_id, address)
            return
        if current is not None and not decision.finished:
            current.in_flight = max(0, current.in_flight - 1)
            current.routed_since_scrape = max(0, current.routed_since_scrape - 1)
        if current is not None:
            current.count_routed(now, -1.0)
        state.in_flight += 1
        state.routed_since_scrape += 1
        state.count_routed(now)
        moved = self._open.get(decision.request_id)
        if moved is not None:
            moved[0].outstanding -= 1
            state.outstanding += 1
            self._open[decision.request_id] = (state, moved[1])
        self.predictor.moved(decision.request_id, state, now)
        decision.served = state
        decision.recorded = True
        self._record_window(decision, state.id, now)

    def _record_window(self, decision: Decision, endpoint: EndpointId, now: float) -> None:
        """Record the decision's digests over the whole window at ``endpoint`` (hashing the rest of a lazy
        prompt first, then remembering its state for the next turn: its digests known held when the
        record made nothing unheld, :mod:`extproc.routing.history`)."""
        rest = decision.rest
        if rest is not None:
            rest.finish()
            decision.digests = list(rest.digests)
            decision.rest = None
        index = self.index
        before = index.generation
        recorded = self._record(endpoint, decision.digests, now)
        if rest is not None:
            after = index.generation
            held = min(len(decision.digests), index.max_match_blocks)
            rest.remember((after, held) if recorded and after == before else None)

    def record(self, endpoint: EndpointId, digests: Sequence[Digest], now: float) -> None:
        """Record that ``endpoint`` computes ``digests`` for a request it was picked for outside
        :meth:`decide` (a prefill sub-request, :mod:`extproc.disagg`): index, working set, listener."""
        self._record(endpoint, digests, now)

    def _record(self, endpoint: EndpointId, digests: Sequence[Digest], now: float) -> bool:
        """Index, working set, listener; ``False`` (nothing recorded) when ``endpoint`` left the fleet
        meanwhile (a record after the answer, once its removal dropped it from the index: it would come
        back there, and a new process reusing the id be credited with its cache)."""
        if self.fleet.get(endpoint) is None:
            return False
        self.index.record(endpoint, digests, now)
        if self.working_set is not None:
            self.working_set.record(endpoint, digests, now)
        if self.listener is not None:
            self.listener.recorded(endpoint, digests, now)
        return True

    def _opened(self, request_id: str, state: EndpointState, now: float) -> None:
        """Remember that ``request_id`` is at ``state`` until its completion, forgetting the oldest
        beyond :attr:`max_open` or older than :data:`OPEN_TTL_S`; ``EndpointState.outstanding`` follows."""
        opened = self._open
        before = opened.pop(request_id, None)
        if before is not None:
            before[0].outstanding -= 1
        opened[request_id] = (state, now)
        state.outstanding += 1
        while opened:
            oldest_id, (oldest, at) = next(iter(opened.items()))
            if len(opened) <= self.max_open and now - at <= OPEN_TTL_S:
                break
            del opened[oldest_id]
            oldest.outstanding -= 1

    def routing(self, request_id: str) -> bool:
        """Whether ``request_id`` is a request this router routed and has not seen complete."""
        return request_id in self._open

    def completed(self, request_id: str, now: float) -> EndpointState | None:
        """Envoy reported that ``request_id`` ended at its engine (a completion log entry, or the
        response's end on the request's ext_proc stream behind a gateway without that log; monotonic
        ``now``): if this router routed it, count one completion at the endpoint that served it
        (``completed_since_scrape``, which :attr:`EndpointState.load` subtracts), tell the listener, and
        return that endpoint; ``None`` for a request it did not route (a sibling's or another replica's),
        already reported, or forgotten (:data:`MAX_OPEN_REQUESTS`). Each request counts once."""
        found = self._open.pop(request_id, None)
        if found is None:
            return None
        self.predictor.forget(request_id)
        state = found[0]
        state.outstanding -= 1
        state.completed_since_scrape += 1
        if self.listener is not None:
            self.listener.released(state.id)
        return state

    def finish(self, decision: Decision) -> None:
        """The request's stream ended (completed, failed or cancelled): release its in-flight slot."""
        if decision.finished:
            return
        decision.finished = True
        if decision.served is not None:
            decision.served.in_flight = max(0, decision.served.in_flight - 1)
            if self.listener is not None:
                self.listener.released(decision.served.id)

    def models_body(self, allowed: Callable[[str], bool] | None = None) -> bytes:
        """The OpenAI ``/v1/models`` list of every model the fleet serves (that ``allowed`` accepts)."""
        models = [m for m in self.fleet.models() if allowed is None or allowed(m)]
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "kvgate"} for m in models]
        return orjson.dumps({"object": "list", "data": data})

    def _byte_tokens(self, request: ParsedRequest, block_size: int) -> Tokens:
        if request.kind in CHAT_KINDS:
            raw = orjson.dumps([request.messages, request.tools])
        elif isinstance(request.prompt, str):
            raw = request.prompt.encode()
        else:
            ids = list(request.prompt or ())
            return Tokens(ids, block_size, True, len(ids))
        block = block_size * BYTES_PER_TOKEN
        return Tokens(array("B", raw[: self.max_blocks * block]), block, False, len(raw) // BYTES_PER_TOKEN)


class _Pending(NamedTuple):
    """A prompt's text left to tokenize lazily (``special``: with the post-processor's tokens)."""

    text: str
    special: bool


def _token_ids(
    assets: ModelAssets,
    request: ParsedRequest,
    window: int,
    exact_count: bool,
    timeline: Timeline | None,
    *,
    llama: bool = False,
) -> tuple[tuple[Sequence[int], int] | _Pending, int | None]:
    """(token ids, prompt length in tokens): all ids with ``exact_count``; at least the first
    ``max(window, allowed + 1)`` when the context check must count (the rest's length is then
    estimated); else the prompt's text, nothing tokenized (the prompt fits the context or the context
    is unknown: the caller tokenizes as far as it needs, :meth:`LazyPrompt.open`). With it, the
    rendered prompt's UTF-8 bytes (``None`` for a prompt of token ids). Raises ContextLengthExceeded for
    a prompt that leaves no room in the context. ``llama``: the chat is rendered as llama-server renders it
    (:func:`_llama_render`)."""
    chat = request.kind in CHAT_KINDS
    # A pooling request has no output token to leave room for: the engine checks its own length.
    limit = None if request.kind in POOLING_KINDS else ContextLimit.of(assets.max_model_len, chat)
    text = _llama_render(assets, request) if chat and llama else None
    if text is not None:
        if timeline is not None:
            timeline.mark("render")
        special = False
    elif chat:
        text = assets.template.render(
            request.messages,
            tools=request.tools,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            documents=request.documents,
            extra=request.template_kwargs,
        )
        if timeline is not None:
            timeline.mark("render")
        special = request.add_special_tokens
    elif isinstance(request.prompt, str):
        text, special = request.prompt, True
    else:
        ids = list(request.prompt or ())
        if limit is not None:
            limit.check(len(ids))
        return (ids, len(ids)), None
    nbytes = len(text.encode("utf-8", "surrogatepass"))
    tokenizer = assets.tokenizer
    counting = False
    if limit is not None:
        found, fewest = triage(text, limit.allowed, tokenizer.bounds, special)
        if found is Verdict.TOO_LONG:
            raise limit.exceeded(fewest)
        counting = found is Verdict.COUNT
    if exact_count and not counting:
        ids = tokenizer.encode(text, add_special_tokens=special)
        return (ids, len(ids)), nbytes
    if limit is None or not counting:
        return _Pending(text, special), nbytes
    # Counting the leading allowed + 1 tokens also gives the exact length of every prompt that fits.
    needed = max(window, limit.allowed + 1)
    ids, count = tokenizer.encode_prefix(text, add_special_tokens=special, limit=needed)
    limit.check(len(ids))
    return (ids, count), nbytes


#: ``Endpoint.engine`` of llama.cpp's server (``engines.llama_cpp.KIND``).
LLAMA_CPP = "llama_cpp"


def _llama_render(assets: ModelAssets, request: ParsedRequest) -> str | None:
    """The prompt llama-server makes of a chat (as its ``/apply-template`` answers, build 11434): a
    ``developer`` message is a ``system`` one; when the last message is the assistant's (its assistant
    prefill, on by default), the messages before it rendered with the generation prompt, then that
    message's text (its text parts joined by a blank line) left open, or with no text, those messages
    without the generation prompt. ``None`` when that last message holds anything but text (rendered
    as usual then)."""
    messages = [
        {**m, "role": "system"} if isinstance(m, Mapping) and m.get("role") == "developer" else m
        for m in request.messages
    ]
    last = messages[-1]
    if not (isinstance(last, Mapping) and last.get("role") == "assistant" and len(messages) > 1):
        return assets.template.render(
            messages,
            tools=request.tools,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            extra=request.template_kwargs,
        )
    before = messages[:-1]
    content = last.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
            return None
        texts = [p.get("text") for p in content]
        if not all(isinstance(t, str) for t in texts):
            return None
        content = "\n\n".join(texts)
    if content is not None and not isinstance(content, str):
        return None
    text = assets.template.render(
        before, tools=request.tools, add_generation_prompt=bool(content), extra=request.template_kwargs
    )
    return text + content if content else text


def _preferred(
    endpoints: list[EndpointState], eligible: Sequence[EndpointState], prefer: str, now: float
) -> list[EndpointState]:
    """``endpoints`` with ``prefer`` first when it is eligible and routable at ``now`` (the list keeps its
    length: the last fallback gives way), else unchanged."""
    state = next((s for s in eligible if s.id == prefer), None)
    if state is None or not state.healthy or state.draining or state.ejected(now):
        return endpoints
    rest = [s for s in endpoints if s.id != prefer]
    return [state, *rest][: max(len(endpoints), 1)]


def is_pinned(address: str, pinned: Sequence[str]) -> bool:
    """Whether the conformance pin ``pinned`` (``ip`` or ``ip:port`` entries) names ``address``."""
    host = address.rpartition(":")[0]
    return any(p in (address, host) for p in pinned)
