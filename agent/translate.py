"""vLLM KV events -> kvgate index events for one engine endpoint (DESIGN.md contract 2). Sans IO.

An engine names its blocks by its own hashes (``block_hashes``), which kvgate cannot recompute. The
:class:`Translator` rebuilds kvgate's chained digests (:func:`contracts.digest.block_digests`, seed
``chain_seed(model, lora=lora_name, salt=cache_salt)``, the seed the router computes for the same
request) from the ``token_ids`` each ``BlockStored`` carries, continuing
the chain from the parent block's state, and keeps a map engine hash -> that state so a later child
can continue the chain and a ``BlockRemoved`` can name the digests that left.

Engine and index block sizes may differ. A block's state is the last complete index digest up to its
end plus the tokens after it (``leftover``, shorter than one index block); an engine block *completes*
the index blocks that end inside it, and those digests belong to it: they are stored with it and
removed with it. With an engine block of ``k`` index blocks each engine block completes ``k`` digests;
with an index block of ``k`` engine blocks, every ``k``-th one completes one. Any sizes work this way.

Rules, after llm-d's indexer: a ``BlockStored`` whose parent is unknown (never seen, or already
removed) cannot be chained: it is skipped and counted (``stats.unknown_parent``), and the blocks
hanging from it are skipped in turn; a subscriber that lost events should call :meth:`Translator.reset`.
``BlockRemoved`` of unknown hashes is ignored and counted. A digest is removed from a tier when no
engine block holding it there is left. ``AllBlocksCleared`` clears every tier. Mediums GPU, CPU and
STORAGE are tiers gpu, cpu and disk. Only KV cache group 0 is translated (hybrid models publish one
stream per group; the others are counted in ``stats.other_groups``).

LoRA and cache salt (:func:`vllm_salt`): vLLM hashes a block with extra keys ``lora + multimodal +
cache_salt + prompt_embeds``, the salt on a sequence's first block only, and publishes them per block in
``extra_keys``. A block with no parent starts a chain: its seed takes the event's ``lora_name`` and the
salt read from its extra keys; every later block of the chain inherits its parent's seed (the salt is in
the chain, as in vLLM's hash). Other extra keys (multimodal identifiers, prompt embeddings) are not part
of kvgate's digest.

Memory is bounded by what the engine holds: a block's state is dropped when it leaves its last tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from agent.errors import AgentConfigError
from agent.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, KvEvent
from contracts.digest import MAX_TOKEN_ID, Digest, block_digests, chain_seed
from contracts.events import Cleared, IndexEvent, Removed, Stored

MEDIUM_TIERS = {"GPU": "gpu", "CPU": "cpu", "STORAGE": "disk"}
"""vLLM ``medium`` -> kvgate tier; a missing medium is GPU."""
#: Seeds memoised per (adapter, salt), at most (salts may be per user: beyond it seeds are recomputed).
MAX_SEEDS = 4096


def vllm_salt(keys: Sequence[Any] | None, lora: str | None) -> str | None:
    """The ``cache_salt`` in the extra keys of a sequence's first block, as vLLM builds them: the LoRA key
    first (the adapter's name; its integer id in older releases) when the request has an adapter, then
    multimodal keys (``(identifier, offset)`` tuples; bare identifier strings in older releases), then
    the salt (a string), then prompt-embedding keys (bytes). The salt is the last string after the LoRA
    key; ``None`` when there is none. A first block holding an older release's multimodal identifiers and
    no salt would read one of them as the salt: such prompts cannot match kvgate's digests anyway (the
    router does not hash images). Keys that are no list (a malformed event): no salt."""
    if not keys or not isinstance(keys, list | tuple):
        return None
    rest = list(keys)[1:] if lora is not None else list(keys)
    strings = [k for k in rest if isinstance(k, str)]
    return strings[-1] if strings else None


@dataclass(slots=True)
class TranslatorStats:
    """Counters, in engine blocks unless named otherwise."""

    stored: int = 0
    removed: int = 0
    unknown_parent: int = 0
    """``BlockStored`` events skipped because their parent is unknown (a gap)."""
    unknown_removed: int = 0
    other_groups: int = 0
    """Events of KV cache groups other than 0."""
    unknown_medium: int = 0
    """Events with a medium that has no kvgate tier."""
    malformed: int = 0
    """``BlockStored`` events whose token count is not ``len(block_hashes) * block_size``, or with a token id
    outside 0..2^32 - 1 (:data:`contracts.digest.MAX_TOKEN_ID`)."""
    clears: int = 0
    failed_batches: int = 0
    """Batches that could not be translated (malformed beyond the checks above), each reported as lost
    events: the endpoint's entries cleared (:func:`agent.main.feed_batches`)."""


