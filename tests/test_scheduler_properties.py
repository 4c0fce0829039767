"""Random workloads against the scheduler, checked after every step.

Besides the pool's bookkeeping, a shadow KV cache plays the model: every scheduled
token is "written" to its slot (as the hash of the whole prefix that produced it),
and every position a request attends to is read back. A block shared wrongly,
freed while still in use, or hit with the wrong contents shows up as a bad read.
Per-request state (GDN) is played the same way: each state group and state checkpoint
holds the tokens its state has seen, so a request continuing from the wrong state, or
loading a checkpoint of another prefix, shows up too.
"""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from atom_core import (
    Config,
    SamplingParams,
    ScheduledBatchOutput,
    Scheduler,
    Sequence,
    SequenceStatus,
    SpeculativeConfig,
)

VOCAB = range(0, 30)  # small, so generated text also produces shared prefixes
EOS = 0

configs = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([1, 16]),
        "num_blocks": st.integers(4, 24),
        "enable_prefix_caching": st.booleans(),
        "max_num_seqs": st.integers(1, 6),
        "max_num_batched_tokens": st.integers(8, 200),
        "groups": st.integers(0, 3),
        "checkpoints": st.integers(0, 3),
        "k": st.sampled_from([0, 0, 1, 2]),
        "max_model_len": st.one_of(st.none(), st.integers(20, 200)),
        "policy": st.sampled_from(["prefill_first", "mixed", "spyre"]),
        "chunked": st.booleans(),
        "threshold": st.sampled_from([0, 0, 16, 32]),
    }
)
# One operation: (roll, seed, prefix, suffix, max_tokens, ignore_eos, per_req). The roll
# picks arrive (20%), step (77%) or abort (3%); the rest describe an arrival.
operations = st.lists(
    st.tuples(
        st.integers(0, 99),
        st.integers(0, 2**32 - 1),
        st.integers(0, 3),  # which shared prefix
        st.lists(st.integers(1, 29), max_size=20),  # the request's own suffix
        st.integers(1, 64),  # max_tokens
        st.booleans(),  # ignore_eos
        st.booleans(),  # has_per_req_cache
    ),
    min_size=40,
    max_size=250,
)
prefixes = st.lists(st.lists(st.integers(1, 29), max_size=40), min_size=4, max_size=4)


