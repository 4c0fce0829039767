"""Compatibility with AMD's ATOM engine, in one place: what lets AMD ATOM's own scheduler and
block-manager tests drive Atom's, and nothing Atom itself needs.

- `as_config` / `ConfigView`: AMD ATOM's tests build the Scheduler and BlockManager from ad-hoc
  config objects carrying a few fields; read as a `Config`, a missing field takes its default.
- `AtomSchedulerCounters`: the draft counters AMD ATOM's scheduler exposes, and its
  `update_spec_stats` for a caller that verifies drafts outside `postprocess`.
See docs/atom-compatibility.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import attrs

from atom_core.config import Config

if TYPE_CHECKING:
    from atom_core.sched.speculative import SpecStats


class AtomSchedulerCounters:
    """AMD ATOM's speculative-decoding counters on its `Scheduler` (a mixin: the scheduler keeps
    the counts in `spec_stats`, with vLLM's meanings)."""

    spec_stats: SpecStats
    mtp_k: int

    @property
    def total_draft_tokens(self) -> int:
        return self.spec_stats.num_draft_tokens

    @property
    def total_accepted_tokens(self) -> int:
        return self.spec_stats.num_accepted_tokens

    def update_spec_stats(self, num_accepted_tokens: int) -> None:
        """AMD ATOM's counter update, for a caller that verifies outside `postprocess` (which counts
        by itself): one request-step of `mtp_k` drafts, `num_accepted_tokens - mtp_k` of them
        accepted, in AMD ATOM's convention."""
        stats = self.spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += self.mtp_k
        stats.num_accepted_tokens += num_accepted_tokens - self.mtp_k


# A stand-in without a `scheduling_policy` field is AMD ATOM's config: AMD ATOM's scheduler
# runs prompts and decodes in separate steps, Atom's `prefill_first`.
_STAND_IN_DEFAULTS = {"scheduling_policy": "prefill_first"}


class ConfigView:
    """Any object carrying some of `Config`'s fields (AMD ATOM's tests drive its Scheduler and
    BlockManager with such stand-ins), read as a `Config`: a field it lacks takes Config's
    default, and Config's derived values (`chunk_size`, `num_speculative_tokens`) are
    computed from it. Nothing is validated: the object is taken as its author built it."""

    def __init__(self, obj: Any):
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        obj = self.__dict__["_obj"]
        if hasattr(obj, name):
            return getattr(obj, name)
        if name in _STAND_IN_DEFAULTS:
            return _STAND_IN_DEFAULTS[name]
        field = attrs.fields_dict(Config).get(name)
        if field is not None:
            # attrs' stubs declare Factory a function (it is a class)
            factory_type = cast("type[Any]", attrs.Factory)
            return field.default.factory() if isinstance(field.default, factory_type) else field.default
        prop = getattr(Config, name, None)
        if isinstance(prop, property):
            assert prop.fget is not None
            return prop.fget(self)
        raise AttributeError(f"{type(obj).__name__} has no {name!r}, and Config has no such field")


def as_config(config: Any) -> Config:
    """`config` itself if it is a `Config` (or a view already), else a `ConfigView` of it
    (typed as the `Config` it reads as)."""
    return cast(Config, config if isinstance(config, (Config, ConfigView)) else ConfigView(config))
