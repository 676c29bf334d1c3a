"""Gradients that a node's backward makes for the views it read (`NodeProfile.view_grads`).

Autograd gives a view (a transpose, a slice, an expand) a gradient of its own: the backward
of the view's last reader makes it, the earlier readers' gradients are summed into it, and the
view's own backward hands it on to what the view was made from. A view that keeps the size
hands on the storage itself (a transpose); one that changes it (a slice, an expand, a split)
makes a new storage of its input's size there and frees the received one. So a reader's
gradient for a view is a storage of its own from the reader's backward until the backward of
the first view down its chain that changes the size, else of the chain's first view (where it
reaches the owner's gradient): unless a later node read one of the chain's tensors, whose
gradient it then joins as soon as it gets there.

`ViewGradients` follows the forward's reads and keeps, per reader, (owner, the view node
whose backward ends the storage, bytes); `solvers.simulate.gradient_spans` turns them into
spans of the backward. On the owner's own last reader the storage goes on as the owner's
gradient unless a size-changing view ended it.

Example:
    >>> views = ViewGradients(autograd_owners, owner_of_storage)
    >>> views.made("slice_1", outputs, inputs)      # each view node, as it runs
    >>> views.read(record, inputs, producers)       # each node, as it runs
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from planner.core import NodeProfile

TensorKey = tuple[int, int]  # (id of the autograd node that made a tensor, its output number)


@dataclass
class _Storage:
    """One reader's gradient for a view: alive from its backward to `end`'s."""

    owner: str
    end: str
    nbytes: int
    # the tensors it passes on its way down, each with the node that hands it there
    passes: list[tuple[TensorKey, str]] = field(default_factory=list)


class ViewGradients:
    """The reads of views in one forward, and each reader's `view_grads`.

    `autograd_owners` maps autograd nodes to the compute node that made them (filled as the
    forward runs); `owner_of` gives a tensor's storage owner (a compute node's name) or None.
    """

    def __init__(self, autograd_owners: dict[Any, str], owner_of: Callable[[torch.Tensor], str | None]) -> None:
        self.autograd_owners = autograd_owners
        self.owner_of = owner_of
        # view node (no storage of its own, no in-place write) -> whether its outputs' size
        # differs from its input's
        self.resizing: dict[str, bool] = {}
        self.passing: dict[TensorKey, list[tuple[_Storage, NodeProfile]]] = {}
        self.storages: dict[int, list[_Storage]] = {}  # id of a reader's record -> its storages

    def made(self, name: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        """Note view node `name`'s outputs: whether their size differs from its input's."""
        size = inputs[0].numel() * inputs[0].element_size() if inputs else None
        self.resizing[name] = any(t.numel() * t.element_size() != size for t in outputs)

    def read(self, record: NodeProfile, inputs: list[torch.Tensor], producers: list[Any],
             makes_gradients: bool) -> None:
        """A node read `inputs` (`producers`: their autograd nodes before it ran): the earlier
        readers' storages passing these tensors end where they would meet its gradient; where
        `makes_gradients` (a node that makes storages of its own and writes none in place),
        its own storages for the views it read are noted in `record.view_grads`."""
        for tensor, function in zip(inputs, producers):
            if function is not None:
                self._joined((id(function), tensor.output_nr))
        if not makes_gradients:
            return
        mine: dict[TensorKey, _Storage] = {}
        for tensor, function in zip(inputs, producers):
            key = (id(function), tensor.output_nr)
            if function is None or key in mine or self.autograd_owners.get(function) not in self.resizing:
                continue
            storage = self._down_from(function, tensor)
            if storage is not None:
                mine[key] = storage
        for storage in mine.values():
            for key, _ in storage.passes:
                self.passing.setdefault(key, []).append((storage, record))
        self.storages[id(record)] = list(mine.values())
        record.view_grads = tuple((s.owner, s.end, s.nbytes) for s in mine.values())

    def _down_from(self, function: Any, tensor: torch.Tensor) -> _Storage | None:
        """The storage a reader of `tensor` (made by view autograd node `function`) gets for it."""
        owner = self.owner_of(tensor)
        if owner is None:
            return None
        sender = _THE_READER  # the node whose backward hands the storage to the tensor at `key`
        storage = _Storage(owner, "", tensor.numel() * tensor.element_size())
        key: TensorKey = (id(function), tensor.output_nr)
        while (view := self.autograd_owners.get(function)) in self.resizing:
            if not storage.end:
                storage.passes.append((key, sender))
                if self.resizing[view]:
                    storage.end = view
            sender = view
            if not function.next_functions or function.next_functions[0][0] is None:
                return None
            function, number = function.next_functions[0]
            key = (id(function), number)
        if function not in self.autograd_owners:
            return None  # a view of a parameter or a graph input: no owner's gradient to meet
        storage.end = storage.end or sender
        return storage

    def _joined(self, key: TensorKey) -> None:
        """A later node read tensor `key`: storages passing it end where they get there."""
        for storage, record in self.passing.pop(key, []):
            keys = [k for k, _ in storage.passes]
            if key not in keys:
                continue  # it ended above this tensor already
            at = keys.index(key)
            sender = storage.passes[at][1]
            del storage.passes[at:]
            mine = self.storages[id(record)]
            if sender == _THE_READER:  # summed into the later reader's gradient at its own backward
                mine.remove(storage)
            else:
                storage.end = sender
            record.view_grads = tuple((s.owner, s.end, s.nbytes) for s in mine)


_THE_READER = ""  # in `_Storage.passes`: the sender of the tensor the reader itself read