def prefix_hashes(tokens: list[int]) -> list[int]:
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class Harness:
    def __init__(self, cfg: dict):
        self.bs = cfg["block_size"]
        num_blocks = cfg["num_blocks"] * (16 if self.bs == 1 else 1)
        policy = cfg.get("policy", "prefill_first")
        k = 0 if policy == "spyre" else cfg["k"]  # spyre refuses speculative decoding
        spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
        self.k = k
        self.chunked = cfg.get("chunked", False) or policy == "spyre"  # spyre always chunks
        # a spyre step runs a whole chunk, of one block at least, within the budget
        self.budget = max(cfg["max_num_batched_tokens"], self.bs if policy == "spyre" else 1)
        self.sched = Scheduler(
            Config(
                scheduling_policy=policy,
                enable_chunked_prefill=self.chunked,
                long_prefill_token_threshold=cfg.get("threshold", 0) if self.bs > 1 else 0,
                num_kvcache_blocks=num_blocks,
                kv_cache_block_size=self.bs,
                enable_prefix_caching=cfg["enable_prefix_caching"],
                max_num_seqs=cfg["max_num_seqs"],
                max_num_batched_tokens=self.budget,
                num_per_req_cache_groups=cfg["groups"],
                gdn_checkpoint_slots=cfg.get("checkpoints", 0),
                max_model_len=cfg["max_model_len"],
                eos_token_id=EOS,
                speculative_config=spec,
            )
        )
        self.shadow: dict[tuple[int, int], int] = {}
        # The tokens each state group / checkpoint slot has seen (None: unknown, after drafts).
        self.states: dict[int, tuple[int, ...] | None] = {}
        self.checkpoints: dict[int, tuple[int, ...]] = {}
        self.all: list[Sequence] = []
        self.steps = 0

    def arrive(self, prompt: list[int], max_tokens: int, ignore_eos: bool, per_req: bool) -> None:
        seq = Sequence(
            prompt or [1],
            self.bs,
            SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
            has_per_req_cache=per_req,
        )
        self.all.append(seq)
        self.sched.add(seq)

    def abort(self, pick: int) -> None:
        live = [s for s in self.all if not s.is_finished]
        if live:
            seq = live[pick % len(live)]
            assert self.sched.abort(seq.id) is seq
            assert seq.leave_reason == "abort"

    def step(self, seed: int) -> bool:
        rng = random.Random(seed)
        out = self.sched.schedule()
        if out is None:
            assert not self.sched.has_unfinished_requests()
            return False
        self.steps += 1
        batch, seqs = out
        self.check_batch(batch, seqs)
        tokens, drafts = {}, {}
        for sid in seqs:
            if not batch.do_sample[batch.req_ids.index(sid)]:
                continue  # a middle prompt chunk samples nothing
            proposed = batch.scheduled_spec_decode_tokens.get(sid, [])
            accepted = proposed[: rng.randint(0, len(proposed))]
            tokens[sid] = tuple(accepted) + (rng.choice(VOCAB),)
            if self.k:
                drafts[sid] = [rng.choice(VOCAB) for _ in range(self.k)]
        # An abort between schedule and postprocess must be harmless.
        if seqs and rng.random() < 0.05:
            victim = rng.choice(list(seqs.values()))
            self.sched.abort(victim.id)
        finished = self.sched.postprocess(list(seqs.values()), ScheduledBatchOutput(tokens, drafts or None))
        for seq in finished:
            assert seq.is_finished and seq.block_table == [] and seq.per_req_cache_group == -1
        self.check_pool()
        return True

    def check_batch(self, batch, seqs) -> None:
        """Write every scheduled token into the shadow cache, then read every context back."""
        streams = {}
        written = []
        decode_rows = batch.total_seqs_num_decode
        for row, (sid, n, first) in enumerate(
            zip(batch.req_ids, batch.num_scheduled_tokens, batch.num_computed_tokens)
        ):
            seq = seqs[sid]
            drafts = batch.scheduled_spec_decode_tokens.get(sid, [])
            stream = seq.token_ids + drafts
            hashes = prefix_hashes(stream)
            end = first + n
            assert end <= len(stream) and batch.context_lens[row] == end
            assert batch.do_sample[row] == (end - len(drafts) == seq.num_tokens)
            assert (row < decode_rows) == (
                n == 1 + len(drafts) and end - len(drafts) == seq.num_tokens and seq.type.name == "DECODE"
            )
            streams[sid] = (seq, stream[:end], hashes)
            assert len(seq.block_table) * self.bs >= end, "KV slots missing"
            for p in range(first, end):
                if p >= batch.num_cached_tokens[row]:  # a recomputed cached position writes elsewhere
                    self.shadow[(seq.block_table[p // self.bs], p % self.bs)] = hashes[p]
                written.append(stream[p])
            if seq.type.name == "PREFILL" and self.budget >= self.bs:  # chunks are floored to whole blocks
                assert first % self.bs == 0 or first == batch.num_cached_tokens[row] or not self.chunked
        assert batch.scheduled_tokens == written
        self.check_states(batch, seqs)
        assert sum(batch.num_scheduled_tokens) == batch.total_tokens_num
        for sid, (seq, stream, hashes) in streams.items():
            for p in range(len(stream)):
                assert self.shadow.get((seq.block_table[p // self.bs], p % self.bs)) == hashes[p], (
                    f"request {sid} reads a wrong KV entry at position {p}"
                )
        assert all(b not in self.sched.block_manager.reserved_block_ids for s in seqs.values() for b in s.block_table)

    def check_states(self, batch, seqs) -> None:
        """Run the step on the shadow states: loads at its start, saves at its end."""
        bm, bs = self.sched.block_manager, self.bs
        loads, saves = batch.state_loads, batch.state_saves
        store = bm.state_checkpoints
        if store is None:
            assert not loads and not saves
            return
        saved = [slot for points in saves.values() for _, slot in points]
        assert len(saved) == len(set(saved)), "a checkpoint slot saved twice in one step"
        assert not set(saved) & set(loads.values()), "a checkpoint slot loaded and saved in one step"
        assert all(store.first_slot <= s < store.first_slot + store.num_slots for s in saved + list(loads.values()))
        new = {}
        groups = iter(batch.per_req_cache_groups)
        for row, (sid, n, first) in enumerate(
            zip(batch.req_ids, batch.num_scheduled_tokens, batch.num_computed_tokens)
        ):
            seq = seqs[sid]
            if not seq.has_per_req_cache:
                assert row not in loads and row not in saves
                continue
            group = next(groups)
            stream = tuple(seq.token_ids + batch.scheduled_spec_decode_tokens.get(sid, []))
            end = first + n
            if row in loads:
                assert first > 0 and first % bs == 0 and first <= batch.num_cached_tokens[row]
                assert self.checkpoints.get(loads[row]) == stream[:first], f"request {sid} loads a wrong checkpoint"
            elif first > 0:
                state = self.states.get(group)
                assert state is None or state == stream[:first], f"request {sid} continues from a wrong state"
            else:
                assert batch.num_cached_tokens[row] == 0 or self.sched.config.scheduling_policy == "spyre"
            for position, slot in saves.get(row, []):
                assert first < position <= end and position % bs == 0 and position <= seq.num_tokens
                new[slot] = stream[:position]
            drafted = sid in batch.scheduled_spec_decode_tokens
            self.states[group] = None if drafted else stream[:end]
        self.checkpoints.update(new)

    def check_pool(self) -> None:
        sched, bm = self.sched, self.sched.block_manager
        holders = Counter(b for s in sched.running for b in s.block_table)
        for block in bm.blocks:
            assert block.ref_count == holders.get(block.block_id, 0)
        free = set(bm.free_block_ids)
        assert len(free) == len(bm.free_block_ids), "a block is twice in the free list"
        assert free.isdisjoint(bm.used_block_ids)
        assert len(free) + len(bm.used_block_ids) + len(bm.reserved_block_ids) == len(bm.blocks)
        assert bm.reserved_block_ids.isdisjoint(free | bm.used_block_ids)
        assert bm.used_block_ids == set(holders)
        for h, block_id in bm.hash_to_block_id.items():
            assert bm.blocks[block_id].hash == h
        for seq in sched.running:
            assert seq.status == SequenceStatus.RUNNING
            # KV exists for every computed token, plus the last step's drafts (rejected ones
            # included) and the proposer's lookahead past them; a prompt may be partway.
            computed = seq.num_computed_tokens
            assert computed <= seq.num_tokens - 1 or seq.type.name == "PREFILL"
            upper = max(computed + 2 * self.k, seq.num_cached_tokens)
            assert -(-computed // self.bs) <= len(seq.block_table) <= -(-upper // self.bs)
            for i, block_id in enumerate(seq.block_table):
                block = bm.blocks[block_id]
                if block.hash != -1:
                    assert block.token_ids == seq.block(i)
            assert (seq.per_req_cache_group != -1) == seq.has_per_req_cache
        for seq in sched.waiting:
            assert seq.status == SequenceStatus.WAITING
            assert seq.block_table == [] and seq.per_req_cache_group == -1 and seq.num_cached_tokens == 0
        groups = {s.per_req_cache_group for s in sched.running if s.has_per_req_cache}
        assert bm.per_req_cache_used_groups == groups
        store = bm.state_checkpoints
        if store is not None:
            entries = list(store)
            slots = [slot for _, slot in entries] + list(store.free_slots)
            assert sorted(slots) == list(range(store.first_slot, store.first_slot + store.num_slots))
            for h, slot in entries:
                assert h in bm.hash_to_block_id, "a checkpoint outlived its KV block"
                tokens, chain = self.checkpoints[slot], -1
                for i in range(0, len(tokens), self.bs):
                    chain = bm.compute_hash(list(tokens[i : i + self.bs]), chain)
                assert chain == h, "a checkpoint holds the state of another prefix"
        assert len(bm.per_req_cache_free_groups) + len(groups) == bm.num_per_req_cache_groups
        assert len(sched.running) <= sched.max_num_seqs
        assert set(sched._queued) == {s.id for s in sched.waiting} | {s.id for s in sched.running}

    def check_whole(self) -> None:
        bm = self.sched.block_manager
        assert sorted(bm.free_block_ids) == sorted(set(range(len(bm.blocks))) - bm.reserved_block_ids)
        assert bm.used_block_ids == set()
        assert all(b.ref_count == 0 for b in bm.blocks)
        assert sorted(bm.per_req_cache_free_groups) == list(range(bm.num_per_req_cache_groups))
        for seq in self.all:
            assert seq.is_finished and seq.leave_reason
            assert seq.block_table == [] and seq.per_req_cache_group == -1


@settings(max_examples=200, deadline=None)
@given(cfg=configs, shared=prefixes, ops=operations)
def test_random_workloads_keep_the_pool_whole(cfg, shared, ops):
    h = Harness(cfg)
    for roll, seed, which, suffix, max_tokens, ignore_eos, per_req in ops:
        if roll < 20:
            h.arrive(shared[which] + suffix, max_tokens, ignore_eos, per_req)
        elif roll < 97:
            h.step(seed)
        else:
            h.abort(seed)
        h.check_pool()
    # Run everything to completion: every request ends, by a stop condition or as
    # unschedulable, within a bounded number of steps.
    drain = random.Random(len(ops))
    for _ in range(5000):
        if not h.step(drain.getrandbits(32)):
            break
    assert not h.sched.has_unfinished_requests()
    h.check_whole()


def test_heavy_preemption_with_shared_prefixes():
    """A pool far too small for the load: requests are preempted over and over."""
    preemptions = 0
    for seed in range(12):
        rng = random.Random(seed)
        cfg = {
            "block_size": 16,
            "num_blocks": 8,
            "enable_prefix_caching": seed % 2 == 0,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 256,
            "groups": 0,
            "k": seed % 3,
            "max_model_len": None,
        }
        h = Harness(cfg)
        base = [rng.randint(1, 29) for _ in range(40)]
        for _ in range(10):
            prompt = base[: rng.randint(0, 40)] + [rng.randint(1, 29) for _ in range(rng.randint(1, 12))]
            h.arrive(prompt, rng.randint(20, 60), True, False)
        original_preempt = h.sched.preempt

        def counting(seq, _orig=original_preempt):
            nonlocal preemptions
            preemptions += 1
            _orig(seq)

        h.sched.preempt = counting
        for _ in range(3000):
            if not h.step(rng.getrandbits(32)):
                break
        h.check_whole()
        assert {s.leave_reason for s in h.all} <= {"max_tokens", "abort"}
    assert preemptions > 50


def test_state_checkpoints_under_shared_prefixes():
    """Requests with per-request state sharing long prefixes, arriving while others run: they
    resume from checkpoints often, under every policy, with preemption and eviction of slots."""
    counts = Counter()
    for seed in range(24):
        rng = random.Random(seed)
        policy = ["prefill_first", "mixed", "spyre"][seed % 3]
        cfg = {
            "block_size": 16,
            "num_blocks": 14 + seed % 3 * 6,
            "enable_prefix_caching": True,
            "max_num_seqs": 4,
            "max_num_batched_tokens": [48, 256, 32][seed % 3],
            "groups": 3,
            "checkpoints": 1 + seed % 4,
            "k": 0,
            "max_model_len": None,
            "policy": policy,
            "chunked": seed % 2 == 0,
            "threshold": 0,
        }
        h = Harness(cfg)
        original = h.check_states

        def counting(batch, seqs, _orig=original, _policy=policy):
            counts[_policy, "loads"] += len(batch.state_loads)
            counts[_policy, "saves"] += sum(map(len, batch.state_saves.values()))
            _orig(batch, seqs)

        h.check_states = counting
        bases = [[rng.randint(1, 29) for _ in range(70)] for _ in range(2)]
        for _ in range(40):
            if rng.random() < 0.3:
                prompt = rng.choice(bases)[: rng.randint(10, 70)] + [
                    rng.randint(1, 29) for _ in range(rng.randint(0, 8))
                ]
                h.arrive(prompt, rng.randint(1, 20), True, rng.random() < 0.9)
            else:
                h.step(rng.getrandbits(32))
            h.check_pool()
        for _ in range(3000):
            if not h.step(rng.getrandbits(32)):
                break
        h.check_whole()
    for policy in ("prefill_first", "mixed", "spyre"):
        assert counts[policy, "loads"] >= 10 and counts[policy, "saves"] > counts[policy, "loads"], counts
