"""The gradients in flight during backward, which no plan changes: where each gradient storage
is made and freed, derived from the graph (or as measured, `Problem.measured_gradients`).
`solvers.simulate` and `solvers.structure` read them.

Example:
    >>> gradient_spans(Problem(nodes=(NodeCost("a", 1.0, grad_bytes=8),)))
    [(0, 0, 8)]
"""
from __future__ import annotations

from solvers.problem import NodeCost, Problem


def gradient_spans(problem: Problem) -> list[tuple[int, int, int]]:
    """(first, last, bytes) of every gradient storage: alive at the backward of nodes
    first..last, whatever the plan.

    Autograd keeps one gradient per *version* of a tensor: an in-place write (`x += y`,
    `relu_`) at node m makes a new version of its owner, which later readers read, and m's
    backward turns the new version's gradient into the old one's. So the gradient of version v
    (an owner j, or the mutator m that made it) appears at the backward of v's last reader
    (n - 1 if none and the tensor is returned; none at all for an unread mutated version) and
    is freed after v's own backward. Where that reader is v's only one and hands its result's
    gradient on unchanged (`grad_aliases`: an add, a cat, an in-place add), the two share one
    storage, held until the later of them is done (with other readers autograd sums into a new
    tensor, always where the shared storage is larger: a cat's). A shared parameter's gradient lives from its last user's backward to its first's.

    Example:
        >>> gradient_spans(Problem(nodes=(NodeCost("a", 1.0, grad_bytes=8),)))
        [(0, 0, 8)]
    """
    if problem.measured_gradients is not None:
        return list(problem.measured_gradients)
    nodes = problem.nodes
    n = len(nodes)
    owner_of = list(range(n))  # version -> the owner whose storage it is
    current = list(range(n))  # owner -> its latest version so far in forward
    readers: list[list[int]] = [[] for _ in range(n)]  # per version, in forward order
    for k, node in enumerate(nodes):
        for owner in set(node.uses):
            if owner < k:
                readers[current[owner]].append(k)
        if not node.output_bytes:  # a node with outputs of its own keeps its index for them
            for owner in node.mutates:
                if owner < k:
                    current[owner] = k
                    owner_of[k] = owner
    consumer = [r[-1] if r else -1 for r in readers]

    def hands_on(v: int) -> bool:  # v's last reader passes its result's gradient to v uncopied
        return consumer[v] >= 0 and owner_of[v] in nodes[consumer[v]].grad_aliases

    root = list(range(n))  # the version whose gradient storage v's gradient is
    for v in reversed(range(n)):
        if hands_on(v) and len(readers[v]) == 1:
            root[v] = root[consumer[v]]
    first: dict[int, int] = {}
    size: dict[int, int] = {}
    for v in range(n):
        r = root[v]
        first[r] = min(first.get(r, v), v)
        size[r] = max(size.get(r, 0), _version_grad_bytes(nodes, v, owner_of[v], consumer[v], current))
    last_consumer = [c if c >= 0 else n - 1 for c in consumer]
    # A version read several times whose last reader hands it a shared gradient holds that
    # storage until the next reader's gradient arrives; autograd then sums out of place into a
    # new storage, unless nothing else holds the shared one any more (it sums in place).
    merged: dict[int, int] = {}  # group -> the group it joined

    def group(r: int) -> int:
        while r in merged:
            r = merged[r]
        return r

    for v in reversed(range(n)):
        if hands_on(v) and len(readers[v]) > 1 and root[v] == v:
            shared, second = group(root[consumer[v]]), readers[v][-2]
            if first[shared] <= second:
                last_consumer[v] = second
            elif size[shared] > size[v]:  # a view of a larger storage (a cat's) is never summed into in place
                first[shared] = second
                last_consumer[v] = second
            else:
                first[shared] = min(first[shared], first.pop(v))
                size[shared] = max(size[shared], size.pop(v))
                merged[v] = shared
    spans = [(first[r], last_consumer[r], size[r]) for r in sorted(first)]
    spans += [(user, k, shared) for k, node in enumerate(nodes) for user, shared in node.shared_grads]
    return spans


def _version_grad_bytes(nodes: tuple[NodeCost, ...], version: int, owner: int, consumer: int,
                        current: list[int]) -> int:
    """Bytes of the gradient of one version: its owner's gradient size, except for a version
    made in place that nothing reads and that is not returned (no gradient reaches it)."""
    if version == owner:
        return nodes[version].grad_bytes
    returned = nodes[version].is_output or (nodes[owner].is_output and current[owner] == version)
    return nodes[owner].grad_bytes if consumer >= 0 or returned else 0
