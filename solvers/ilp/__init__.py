"""An exact CP-SAT model of the simulator on any DAG (`solve`, needs OR-Tools): the model
(`model`, `parts`, `keep` for keep-inside-region choices), its warm start (`warm_start`) and the
LP relaxation that bounds it (`lp_relaxation`)."""

__all__: list[str] = []
