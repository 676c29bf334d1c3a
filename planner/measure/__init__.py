"""Measure: what each graph node saves for backward, how long it takes, what the model's own
code holds, and what a whole step peaks at.

- `device`: where the plan is for, and whether this device can hold what measuring needs;
- `autocast`: the mixed precision a step runs under, CUDA autocast's casts on a CPU;
- `paths`: the two ways of measuring, the whole step at once or sizes on fake tensors and
  nodes one at a time;
- `profile`: the whole step on real tensors (`ProfileInterpreter`, node timing);
- `sizes`: sizes on fake tensors, forward and backward;
- `nodes`: each distinct node alone on real tensors (times, kernel scratch);
- `holds`: the model's own forward against the graph (lifetimes, ATen calls);
- `memory`, `allocations`: storages followed by a dispatch mode, the allocator read through
  the profiler;
- `clock`: timing in alternating rounds, medians and their intervals;
- `targets`: the GPUs a plan can be for, roofline estimates of node times;
- `static`: static memory as the user's run holds it (optimizer, FSDP2);
- `steps`: real training steps of a model, planned or not (`Verification`, steady peaks).
"""
