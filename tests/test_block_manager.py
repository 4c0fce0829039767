from collections import Counter

import pytest
from conftest import make_seq

from atom_core import Block, BlockManager, Config, Sequence
from atom_core.kv.state_checkpoints import StateCheckpoints


def manager(num_blocks=8, prefix=True, block_size=16, groups=0, checkpoints=0) -> BlockManager:
    return BlockManager(
        Config(
            num_kvcache_blocks=num_blocks,
            kv_cache_block_size=block_size,
            enable_prefix_caching=prefix,
            num_per_req_cache_groups=groups,
            gdn_checkpoint_slots=checkpoints,
        )
    )


def assert_pool_consistent(bm: BlockManager, seqs):
    holders = Counter(b for s in seqs for b in s.block_table)
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0), block
    assert set(bm.free_block_ids).isdisjoint(bm.used_block_ids)
    assert len(bm.free_block_ids) + len(bm.used_block_ids) == len(bm.blocks)
    assert bm.used_block_ids == set(holders)


def test_block_basics():
    b = Block(3)
    assert (b.block_id, b.ref_count, b.hash, b.token_ids) == (3, 0, -1, [])
    b.update(123, [1, 2])
    assert (b.hash, b.token_ids) == (123, [1, 2])
    b.reset()
    assert (b.ref_count, b.hash, b.token_ids) == (1, -1, [])


def test_initial_state_and_missing_pool_size():
    bm = manager(num_blocks=5)
    assert list(bm.free_block_ids) == [0, 1, 2, 3, 4]
    assert bm.used_block_ids == set() and bm.hash_to_block_id == {}
    assert [b.block_id for b in bm.blocks] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="num_kvcache_blocks is None"):
        BlockManager(Config())


def test_hash_is_xxhash64_chained_through_the_previous_block():
    import numpy as np
    import xxhash

    a = BlockManager.compute_hash([1, 2, 3])
    assert a == xxhash.xxh64(np.array([1, 2, 3], dtype=np.int64).tobytes()).intdigest()
    b = BlockManager.compute_hash([1, 2, 3], prefix=a)
    assert b == xxhash.xxh64(a.to_bytes(8, "little") + np.array([1, 2, 3], dtype=np.int64).tobytes()).intdigest()
    assert a != b


def test_allocate_without_prefix_caching():
    bm = manager(prefix=False)
    s = make_seq(40)
    assert bm.can_allocate(s) is True
    bm.allocate(s)
    assert s.block_table == [0, 1, 2]
    assert s.num_cached_tokens == 0
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7]
    # Full blocks are named all the same (the seed: turning caching off skips the lookup only).
    assert bm.hash_to_block_id == {bm.blocks[0].hash: 0, bm.blocks[1].hash: 1}
    assert bm.blocks[2].hash == -1 and all(bm.blocks[i].ref_count == 1 for i in (0, 1, 2))
    twin = make_seq(40)  # the same tokens: no hit without prefix caching
    bm.allocate(twin)
    assert twin.num_cached_tokens == 0 and twin.block_table == [3, 4, 5]
    bm.deallocate(twin)
    bm.deallocate(s)
    assert s.block_table == [] and bm.used_block_ids == set()
    assert sorted(bm.free_block_ids) == list(range(8))


def test_freed_blocks_are_reused_first_without_prefix_caching_and_last_with_it():
    """Without a prefix cache a freed block goes to the front of the free list (its memory is
    mapped and warm; the pool's untouched blocks are page faults); with one, to the back (LRU:
    a later hit may revive it)."""
    for prefix, expected in [(False, [0, 1, 2]), (True, [3, 4, 5])]:
        bm = manager(prefix=prefix)
        a = make_seq(40)
        bm.allocate(a)
        assert a.block_table == [0, 1, 2]
        bm.deallocate(a)
        b = make_seq(40, start=1000)  # other tokens: no prefix hit either way
        bm.allocate(b)
        assert b.num_cached_tokens == 0 and b.block_table == expected, prefix
        assert_pool_consistent(bm, [b])


def test_only_full_blocks_are_hashed():
    bm = manager()
    s = make_seq(40)
    bm.allocate(s)
    assert [bm.blocks[b].hash != -1 for b in s.block_table] == [True, True, False]
    assert bm.blocks[s.block_table[1]].token_ids == list(range(16, 32))
    assert len(bm.hash_to_block_id) == 2


def test_can_allocate_counts_free_blocks():
    bm = manager(num_blocks=3)
    assert bm.can_allocate(make_seq(48)) is True
    assert bm.can_allocate(make_seq(49)) is False


def test_prefix_hit_shares_blocks_and_counts_cached_tokens():
    bm = manager()
    a = make_seq(40)
    b = make_seq(list(range(32)) + [900, 901, 902])
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == 32
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert list(bm.free_block_ids) == [4, 5, 6, 7]
    assert_pool_consistent(bm, [a, b])
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 0, 1]
    assert_pool_consistent(bm, [b])
    bm.deallocate(b)
    assert_pool_consistent(bm, [])


