"""State checkpoints: which prefix (block chain hash) has a saved copy of per-request state, and where.

A request whose attention keeps per-request state (Gated DeltaNet's conv and recurrent
state) cannot resume from cached KV blocks alone: the state after the cached prefix was
never computed for it. A checkpoint is a copy of that state taken at a block boundary,
named by the chain hash of the block that ends there, so a later request with the same
prefix loads it and computes only the rest. This class is the bookkeeping (the block
manager owns one); the tensors are extra per-request state slots after the groups, owned
by the attention builders, which load and save them as `ScheduledBatch.state_loads` and
`state_saves` say.

Slots are recycled least recently used first. A slot loaded or saved in the step being
built is pinned and never evicted in that step. Entries are created only when a batch is
finished (`BlockManager.plan_state_checkpoints`), after every lookup of that step, so a
checkpoint saved in step N is first used by a request scheduled in step N + 1, once the
forward of step N has written it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator


class StateCheckpoints:
    """LRU map from block chain hash to checkpoint slot; slots are `first_slot .. first_slot + num_slots - 1`."""

    def __init__(self, first_slot: int, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a checkpoint pool needs at least one slot, got {num_slots}")
        self.first_slot = first_slot
        self.num_slots = num_slots
        self._slots: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recently used first
        self.free_slots: deque[int] = deque(range(first_slot, first_slot + num_slots))

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, h: int) -> bool:
        return h in self._slots

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """(hash, slot) pairs, least recently used first."""
        return iter(list(self._slots.items()))

    def slot(self, h: int) -> int:
        """The slot holding the checkpoint named `h`, or -1."""
        return self._slots.get(h, -1)

    def touch(self, h: int) -> None:
        """Mark `h` as just used, so it is evicted last."""
        self._slots.move_to_end(h)

    def discard(self, h: int) -> bool:
        """Drop the checkpoint named `h` (its KV blocks are gone, so it can never be hit); True if there was one."""
        slot = self._slots.pop(h, -1)
        if slot == -1:
            return False
        self.free_slots.append(slot)
        return True

    def assign(self, h: int, pinned: set[int]) -> int:
        """A slot for a new checkpoint named `h`: a free one, else the least recently used outside
        `pinned`; -1 when every slot is pinned."""
        if self.free_slots:
            slot = self.free_slots.popleft()
        else:
            for old, slot in self._slots.items():
                if slot not in pinned:
                    del self._slots[old]
                    break
            else:
                return -1
        self._slots[h] = slot
        return slot