@dataclass(slots=True)
class _Block:
    """What the translator knows of one engine block."""

    tail: Digest | None
    """The last complete index digest up to this block's end (``None``: none yet)."""
    leftover: tuple[int, ...]
    """Tokens after ``tail``'s index block, up to this block's end."""
    before: Digest | None
    """The index digest before the first of ``digests`` (the chain's parent)."""
    digests: tuple[Digest, ...]
    seed: Digest
    """The chain's seed (model, adapter, salt of the sequence the block belongs to)."""
    """Index blocks this engine block completes."""
    tiers: set[str]


class Translator:
    """Translates one engine's events into index events for ``endpoint``; ``model`` seeds the chain,
    ``block_size`` is the index's block size in tokens."""

    def __init__(self, endpoint: str, model: str, block_size: int) -> None:
        if block_size <= 0:
            raise AgentConfigError(f"index block_size must be positive, got {block_size}")
        self.endpoint = endpoint
        self.model = model
        self.block_size = block_size
        self.stats = TranslatorStats()
        self._blocks: dict[EngineHash, _Block] = {}
        self._held: dict[tuple[str, Digest], int] = {}
        self._seeds: dict[tuple[str | None, str | None], Digest] = {}
        self._pad = [0] * block_size

    @property
    def num_blocks(self) -> int:
        """Engine blocks currently known (in any tier)."""
        return len(self._blocks)

    def apply(self, events: Iterable[KvEvent]) -> list[IndexEvent]:
        """The index events for a batch of engine events, in order."""
        out: list[IndexEvent] = []
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event, out)
            elif isinstance(event, BlockRemoved):
                self._removed(event, out)
            else:
                assert isinstance(event, AllBlocksCleared)
                out.append(self._clear())
        return out

    def reset(self) -> list[IndexEvent]:
        """Forget everything (events were lost): the index events that say so."""
        return [self._clear()]

    def snapshot(self) -> list[IndexEvent]:
        """``Stored`` events for every digest the engine is believed to hold (for a subscriber that
        needs a full resync), in the order the engine stored them; consecutive blocks of one chain in
        one tier are merged into one event."""
        runs: list[tuple[str, Digest | None, list[bytes]]] = []
        tips: dict[tuple[str, bytes], list[bytes]] = {}  # (tier, last digest) -> a run ending there
        seen: set[tuple[str, Digest]] = set()
        for block in self._blocks.values():
            if not block.digests:
                continue
            for tier in sorted(block.tiers):
                keys = [(tier, d) for d in block.digests]
                if seen.issuperset(keys):
                    continue
                seen.update(keys)
                run = tips.pop((tier, block.before), None) if block.before is not None else None
                if run is None:
                    run = list(block.digests)
                    runs.append((tier, block.before, run))
                else:
                    run.extend(block.digests)
                tips[(tier, run[-1])] = run
        return [Stored(self.endpoint, digests, tier, parent) for tier, parent, digests in runs]

    def _seed(self, lora: str | None, salt: str | None) -> Digest:
        key = (lora, salt)
        seed = self._seeds.get(key)
        if seed is None:
            seed = chain_seed(self.model, lora=lora, salt=salt)
            if len(self._seeds) < MAX_SEEDS:
                self._seeds[key] = seed
        return seed

    def _tier(self, event: BlockStored | BlockRemoved) -> str | None:
        if event.group_idx not in (None, 0):
            self.stats.other_groups += 1
            return None
        tier = MEDIUM_TIERS.get(event.medium or "GPU")
        if tier is None:
            self.stats.unknown_medium += 1
        return tier

    def _stored(self, event: BlockStored, out: list[IndexEvent]) -> None:
        tier = self._tier(event)
        if tier is None:
            return
        ebs = event.block_size
        ids = event.token_ids
        if (
            ebs <= 0
            or len(ids) != len(event.block_hashes) * ebs
            or (ids and not 0 <= min(ids) <= max(ids) <= MAX_TOKEN_ID)
        ):
            self.stats.malformed += 1
            return
        if event.parent_block_hash is None:
            tail: Digest | None = None
            leftover: tuple[int, ...] = ()
            first_keys = event.extra_keys[0] if event.extra_keys else None
            seed = self._seed(event.lora_name, vllm_salt(first_keys, event.lora_name))
        else:
            parent = self._blocks.get(event.parent_block_hash)
            if parent is None:
                self.stats.unknown_parent += 1
                return
            tail, leftover, seed = parent.tail, parent.leftover, parent.seed
        first_before = tail
        new: list[bytes] = []
        tokens, ibs, n = event.token_ids, self.block_size, len(event.block_hashes)
        k, rem = divmod(ebs, ibs)
        # Engine blocks of whole index blocks, from a block boundary: one chain call for the run.
        flat = self._chain(seed, tail, tokens) if rem == 0 and not leftover else None
        for i, engine_hash in enumerate(event.block_hashes):
            if flat is not None:
                digests = flat[i * k : (i + 1) * k]
            else:
                chunk = (*leftover, *tokens[i * ebs : (i + 1) * ebs])
                digests = self._chain(seed, tail, chunk)
                leftover = chunk[len(digests) * ibs :]
            before = tail
            if digests:
                tail = digests[-1]
            block = self._blocks.get(engine_hash)
            if block is None:
                block = _Block(tail, leftover, before, tuple(digests), seed, set())
                self._blocks[engine_hash] = block
            if tier not in block.tiers:  # a repeated BlockStored (replay overlap) counts once
                block.tiers.add(tier)
                for digest in block.digests:
                    key = (tier, digest)
                    self._held[key] = self._held.get(key, 0) + 1
            new.extend(digests)
        self.stats.stored += n
        if new:
            out.append(Stored(self.endpoint, new, tier, first_before))

    def _chain(self, seed: Digest, tail: Digest | None, tokens: Sequence[int]) -> list[Digest]:
        """Index digests of the complete blocks of ``tokens``, continuing the chain after ``tail``."""
        if len(tokens) < self.block_size:
            return []
        if tail is None:
            return block_digests(seed, tokens, self.block_size)
        # block_digests resumes a chain at a block boundary ``start`` after ``parent``: a padding block
        # stands for the blocks already hashed (it is never hashed itself).
        return block_digests(seed, [*self._pad, *tokens], self.block_size, start=self.block_size, parent=tail)

    def _removed(self, event: BlockRemoved, out: list[IndexEvent]) -> None:
        tier = self._tier(event)
        if tier is None:
            return
        gone: list[bytes] = []
        for engine_hash in event.block_hashes:
            block = self._blocks.get(engine_hash)
            if block is None or tier not in block.tiers:
                self.stats.unknown_removed += 1
                continue
            self.stats.removed += 1
            block.tiers.discard(tier)
            if not block.tiers:
                del self._blocks[engine_hash]
            for digest in block.digests:
                key = (tier, digest)
                left = self._held[key] - 1
                if left:
                    self._held[key] = left
                else:
                    del self._held[key]
                    gone.append(digest)
        if gone:
            out.append(Removed(self.endpoint, gone, tier))

    def _clear(self) -> Cleared:
        self.stats.clears += 1
        self._blocks.clear()
        self._held.clear()
        return Cleared(self.endpoint, None)
