"""Plain data passed between the planner and the solvers: no torch here."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class NodeCost:
    """What one compute node costs, as measured (or read from a graph file).

    Node indices refer to positions in `Problem.nodes`. A node "owns" the storages it creates;
    views and in-place results point back at the owner, so `uses`, `saves` and `mutates` are
    always lists of owners.

    Example:
        >>> NodeCost("fc1", compute_ms=0.4, output_bytes=4096, uses=(0,), saves=(0,))
        NodeCost(name='fc1', ...)
    """

    name: str
    compute_ms: float
    output_bytes: int = 0  # new storages this node creates
    grad_bytes: int = 0  # size of the gradient of those outputs (0 if not differentiable)
    saved_bytes: int = 0  # storages saved for backward that the node creates and does not return
    transient_bytes: int = 0  # temporaries alive only while the node's forward runs
    param_grad_bytes: int = 0  # parameter gradients produced by this node's backward
    backward_transient_bytes: int = 0  # temporaries alive only while the node's backward runs
    # (earlier user, bytes) per parameter this node shares with earlier nodes (tied weights): its
    # gradient is created by this node's backward, which runs first, and held until the earlier
    # user's backward has run and autograd adds the sum to `.grad`.
    shared_grads: tuple[tuple[int, int], ...] = ()
    uses: tuple[int, ...] = ()  # owners of the storages this node reads in forward
    saves: tuple[int, ...] = ()  # owners of the outputs autograd saves for this node's backward
    mutates: tuple[int, ...] = ()  # owners of the storages this node writes in place
    # owners whose gradient this node's backward hands on without copying: the gradient of its
    # output itself (an add) or a view of it (a cat); they then share one storage
    grad_aliases: tuple[int, ...] = ()
    is_output: bool = False  # returned by the graph: alive until backward starts


@dataclass(frozen=True)
class Problem:
    """A graph in topological order plus the memory that never changes with the plan.

    `static_bytes` covers parameters, their gradients, buffers, the inputs and any reserve.

    Example:
        >>> Problem(nodes=(NodeCost("a", 1.0, output_bytes=8),), static_bytes=0)
    """

    nodes: tuple[NodeCost, ...]
    static_bytes: int = 0
    # Where given, a region must be one of these node ranges (the planner's submodule calls: a
    # plan is applied by wrapping a submodule's forward); None allows any run of nodes.
    allowed_regions: tuple[range, ...] | None = None
    region_overhead_ms: float = 0.0  # fixed cost of each region (checkpoint's own work per call)

    def __post_init__(self) -> None:
        for region in self.allowed_regions or ():
            if region.step != 1 or len(region) == 0 or region.start < 0 or region.stop > len(self.nodes):
                raise ValueError(f"allowed region {region} is not a non-empty run of the {len(self.nodes)} nodes")
        for index, node in enumerate(self.nodes):
            for owner in (*node.uses, *node.saves, *node.mutates, *node.grad_aliases,
                          *(user for user, _ in node.shared_grads)):
                if not 0 <= owner <= index:
                    raise ValueError(
                        f"node {index} ({node.name!r}) refers to node {owner}, "
                        "which is not an earlier node"
                    )

    def __len__(self) -> int:
        return len(self.nodes)

    def recompute_ms(self, regions: tuple[range, ...]) -> float:
        """Added step time of a plan: every node inside a region runs twice, and each region
        costs `region_overhead_ms` more."""
        recomputed = sum(self.nodes[i].compute_ms for region in regions for i in region)
        return recomputed + self.region_overhead_ms * len(regions)

    def can_start_region(self, index: int) -> bool:
        """False where a region starting here would recompute from a storage that is written
        in place at or after `index` (autograd would see a mutated input)."""
        if index in _forbidden_starts(self):
            return False
        return self.allowed_regions is None or index in _allowed_stops(self)

    def allows_region(self, start: int, stop: int) -> bool:
        """True where [start, stop) may be a region: a startable start and, where
        `allowed_regions` is given, one of them."""
        if not self.can_start_region(start):
            return False
        return self.allowed_regions is None or stop in _allowed_stops(self)[start]

    def last_region_stop(self, start: int) -> int:
        """The largest stop of a region that may start at `start` (n without allowed regions)."""
        if self.allowed_regions is None:
            return len(self.nodes)
        return max(_allowed_stops(self).get(start, (start,)))


def _forbidden_starts(problem: Problem) -> frozenset[int]:
    cached = problem.__dict__.get("_forbidden_starts")
    if cached is None:
        forbidden: set[int] = set()
        for mutator, node in enumerate(problem.nodes):
            for owner in node.mutates:
                # A region starting in (owner, mutator] could take the storage as an input.
                forbidden.update(range(owner + 1, mutator + 1))
        cached = frozenset(forbidden)
        object.__setattr__(problem, "_forbidden_starts", cached)
    return cached


def _allowed_stops(problem: Problem) -> dict[int, frozenset[int]]:
    cached = problem.__dict__.get("_allowed_stops")
    if cached is None:
        stops: dict[int, set[int]] = {}
        for region in problem.allowed_regions or ():
            stops.setdefault(region.start, set()).add(region.stop)
        cached = {start: frozenset(found) for start, found in stops.items()}
        object.__setattr__(problem, "_allowed_stops", cached)
    return cached


def gradient_spans(problem: Problem) -> list[tuple[int, int, int]]:
    """(first, last, bytes) of every gradient storage: alive at the backward of nodes
    first..last, whatever the plan. Node j's gradient appears at the backward of its last
    consumer (n - 1 if none) and is freed after j's own; where that consumer is j's only one and
    hands its output's gradient on unchanged (`grad_aliases`), the two share one storage, held
    until the later of them is done (with other consumers autograd sums into a new tensor). A shared parameter's gradient lives from its last user's backward to its first's.

    Example:
        >>> gradient_spans(Problem(nodes=(NodeCost("a", 1.0, grad_bytes=8),)))
        [(0, 0, 8)]
    """
    nodes = problem.nodes
    n = len(nodes)
    consumer = [-1] * n
    consumers = [0] * n
    for k, node in enumerate(nodes):
        for owner in set(node.uses):
            if owner < k:
                consumer[owner] = max(consumer[owner], k)
                consumers[owner] += 1
    root = list(range(n))  # the node whose gradient storage j's gradient is
    for j in reversed(range(n)):
        c = consumer[j]
        # With other consumers, autograd sums their gradients into j's: a new tensor.
        if c >= 0 and consumers[j] == 1 and j in nodes[c].grad_aliases:
            root[j] = root[c]
    first: dict[int, int] = {}
    size: dict[int, int] = {}
    for j in range(n):
        r = root[j]
        first[r] = min(first.get(r, j), j)
        size[r] = max(size.get(r, 0), nodes[j].grad_bytes)
    last_consumer = [c if c >= 0 else n - 1 for c in consumer]
    spans = [(first[r], last_consumer[r], size[r]) for r in sorted(first)]
    spans += [(user, k, shared) for k, node in enumerate(nodes) for user, shared in node.shared_grads]
    return spans


class Status(str, Enum):
    """How sure a solver is of its answer (like scipy's milp status)."""

    OPTIMAL = "optimal"
    FEASIBLE = "feasible"
    TIME_LIMIT = "time_limit"


@dataclass(frozen=True)
class Solution:
    """A plan: which node ranges run under checkpoint, and what that costs.

    Example:
        >>> Solution(regions=(range(0, 3),), peak_bytes=1024, recompute_ms=2.5,
        ...          status=Status.OPTIMAL, solver="dp", solve_seconds=0.01)
    """

    regions: tuple[range, ...]
    peak_bytes: int
    recompute_ms: float
    status: Status
    solver: str
    solve_seconds: float
    gap: float | None = None  # ilp: relative gap to the proven bound (0.0 when optimal)


def format_bytes(size: float) -> str:
    """Human-readable bytes in binary units.

    Example:
        >>> format_bytes(3 * 2**29)
        '1.50 GiB'
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"


class InfeasibleBudget(ValueError):
    """No plan fits the budget. Carries the smallest budget that does fit.

    Example:
        >>> raise InfeasibleBudget(budget_bytes=2**29, minimum_bytes=3 * 2**28, static_bytes=2**28)
    """

    def __init__(
        self, budget_bytes: int, minimum_bytes: int, static_bytes: int, solver: str = "", proven: bool = True
    ):
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes
        self.static_bytes = static_bytes
        self.solver = solver
        self.proven = proven  # False: minimum_bytes is the smallest peak found, not proven minimal
        activations = minimum_bytes - static_bytes
        dominant = "static memory dominates" if static_bytes >= activations else "activations dominate"
        by = f" for solver {solver!r}" if solver else ""
        super().__init__(
            f"budget {format_bytes(budget_bytes)} is below the minimum {format_bytes(minimum_bytes)}"
            f"{by} (parameters+gradients and other static memory {format_bytes(static_bytes)}, "
            f"activations at least {format_bytes(activations)}: {dominant})"
        )
