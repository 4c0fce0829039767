"""The KV cache declared as data: what each attention type needs, and the pool planned from it.

As vLLM v1's `kv_cache_interface.py` does: an attention builder declares a frozen
`KVLayout` before any memory is sized; the runner's planner (`atom_core.runner.kv_pool`)
turns the layouts and the memory budget into one frozen `KVPoolPlan`, which the builders
(to allocate), the block manager and the scheduler (to hand out blocks, state groups and
checkpoint slots) all receive. Nobody reads a count off the runner, and the user's `Config`
keeps what the user set.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class KVLayout:
    """What one attention type's cache costs, across all of its layers.

    `block_bytes`: one paged KV block (`kv_cache_block_size` tokens). `state_bytes`: one slot
    of per-request state kept outside the pool (a recurrent state, as GDN's); a request
    holds `state_slots_per_request` of them. `state_checkpoints`: whether the builder
    honours `ScheduledBatch.state_loads` / `state_saves`, which prefix caching needs where
    there is per-request state.
    """

    block_bytes: int = 0
    state_bytes: int = 0
    state_slots_per_request: int = 1
    state_checkpoints: bool = False

    @property
    def stateful(self) -> bool:
        return self.state_bytes > 0


@attrs.frozen
class KVPoolPlan:
    """How many of each the pool holds, sized once from the layouts and the budget.

    `num_blocks` paged blocks of `block_size` tokens (`reserved_blocks` of them a scheduling
    policy's own); `num_state_groups` per-request state groups (0 without stateful attention)
    and `num_state_checkpoints` checkpoint slots after them. A stateful builder allocates
    `state_slots(layout)` slots: the groups' first, then the checkpoints, then its own.
    """

    num_blocks: int
    block_size: int
    block_bytes: int = 0  # one block across every attention type
    reserved_blocks: int = 0
    num_state_groups: int = 0
    num_state_checkpoints: int = 0
    group_bytes: int = 0  # one group's state across every stateful type
    checkpoint_bytes: int = 0

    def state_slots(self, layout: KVLayout) -> int:
        return self.num_state_groups * layout.state_slots_per_request + self.num_state_checkpoints

    @property
    def total_bytes(self) -> int:
        return (
            self.num_blocks * self.block_bytes
            + self.num_state_groups * self.group_bytes
            + self.num_state_checkpoints * self.checkpoint_bytes
        )
