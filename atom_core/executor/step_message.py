"""A step as rank 0 sends it to the other tensor-parallel ranks: two `dist.broadcast`s of int64
tensors over the control group, a fixed-size header and then the payload it describes.

Header: the kind (a step, or shutdown), the lengths of the sampling rows, the prompt-logprob
rows and the accepted-drafts pairs, then the batch's own header (`ScheduledBatch.to_ints`).
Payload: the batch's values, then those three sections. Nothing is pickled.
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np

from atom_core.distributed.communication import broadcast_ints
from atom_core.runner.model_runner import StepRows
from atom_core.sched.batch import BATCH_HEADER_LEN, ScheduledBatch

SHUTDOWN, STEP = 0, 1
HEADER_LEN = 4 + BATCH_HEADER_LEN


def send_step(step: StepRows) -> None:
    batch_header, batch_payload = step.batch.to_ints()
    accepted = [v for row, n in step.accepted_before.items() for v in (row, n)]
    sections = [step.sample_index.tolist(), step.prompt_index.tolist(), accepted]
    header = [STEP, *map(len, sections), *batch_header]
    payload = batch_payload + [v for part in sections for v in part]
    broadcast_ints(header, HEADER_LEN)
    broadcast_ints(payload, len(payload))


def send_shutdown() -> None:
    broadcast_ints([SHUTDOWN] + [0] * (HEADER_LEN - 1), HEADER_LEN)


def recv_step() -> StepRows | None:
    """The next step from rank 0, or None when it says shut down (the other ranks' side)."""
    header = broadcast_ints(None, HEADER_LEN)
    if header[0] == SHUTDOWN:
        return None
    if header[0] != STEP:
        raise ValueError(f"not a step message: kind {header[0]}")
    lengths, batch_header = header[1:4], header[4:]
    batch_len = sum(batch_header[1:])
    payload = broadcast_ints(None, batch_len + sum(lengths))
    batch = ScheduledBatch.from_ints(batch_header, payload[:batch_len])
    ends = list(accumulate(lengths, initial=batch_len))
    sample, prompt, accepted = (payload[a:b] for a, b in zip(ends, ends[1:]))
    return StepRows(
        batch, np.asarray(sample, dtype=np.int64), np.asarray(prompt, dtype=np.int64),
        dict(zip(accepted[0::2], accepted[1::2])),
    )  # fmt: skip
