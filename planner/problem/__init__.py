"""Problem: the traced, measured graph turned into a torch-free `solvers.Problem` (`graph`), the
regions a plan may recompute (submodule calls, slices of an `nn.Sequential`: `segments`), and
the checkpoint that applies each region of a solution (`regions`)."""
