"""Apply: a plan inside the model's own forward. `checkpoints` wraps each planned submodule's
forward in `torch.utils.checkpoint`; `policy` is the selective policy of a region that keeps
nodes; `runs` recomputes a run of ATen calls inside one submodule call; `sequential` checkpoints
slices of an `nn.Sequential`'s children."""

__all__: list[str] = []
