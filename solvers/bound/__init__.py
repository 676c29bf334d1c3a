"""How little any plan can cost at a budget, whatever its regions (`recompute`), from the rows of
nodes that must be freed (`rows`) and the backward peaks that no plan lowers (`backward`)."""

__all__: list[str] = []
