"""Costs: what a checkpoint call, a selective policy and a run recomputed alone cost beyond the
nodes they recompute, measured where the plan runs.

- `overhead`: per call and per saved tensor on tiny modules (cached per device and process);
- `block`: the same, and what a selective policy and run recording cost, on one of the model's
  own blocks (the default effort);
- `calls`, `step`, `block_price`, `node_rounds`: readings off the model's own training steps
  (`effort="thorough"`).
"""

__all__: list[str] = []
