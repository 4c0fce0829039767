"""Paged KV memory: a fixed pool of blocks, shared between sequences by prefix hash.

Each full block is named by an xxhash64 chained through the previous block's hash,
so equal token content after different prefixes never collides. A freed block keeps
its hash and contents until it is handed out again, so a later request with the same
prefix can revive it. The pool of per-request state groups (GDN) lives here too,
because admission must wait for a group exactly as it waits for blocks, and so does the
bookkeeping of state checkpoints (`StateCheckpoints`): a request with per-request state
takes a prefix hit only up to a block boundary whose state was saved.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import xxhash

from atom_core.compat import as_config
from atom_core.config import Config
from atom_core.kv.layout import KVPoolPlan
from atom_core.kv.state_checkpoints import StateCheckpoints
from atom_core.sequence import Sequence, SequenceType


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def update(self, hash: int, token_ids: list[int]) -> None:
        self.hash = hash
        self.token_ids = list(token_ids)

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref_count={self.ref_count}, hash={self.hash})"


class BlockManager:
    def __init__(self, config: Config, plan: KVPoolPlan | None = None):
        """`plan`: the pool a model runner planned (`KVPoolPlan`); without one, the counts are
        `config`'s (`num_kvcache_blocks`, `num_per_req_cache_groups`, `gdn_checkpoint_slots`),
        which is how a BlockManager runs on its own."""
        config = as_config(config)  # a stand-in with AMD ATOM's fields works too
        if plan is None:
            if config.num_kvcache_blocks is None:
                raise ValueError(
                    "num_kvcache_blocks is None: a model runner sizes the KV pool from memory; "
                    "set Config(num_kvcache_blocks=N) to use the BlockManager on its own"
                )
            plan = KVPoolPlan(
                num_blocks=config.num_kvcache_blocks, block_size=config.kv_cache_block_size,
                num_state_groups=config.num_per_req_cache_groups,
                num_state_checkpoints=config.gdn_checkpoint_slots if config.num_per_req_cache_groups else 0,
            )  # fmt: skip
        self.block_size = plan.block_size
        self.num_blocks = plan.num_blocks
        self.blocks: list[Block] = [Block(i) for i in range(self.num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(self.num_blocks))
        self.used_block_ids: set[int] = set()
        self.reserved_block_ids: set[int] = set()
        self.enable_prefix_caching = config.enable_prefix_caching
        self.num_lookahead_slots = config.num_speculative_tokens
        self.num_per_req_cache_groups = plan.num_state_groups
        self.per_req_cache_free_groups: deque[int] = deque(range(self.num_per_req_cache_groups))
        self.per_req_cache_used_groups: set[int] = set()
        # State checkpoints take the slots after the groups; only prefix caching uses them.
        num_checkpoints = plan.num_state_checkpoints if self.enable_prefix_caching else 0
        self.state_checkpoints: StateCheckpoints | None = (
            StateCheckpoints(self.num_per_req_cache_groups, num_checkpoints)
            if num_checkpoints and self.num_per_req_cache_groups
            else None
        )
        # Per admitted request with per-request state: (checkpoint slot its first row loads or
        # -1, the end of its KV hit, where its prefix leaves every cached one).
        self._state_plans: dict[int, tuple[int, int]] = {}
        # One-entry memo of the last prefix lookup; any change to the pool invalidates it.
        self._version = 0
        self._memo: tuple[Sequence, int, int, list[int], list[int], int] | None = None

    @classmethod
    def compute_hash(cls, token_ids: list[int], prefix: int = -1) -> int:
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
        return h.intdigest()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    # -- prefix lookup -------------------------------------------------------------

    def _lookup(self, seq: Sequence) -> tuple[list[int], list[int], int]:
        """(block ids `seq` may share, chain hashes of its cached KV blocks, how many KV blocks are cached).

        The last token is never served from cache: the model must run it to produce
        the first output token. So a hit covers at most `(num_tokens - 1) // block_size`
        whole blocks, and a block with ref_count > 1 is never written to. A request with
        per-request state shares only up to the last cached block whose boundary has a
        state checkpoint (none without checkpoints): KV alone cannot rebuild its state.
        """
        memo = self._memo
        if memo is not None and memo[0] is seq and memo[1] == seq.num_tokens and memo[2] == self._version:
            return memo[3], memo[4], memo[5]
        hits: list[int] = []
        hashes: list[int] = []
        h = -1
        for i in range((seq.num_tokens - 1) // self.block_size):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                break  # a miss is sticky: later blocks hang off a different chain
            hits.append(block_id)
            hashes.append(h)
        num_kv = len(hits)
        if seq.has_per_req_cache:
            store = self.state_checkpoints
            k = num_kv
            while k and (store is None or hashes[k - 1] not in store):
                k -= 1
            hits = hits[:k]
        self._memo = (seq, seq.num_tokens, self._version, hits, hashes, num_kv)
        return hits, hashes, num_kv

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix `seq` may resume from (see `_lookup`)."""
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []  # prompt log probabilities need every prompt position computed
        return self._lookup(seq)[0]

    def can_resume_at(self, seq: Sequence, position: int) -> bool:
        """Whether a waiting `seq` may start computing at `position` (a policy recomputing part
        of its cached prefix asks): 0 always; else a block boundary within its cached KV and,
        for a request with per-request state, one with a state checkpoint."""
        if position == 0:
            return True
        if not self.enable_prefix_caching or position % self.block_size:
            return False
        _, hashes, num_kv = self._lookup(seq)
        i = position // self.block_size
        if i > num_kv:
            return False
        store = self.state_checkpoints
        return not seq.has_per_req_cache or (store is not None and hashes[i - 1] in store)

    def num_prefix_cached_tokens(self, seq: Sequence) -> int:
        """Tokens `allocate(seq)` would serve from the prefix cache right now."""
        return len(self._prefix_hits(seq)) * self.block_size

    # -- allocation ----------------------------------------------------------------

    def _allocation_end(self, seq: Sequence, num_new_tokens: int | None, start: int | None) -> tuple[int, int]:
        """(first position this step computes, positions the table must cover) for a new request."""
        cached = self.num_prefix_cached_tokens(seq)
        first = cached if start is None else start
        if num_new_tokens is None:
            return first, seq.num_tokens
        return first, max(cached, first + num_new_tokens)

    def can_allocate(self, seq: Sequence, num_new_tokens: int | None = None, start: int | None = None) -> bool:
        """Whether `allocate(seq, num_new_tokens, start)` would succeed now.

        `num_new_tokens=None` asks for the whole prompt; a chunked prefill asks for its
        first chunk only and grows with `try_append`.
        """
        hits = self._prefix_hits(seq)
        shared = sum(1 for b in hits if b in self.used_block_ids)  # cost no free block
        _, end = self._allocation_end(seq, num_new_tokens, start)
        if len(self.free_block_ids) < -(-end // self.block_size) - shared:
            return False
        if seq.has_per_req_cache and seq.per_req_cache_group == -1:
            return len(self.per_req_cache_free_groups) > 0
        return True

    def allocate(self, seq: Sequence, num_new_tokens: int | None = None, start: int | None = None) -> None:
        """Give a waiting request its cached prefix plus fresh blocks for its first `num_new_tokens`.

        The request computes from `start` (default: the end of its cached prefix);
        `num_computed_tokens` moves past the tokens this step will write, as `try_append` does.
        A policy may recompute cached positions (`start` below the hit); their KV writes
        must then go elsewhere (see `ScheduledBatch.pad_block`), since shared blocks are
        never written.
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.id} already holds blocks {seq.block_table}")
        if not self.can_allocate(seq, num_new_tokens, start):
            raise RuntimeError(f"not enough free KV blocks for sequence {seq.id}; call can_allocate first")
        hits = self._prefix_hits(seq)
        first, end = self._allocation_end(seq, num_new_tokens, start)
        stateful = seq.has_per_req_cache and self.state_checkpoints is not None
        if stateful:
            load = self._state_load(seq, first)  # before anything changes: it may refuse `start`
        table = seq.block_table
        for block_id in hits:
            block = self.blocks[block_id]
            if block_id in self.used_block_ids:
                block.ref_count += 1
            else:
                self.free_block_ids.remove(block_id)  # revive: contents are still valid
                block.ref_count = 1
                self.used_block_ids.add(block_id)
            table.append(block_id)
        for _ in range(-(-end // self.block_size) - len(hits)):
            table.append(self._take_free_block())
        self._add_lookahead(seq, end)
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = end if num_new_tokens is None else first + num_new_tokens
        if stateful:
            self._state_plans[seq.id] = load
        # Full blocks are named whether or not prefix caching is on (as AMD ATOM does); off, nothing looks them up.
        self._hash_full_blocks(seq, min(end, seq.num_tokens) // self.block_size)
        if seq.has_per_req_cache and seq.per_req_cache_group == -1:
            group = self.per_req_cache_free_groups.popleft()
            self.per_req_cache_used_groups.add(group)
            seq.per_req_cache_group = group
        self._version += 1

    def _state_load(self, seq: Sequence, first: int) -> tuple[int, int]:
        """(checkpoint slot `seq`'s first row loads: the state after its first `first` tokens, or
        -1; where its KV hit ends), kept for `plan_state_checkpoints`."""
        _, hashes, num_kv = self._lookup(seq)
        slot = -1
        if first:
            if not self.can_resume_at(seq, first):
                raise RuntimeError(
                    f"sequence {seq.id} keeps per-request state and cannot start at position {first}: "
                    "no state checkpoint there (a policy must ask can_resume_at)"
                )
            h = hashes[first // self.block_size - 1]
            assert self.state_checkpoints is not None  # called for stateful requests only
            slot = self.state_checkpoints.slot(h)
            self.state_checkpoints.touch(h)
        return slot, num_kv * self.block_size

    def reserve(self, block_id: int) -> None:
        """Take a block out of the pool for good (a policy's padding block): never handed to a request."""
        if block_id not in self.free_block_ids:
            raise RuntimeError(f"block {block_id} is in use and cannot be reserved")
        self.free_block_ids.remove(block_id)
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            self._forget_hash(block.hash)
        block.hash, block.token_ids = -1, []
        self.num_blocks -= 1
        self.reserved_block_ids.add(block_id)
        self._version += 1

    def _take_free_block(self) -> int:
        """Hand out the least recently freed block, dropping its stale hash entry."""
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            self._forget_hash(block.hash)
        block.reset()
        self.used_block_ids.add(block_id)
        return block_id

    def _forget_hash(self, h: int) -> None:
        """The cache loses the block named `h`; a checkpoint there could never be hit again."""
        del self.hash_to_block_id[h]
        if self.state_checkpoints is not None:
            self.state_checkpoints.discard(h)

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                if self.enable_prefix_caching:
                    # To the back of the free list, tail blocks first: the prefix blocks that
                    # other requests are likeliest to share are the last to be recycled.
                    self.free_block_ids.append(block_id)
                else:
                    # No hit can revive it: to the front, where the next request takes blocks
                    # whose memory is mapped and may still be cached, instead of a block of the
                    # pool never touched yet (a page fault, and 2 MB zeroed in a huge page).
                    self.free_block_ids.appendleft(block_id)
        seq.num_cached_tokens = 0
        seq.num_computed_tokens = 0
        seq.block_table.clear()
        if seq.per_req_cache_group != -1:
            self.per_req_cache_used_groups.remove(seq.per_req_cache_group)
            self.per_req_cache_free_groups.append(seq.per_req_cache_group)
            seq.per_req_cache_group = -1
        self._state_plans.pop(seq.id, None)
        self._version += 1

    def unpublish(self, seq: Sequence, first: int) -> None:
        """Take back from the prefix cache the blocks `seq` published for a step that never
        ran (those from position `first` on): their KV was not written. Blocks it took from
        the cache stay (a policy recomputing part of a hit writes elsewhere)."""
        start = max(first, seq.num_cached_tokens) // self.block_size
        for block_id in seq.block_table[start:]:
            block = self.blocks[block_id]
            if block.hash != -1:
                if self.hash_to_block_id.get(block.hash) == block_id:
                    self._forget_hash(block.hash)
                block.hash, block.token_ids = -1, []
        self._version += 1

    # -- growth: the next prefill chunk, or decode ------------------------------------

    def _add_lookahead(self, seq: Sequence, end: int) -> None:
        """Blocks for up to `num_lookahead_slots` positions past a sampling step's end, where a
        draft model writes its chained KV; only from free blocks, never at another request's
        expense (`lookahead_capacity` tells the proposer how far it may write)."""
        if self.num_lookahead_slots and end >= seq._num_tokens:
            want = -(-(end + self.num_lookahead_slots) // self.block_size) - len(seq.block_table)
            for _ in range(min(want, len(self.free_block_ids))):
                seq.block_table.append(self._take_free_block())

    def _num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        # This step writes KV for positions [num_computed, num_computed + num_new_tokens).
        return -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        return len(self.free_block_ids) >= self._num_missing_blocks(seq, num_new_tokens)

    def may_append(self, seq: Sequence, num_new_tokens: int = 1) -> None:
        if not self.try_append(seq, num_new_tokens):
            raise RuntimeError(f"not enough free KV blocks to extend sequence {seq.id}; call can_append first")

    def try_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        """`may_append` if `can_append`, in one pass: the scheduler's hot path.

        On success `num_computed_tokens` moves past the `num_new_tokens` this step writes.
        Blocks this step fills are published to the prefix cache now: a request later
        in the same step may share them (every KV write of a step lands before any read).
        """
        table = seq.block_table
        end = seq.num_computed_tokens + num_new_tokens
        missing = -(-end // self.block_size) - len(table)
        if missing > 0:
            if missing > len(self.free_block_ids):
                return False
            for _ in range(missing):
                table.append(self._take_free_block())
        self._add_lookahead(seq, end)
        # Drafts are not tokens of the sequence yet: only known tokens are published.
        num_full = min(end, seq._num_tokens) // self.block_size
        if num_full and self.blocks[table[num_full - 1]].hash == -1:
            self._hash_full_blocks(seq, num_full)
        seq.num_computed_tokens = end
        self._version += 1
        return True

    def _hash_full_blocks(self, seq: Sequence, num_full: int) -> None:
        """Publish blocks [.., num_full) that this step fills, chaining from the last hashed one."""
        table = seq.block_table
        first = num_full
        while first > 0 and self.blocks[table[first - 1]].hash == -1:
            first -= 1
        for i in range(first, num_full):
            prefix = self.blocks[table[i - 1]].hash if i > 0 else -1
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, prefix)
            self.blocks[table[i]].update(h, token_ids)
            self.hash_to_block_id[h] = table[i]

    # -- state checkpoints ------------------------------------------------------------

    def plan_state_checkpoints(
        self, seqs: list[Sequence], firsts: list[int], num_tokens: list[int]
    ) -> tuple[dict[int, int], dict[int, list[tuple[int, int]]]]:
        """What a finished batch loads and saves, by row: ({row: checkpoint slot}, {row: [(position, slot)]}).

        A row loads before the step when it is the first of a request resuming from a
        checkpoint. A prompt row saves the state after `position` tokens (a block boundary
        inside or at the end of the row) when the position is the row's own end, the last
        boundary a repeat of the prompt could resume from (`(num_tokens - 1) // block_size`
        blocks), or the end of the request's KV hit, where its prefix parted from every
        cached one (the next request sharing that prefix resumes there). Slots are taken
        free or least recently used; a slot loaded or saved in this batch is never taken.
        Called once per step, after every lookup: what is saved here is used from the next step.
        """
        store = self.state_checkpoints
        loads: dict[int, int] = {}
        saves: dict[int, list[tuple[int, int]]] = {}
        if store is None:
            return loads, saves
        bs = self.block_size
        rows = []
        for row, seq in enumerate(seqs):
            plan = self._state_plans.get(seq.id)
            if plan is None or seq.type is SequenceType.DECODE:
                continue
            slot, kv_end = plan
            if slot != -1:
                loads[row] = slot
                self._state_plans[seq.id] = (-1, kv_end)
            rows.append((row, seq, firsts[row], firsts[row] + num_tokens[row], kv_end))
        pinned = set(loads.values())
        for row, seq, first, end, kv_end in rows:
            tail = (seq.num_tokens - 1) // bs * bs
            chunk_end = end if end % bs == 0 else 0
            for position in sorted({p for p in (chunk_end, tail, kv_end) if first < p <= end}):
                h = self.blocks[seq.block_table[position // bs - 1]].hash
                if h == -1:
                    continue
                if h in store:
                    store.touch(h)
                    continue
                slot = store.assign(h, pinned)
                if slot == -1:
                    break  # every slot is loaded or saved this step
                pinned.add(slot)
                saves.setdefault(row, []).append((position, slot))
        if saves:
            self._version += 1
        return loads, saves