def test_same_prefix_in_one_prefill_batch_is_shared():
    """The second prompt reads the KV the first writes in the same step."""
    bm = manager()
    a = make_seq(33)
    b = make_seq(33)
    bm.allocate(a)
    bm.allocate(b)
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 32
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = manager()
    a = make_seq(32)
    bm.allocate(a)
    b = make_seq(32)
    # Both blocks are cached, but the last block holds the last token: it is recomputed
    # into a fresh block, so a shared block is never written.
    assert bm.num_prefix_cached_tokens(b) == 16
    bm.allocate(b)
    assert b.num_cached_tokens == 16 <= b.num_tokens - 1
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.blocks[a.block_table[1]].ref_count == 1


def test_block_size_one_caches_all_but_the_last_token():
    bm = manager(num_blocks=10, block_size=1)
    a = make_seq([5, 6, 7, 8], block_size=1)
    bm.allocate(a)
    b = make_seq([5, 6, 7, 8], block_size=1)
    bm.allocate(b)
    assert b.num_cached_tokens == 3
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]


def test_miss_is_sticky():
    bm = manager()
    a = make_seq(48)
    bm.allocate(a)
    # Block 0 differs, blocks 1 and 2 have the same tokens as a's: no hit, because the
    # chained hash of block 1 depends on block 0.
    b = make_seq([999] + list(range(1, 48)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert set(b.block_table).isdisjoint(a.block_table)


def test_hash_collision_is_guarded_by_comparing_tokens(monkeypatch):
    bm = manager()
    a = make_seq(17)
    bm.allocate(a)
    monkeypatch.setattr(BlockManager, "compute_hash", classmethod(lambda cls, t, p=-1: 7))
    b = make_seq(17, start=100)
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert b.block_table[0] != a.block_table[0]


def test_freed_block_is_revived_by_a_later_hit():
    bm = manager(num_blocks=4)
    a = make_seq(40)
    bm.allocate(a)
    bm.deallocate(a)
    # Freed in reverse order, to the back of the free list.
    assert list(bm.free_block_ids) == [3, 2, 1, 0]
    assert bm.blocks[0].ref_count == 0 and bm.blocks[0].hash != -1
    b = make_seq(list(range(32)) + [77])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_cached_tokens == 32
    assert b.block_table == [0, 1, 3]  # 0 and 1 revived, the miss takes the free list's head
    assert bm.blocks[0].ref_count == 1 and bm.blocks[1].ref_count == 1
    assert list(bm.free_block_ids) == [2]
    assert_pool_consistent(bm, [b])


def test_evicted_block_is_not_a_hit_anymore():
    bm = manager(num_blocks=3)
    a = make_seq(32)
    bm.allocate(a)
    bm.deallocate(a)
    assert len(bm.hash_to_block_id) == 2
    filler = make_seq(48, start=500)  # takes all three blocks, evicting a's
    bm.allocate(filler)
    assert bm.hash_to_block_id.keys() == {bm.blocks[b].hash for b in filler.block_table}
    bm.deallocate(filler)
    b = make_seq(33)
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_can_allocate_accounts_for_shared_blocks():
    bm = manager(num_blocks=4)
    a = make_seq(48)
    bm.allocate(a)  # 3 used, 1 free
    b = make_seq(list(range(48)) + [1000])  # 4 blocks, 3 of them shared with a
    assert bm.can_allocate(b) is True
    bm.allocate(b)
    assert b.num_cached_tokens == 48
    assert len(bm.free_block_ids) == 0
    assert_pool_consistent(bm, [a, b])


def test_can_append_and_may_append():
    bm = manager(num_blocks=3)
    s = make_seq(16)
    bm.allocate(s)
    assert len(s.block_table) == 1
    s.append_token(100)  # 17 tokens: the new token starts block 2
    assert bm.can_append(s) is True
    bm.may_append(s)
    assert len(s.block_table) == 2 and len(bm.free_block_ids) == 1
    for t in range(15):  # up to 32 tokens: no new block
        s.append_token(200 + t)
        assert bm.can_append(s)
        bm.may_append(s)
    assert len(s.block_table) == 2
    # The second block is now full: it was hashed and published, chained to block 0.
    second = bm.blocks[s.block_table[1]]
    assert second.hash == BlockManager.compute_hash(s.block(1), bm.blocks[s.block_table[0]].hash)
    assert bm.hash_to_block_id[second.hash] == s.block_table[1]
    s.append_token(300)
    bm.may_append(s)
    assert len(s.block_table) == 3 and len(bm.free_block_ids) == 0
    for t in range(15):
        s.append_token(400 + t)
        bm.may_append(s)
    s.append_token(500)  # 49 tokens need a fourth block
    assert bm.can_append(s) is False
    with pytest.raises(RuntimeError, match="can_append"):
        bm.may_append(s)


def test_may_append_with_several_new_tokens():
    bm = manager(num_blocks=4)
    s = make_seq(15)
    bm.allocate(s)
    # A speculative step writes positions 14..17: needs a second block.
    assert bm.can_append(s, 4)
    bm.may_append(s, 4)
    assert len(s.block_table) == 2


def test_decoded_blocks_are_reusable_as_prefix():
    bm = manager()
    a = make_seq(10)
    bm.allocate(a)
    for t in range(10, 33):
        a.append_token(t)
        bm.may_append(a)
    b = make_seq(40)  # tokens 0..39: the first 32 equal a's prompt + completion
    bm.allocate(b)
    assert b.num_cached_tokens == 32
    assert b.block_table[:2] == a.block_table[:2]


def test_per_request_cache_groups():
    bm = manager(groups=2)
    seqs = [Sequence([1, 2, 3], 16, has_per_req_cache=True) for _ in range(3)]
    plain = make_seq(3)
    bm.allocate(seqs[0])
    bm.allocate(seqs[1])
    assert [s.per_req_cache_group for s in seqs] == [0, 1, -1]
    assert bm.can_allocate(seqs[2]) is False  # blocks are free, groups are not
    assert bm.can_allocate(plain) is True  # a stateless request does not need one
    bm.allocate(plain)
    assert plain.per_req_cache_group == -1
    bm.deallocate(seqs[0])
    assert seqs[0].per_req_cache_group == -1
    assert list(bm.per_req_cache_free_groups) == [0]
    assert bm.can_allocate(seqs[2]) is True
    bm.allocate(seqs[2])
    assert seqs[2].per_req_cache_group == 0
    assert bm.per_req_cache_used_groups == {0, 1}


def test_allocate_twice_is_an_error():
    bm = manager()
    s = make_seq(5)
    bm.allocate(s)
    with pytest.raises(RuntimeError, match="already holds blocks"):
        bm.allocate(s)


def test_state_checkpoints_evict_the_least_recently_used_slot_outside_the_pinned():
    store = StateCheckpoints(first_slot=4, num_slots=2)  # slots after 4 groups
    assert (store.assign(11, set()), store.assign(12, set())) == (4, 5)
    store.touch(11)
    assert store.assign(13, set()) == 5 and 12 not in store  # 12 was least recently used
    assert store.assign(14, {4, 5}) == -1  # every slot is loaded or saved this step
    assert store.discard(11) and not store.discard(11)
    assert store.assign(14, {5}) == 4
    assert list(store) == [(13, 5), (14, 4)]


def test_a_request_with_state_hits_only_up_to_a_checkpoint():
    bm = manager(num_blocks=8, groups=1, checkpoints=2)
    tokens = list(range(40))
    a = Sequence(tokens, 16, has_per_req_cache=True)
    bm.allocate(a)
    # One prompt row of 40 tokens: it saves the state after 32, the most a repeat can resume from.
    assert bm.plan_state_checkpoints([a], [0], [40]) == ({}, {0: [(32, 1)]})
    bm.deallocate(a)
    b, plain = Sequence(tokens, 16, has_per_req_cache=True), Sequence(tokens + [7], 16)
    assert bm.num_prefix_cached_tokens(b) == 32
    assert bm.num_prefix_cached_tokens(plain) == 32  # KV alone serves a stateless request
    assert [bm.can_resume_at(b, p) for p in (0, 16, 32, 48)] == [True, False, True, False]
    with pytest.raises(RuntimeError, match="cannot start at position 16"):
        bm.allocate(b, 8, start=16)
    assert b.block_table == [] and b.per_req_cache_group == -1  # refused before anything changed
    bm.allocate(b)
    assert b.num_cached_tokens == 32 and b.num_computed_tokens == 40
    assert bm.plan_state_checkpoints([b], [32], [8]) == ({0: 1}, {})
    bm.deallocate(b)
    # Recycling the block that ends at the checkpoint forgets the checkpoint with it.
    hog = make_seq(16 * 8, start=100)
    bm.allocate(hog)
    assert len(bm.state_checkpoints) == 0 and list(bm.state_checkpoints.free_slots) == [2, 1]
    assert bm.num_prefix_cached_tokens(Sequence(tokens, 16, has_per_req_cache=True)) == 0


def test_a_request_with_state_takes_no_hit_without_checkpoints():
    bm = manager(groups=1)
    a = make_seq(40)
    bm.allocate(a)
    assert bm.state_checkpoints is None
    assert bm.num_prefix_cached_tokens(Sequence(list(range(40)), 16, has_per_req_cache=True)) == 0
