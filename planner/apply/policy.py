"""The selective-checkpoint policy of a region that keeps nodes: it saves the ATen calls that
make the kept outputs (named by op and occurrence in the submodule's forward) and recomputes
every other (`torch.utils.checkpoint.create_selective_checkpoint_contexts`). `planner.apply.checkpoints`
passes it to each such region's checkpoint call.

Example:
    >>> checkpoint(block, x, use_reentrant=False,
    ...            context_fn=functools.partial(keep_contexts, (("aten.addmm.default", 0),)))
"""
from __future__ import annotations

from typing import Any, Sequence

from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)


class KeepPolicy:
    """A selective-checkpoint policy for one checkpoint call: MUST_SAVE the listed calls (func
    name, occurrence), PREFER_RECOMPUTE every other. Calls are counted per func, separately in
    forward and in recomputation (`ctx.is_recompute`; newer PyTorch asks in forward only).

    Example:
        >>> policy = KeepPolicy((("aten.addmm.default", 1),))
        >>> context_fn = lambda: create_selective_checkpoint_contexts(policy)
    """

    def __init__(self, saved_calls: Sequence[tuple[str, int]]):
        self.saved = frozenset((str(name), int(occurrence)) for name, occurrence in saved_calls)
        self.counts: dict[tuple[bool, str], int] = {}

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = (bool(ctx.is_recompute), str(func))
        occurrence = self.counts[key] = self.counts.get(key, -1) + 1
        return CheckpointPolicy.MUST_SAVE if (key[1], occurrence) in self.saved else CheckpointPolicy.PREFER_RECOMPUTE

    def missed(self) -> list[tuple[str, int]]:
        """The listed calls that the forward did not make (its calls differ from the planned ones)."""
        return sorted(call for call in self.saved if self.counts.get((False, call[0]), -1) < call[1])


def keep_contexts(saved_calls: tuple[tuple[str, int], ...], policy: KeepPolicy | None = None) -> tuple[Any, Any]:
    """checkpoint's `context_fn` for a region keeping `saved_calls`: the selective-checkpoint
    contexts of a fresh `KeepPolicy` (its counters start at zero for every call). A plain
    function, so that `functools.partial(keep_contexts, calls)` passes torch.compile too.

    Example:
        >>> checkpoint(block, x, use_reentrant=False,
        ...            context_fn=functools.partial(keep_contexts, (("aten.addmm.default", 0),)))
    """
    return create_selective_checkpoint_contexts(policy if policy is not None else KeepPolicy(saved_calls))


__all__ = ["KeepPolicy", "keep_contexts"]
