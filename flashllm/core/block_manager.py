"""Paged KV block allocation with reference counts and prefix caching by chained block hashes."""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence as TokenIds
from dataclasses import dataclass

from flashllm.core.sequence import Sequence

_ROOT_HASH = b""


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation needs more KV blocks than are free (check can_append first)."""


@dataclass(slots=True)
class Block:
    """One physical KV block: how many sequences use it and, when cached, its content hash."""

    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


def hash_block_tokens(parent_hash: bytes, token_ids: TokenIds[int]) -> bytes:
    """sha256 over the parent block's digest and this block's token ids (int64 little-endian).

    Chaining makes a block's hash identify the whole prefix up to its end, not just its own tokens;
    sha256 (unlike Python's hash()) is the same across processes and runs.
    """
    digest = hashlib.sha256(parent_hash)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def _root_hash(seq: Sequence) -> bytes:
    """The chain's start: salted by the sequence's cache_salt (its LoRA adapter), so blocks computed under
    different weights never match each other."""
    return hashlib.sha256(_ROOT_HASH + seq.cache_salt).digest() if seq.cache_salt else _ROOT_HASH


class BlockManager:
    """Hands out KV blocks to sequences; shares identical full prefixes between them.

    Free blocks form one queue in hand-out order. A freed block that holds a cached hash joins the
    back (so the least recently freed cached block is evicted first, and evicting drops its hash);
    a freed block without a hash joins the front, since reusing it loses nothing. `num_free_blocks`
    counts both kinds: a cached free block is still reusable by a prefix hit until evicted.

    With num_state_slots > 0 (a model whose layers keep per-sequence recurrent state) each sequence also holds one
    state slot from allocate_prompt until free; such a state sums up the whole prefix, so it is never shared:
    prefix caching must be off and fork refuses.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"BlockManager needs num_blocks >= 1 and block_size >= 1, got num_blocks="
                f"{num_blocks}, block_size={block_size}; check CacheConfig"
            )
        if num_state_slots and enable_prefix_caching:
            raise ValueError("recurrent state slots need prefix caching off: a cached block holds no state")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_state_slots = num_state_slots
        self._free_slots: list[int] = list(range(num_state_slots - 1, -1, -1))  # popped from the end: 0 first
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        # blocks handed out since their memory was last released (take_released), and the freed ones
        # among them that hold nothing worth keeping: what the runner may give back to the OS
        self._resident: set[int] = set()
        self._releasable: set[int] = set()
        self._num_queried_blocks = 0
        self._num_hit_blocks = 0

    # ---- sizes and stats -------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, including cached ones that a prefix hit could still reuse."""
        return len(self._free)

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        """Free block ids in the order they will be handed out."""
        return tuple(self._free)

    @property
    def num_resident_blocks(self) -> int:
        """Blocks handed out since their memory was last released: the KV memory a lazily backed cache holds."""
        return len(self._resident)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (in use or free)."""
        return len(self._cached)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Full prompt blocks found in the cache / full prompt blocks looked up (0.0 before any)."""
        if self._num_queried_blocks == 0:
            return 0.0
        return self._num_hit_blocks / self._num_queried_blocks

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----------------------------------------------------------------------

    def _match_prefix(self, seq: Sequence) -> tuple[list[int], list[bytes], int]:
        """Longest run of cached full blocks matching seq's tokens, leaving >= 1 token to compute.

        Returns (block ids, their hashes, number of full blocks that were eligible for lookup).
        """
        # The last token is never taken from the cache: the model must run it to produce logits.
        num_eligible = (seq.num_tokens - 1) // self.block_size
        if not self.enable_prefix_caching or getattr(seq.sampling_params, "runs_every_prompt_position", False):
            # prompt logprobs and mean or first-token pooling read every prompt position's hidden state
            return [], [], num_eligible
        block_ids: list[int] = []
        hashes: list[bytes] = []
        parent = _root_hash(seq)
        for i in range(num_eligible):
            start = i * self.block_size
            parent = hash_block_tokens(parent, seq.token_ids[start : start + self.block_size])
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
            hashes.append(parent)
        return block_ids, hashes, num_eligible

    def num_prefix_hit_tokens(self, seq: Sequence) -> int:
        """How many leading tokens of seq a prefix hit would cover right now (no side effects)."""
        return len(self._match_prefix(seq)[0]) * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether allocate_prompt(seq) followed by append_slots(seq, num_new_tokens) would fit."""
        hit_ids, _, _ = self._match_prefix(seq)
        num_hit_tokens = len(hit_ids) * self.block_size
        # Hit blocks sitting in the free queue stop being free once the sequence references them.
        num_free_after_hits = self.num_free_blocks - sum(1 for b in hit_ids if b in self._free)
        num_needed = self._num_blocks_for(num_hit_tokens + num_new_tokens) - len(hit_ids)
        return num_needed <= num_free_after_hits and (not self.num_state_slots or bool(self._free_slots))

    def allocate_prompt(self, seq: Sequence) -> None:
        """Attach the longest cached prefix to a WAITING sequence that holds no blocks.

        Sets seq.block_table to the hit blocks (one reference each), and seq.num_computed_tokens
        and seq.num_cached_tokens to the hit length (a multiple of block_size, < seq.num_tokens).
        Allocates nothing for the uncomputed tokens: call append_slots for those.
        """
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(
                f"allocate_prompt expects a sequence with no KV state, but sequence {seq.seq_id} "
                f"has {len(seq.block_table)} blocks and {seq.num_computed_tokens} computed "
                "tokens; free(seq) first"
            )
        hit_ids, hashes, num_eligible = self._match_prefix(seq)
        for block_id in hit_ids:
            self._take_ref(block_id)
        self._num_queried_blocks += num_eligible
        self._num_hit_blocks += len(hit_ids)
        if self.num_state_slots:
            if not self._free_slots:
                raise NoFreeBlocksError(f"sequence {seq.seq_id} needs a recurrent-state slot but all "
                                        f"{self.num_state_slots} are held (check can_allocate first)")
            seq.state_slot = self._free_slots.pop()
        seq.block_table = hit_ids
        seq.block_hashes = hashes
        seq.num_computed_tokens = seq.num_cached_tokens = len(hit_ids) * self.block_size

    def commit(self, seq: Sequence) -> None:
        """Register seq's newly full and fully computed blocks in the prefix cache.

        Call after a step advanced seq.num_computed_tokens. A block whose content is already cached
        in another block stays unregistered (the first copy keeps serving hits).
        """
        if seq.num_computed_tokens > seq.num_tokens:
            raise ValueError(
                f"sequence {seq.seq_id} claims {seq.num_computed_tokens} computed tokens but has only {seq.num_tokens}"
            )
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else _root_hash(seq)
        for i in range(len(seq.block_hashes), num_full):
            start = i * self.block_size
            parent = hash_block_tokens(parent, seq.token_ids[start : start + self.block_size])
            seq.block_hashes.append(parent)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and parent not in self._cached:
                block.hash = parent
                self._cached[parent] = block.block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after new weights) and reset the hit-rate counters."""
        for block in self.blocks:
            block.hash = None
        self._cached.clear()
        self._releasable.update(b for b in self._free if b in self._resident)
        self._num_queried_blocks = 0
        self._num_hit_blocks = 0

    # ---- allocation ------------------------------------------------------------------------

    def _take_ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _allocate_block(self) -> int:
        if not self._free:
            raise NoFreeBlocksError(
                f"no free KV block left (all {self.num_total_blocks} in use); the scheduler must "
                "call can_append before append_slots, or the cache needs more blocks"
            )
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: its old content is about to be overwritten
            del self._cached[block.hash]
            block.hash = None
        block.ref_count = 1
        self._resident.add(block_id)
        return block_id

    def take_released(self, retain_cached: int | None = None) -> list[int]:
        """Free blocks whose memory may go back to the OS now, sorted; they count as not resident after.

        Always the resident free blocks that hold no prefix-cache hash. With `retain_cached` (the
        engine passes it once its load ends), also the cached free blocks beyond the `retain_cached`
        most recently freed: their hashes are dropped (the prefix cache forgets them) and they move
        to the front of the free queue."""
        released = {b for b in self._releasable if self.blocks[b].ref_count == 0 and self.blocks[b].hash is None}
        self._releasable.clear()
        if retain_cached is not None:
            cached = [b for b in self._free if self.blocks[b].hash is not None and b in self._resident]
            for block_id in cached[: max(len(cached) - retain_cached, 0)]:  # the queue's front: freed longest ago
                block = self.blocks[block_id]
                del self._cached[block.hash]
                block.hash = None
                self._free.move_to_end(block_id, last=False)
                released.add(block_id)
        released &= self._resident
        self._resident -= released
        return sorted(released)

    def num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks seq's block_table lacks to cover num_computed_tokens + num_new_tokens."""
        return self._num_missing_blocks(seq, num_new_tokens)

    def _num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        num_needed = self._num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, num_needed - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether seq's block_table can be grown to cover num_computed_tokens + num_new_tokens."""
        return self._num_missing_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq.block_table to cover positions [0, num_computed_tokens + num_new_tokens).

        Raises NoFreeBlocksError (allocating nothing) when not enough blocks are free.
        """
        num_missing = self._num_missing_blocks(seq, num_new_tokens)
        if num_missing > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} needs {num_missing} more KV blocks for {num_new_tokens} "
                f"new tokens but only {self.num_free_blocks} are free; check can_append first"
            )
        for _ in range(num_missing):
            seq.block_table.append(self._allocate_block())

    def trim(self, seq: Sequence, num_positions: int | None = None) -> int:
        """Give back the blocks at the tail of seq's block_table that no position of its tokens uses
        (grown for positions a multi-step or speculative round did not fill); returns how many.

        Only blocks past the one holding position num_tokens - 1 (or num_positions - 1, to keep room
        for that many positions) go; none of them holds computed KV or a prefix-cache hash."""
        wanted = seq.num_tokens if num_positions is None else max(num_positions, seq.num_tokens)
        keep = self._num_blocks_for(max(wanted, seq.num_computed_tokens))
        tail = seq.block_table[keep:]
        for block_id in reversed(tail):
            block = self.blocks[block_id]
            if block.ref_count != 1 or block.hash is not None:
                raise RuntimeError(f"block {block_id} at the tail of sequence {seq.seq_id} is shared or cached "
                                   f"(ref count {block.ref_count}); only unfilled blocks a round grew can be trimmed")
            block.ref_count = 0
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)
            self._releasable.add(block_id)
        del seq.block_table[keep:]
        return len(tail)

    def free(self, seq: Sequence) -> None:
        """Drop seq's block references and clear its KV state (block_table, computed count)."""
        # Reverse order: a chain's tail joins the free queue first, so it is evicted first and
        # the more widely shared head of the prefix survives longer.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(
                    f"block {block_id} of sequence {seq.seq_id} has ref count {block.ref_count}; "
                    "it was freed twice (a sequence's blocks must be freed exactly once)"
                )
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:
                    self._free.move_to_end(block_id, last=False)
                    self._releasable.add(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        if seq.state_slot >= 0:
            self._free_slots.append(seq.state_slot)
            seq.state_slot = -1

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Give child (no blocks yet) parent's KV: share fully computed blocks, copy the partial one.

        Returns the (src_block, dst_block) pairs whose KV the model runner must copy before the
        next step. Sets child.block_table, block_hashes and num_computed_tokens.
        """
        if child.block_table:
            raise ValueError(f"fork target sequence {child.seq_id} already holds blocks; free it")
        if self.num_state_slots:
            raise ValueError("a model with recurrent state cannot fork a sequence: its state is not copied")
        num_full = parent.num_computed_tokens // self.block_size
        has_partial = parent.num_computed_tokens % self.block_size != 0
        if has_partial and not self._free:
            raise NoFreeBlocksError(
                f"fork of sequence {parent.seq_id} needs one free KV block for its partial last block, but none is free"
            )
        table = parent.block_table[:num_full]
        for block_id in table:
            self._take_ref(block_id)
        copies: list[tuple[int, int]] = []
        if has_partial:
            dst = self._allocate_block()
            copies.append((parent.block_table[num_full], dst))
            table.append(dst)
        child.block_table = table
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        return copies
