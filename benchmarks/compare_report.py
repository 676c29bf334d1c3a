"""The results of `benchmarks/compare.py` and their report: per model, one table of every
configuration (peak, step time, measured and predicted overhead, share of every block's), the
issue's targets met or missed (with why), and how the allocator's view compares with the tensor
tracker's (`benchmarks/compare_plot.py` draws peak against step time). The run's figures and
how a measured overhead is read against a prediction are in `benchmarks/compare_results.py`."""
from __future__ import annotations

import statistics

from benchmarks.compare_results import (
    PREDICTION_SLACK_MS,
    PREDICTION_TOLERANCE,
    Config,
    ModelResult,
    every_overhead_ms,
    interval_note,
    interval_verdict,
    median_difference_ms,
    mib,
    overhead_ms,
    prediction_ok,
    within_tolerance,
)
from benchmarks.decision_space import EVERY_KEEP_LIMIT

# Most a plan's overhead may be, as a share of checkpointing every block, at each budget.
SHARE_TARGETS = {"every block's peak": 0.6, "60%": 0.4, "80%": 0.2}
# a share target's flag for models where the lower bound for any plan lies above the target
OUT_OF_REACH = ": out of reach of any plan of whole graph nodes (lower bound above the target)"
# and for models where wrapping submodule calls cannot meet it, whatever they keep
OUT_OF_WRAPPING = (": out of reach of plans that wrap submodule calls (every keep subset of calls of up to "
                   f"{EVERY_KEEP_LIMIT} keepable nodes, runs inside calls)")
# a prediction target's flag for models where no prediction's miss is beyond the timing noise
NOT_SHOWN_OFF = (": no plan's prediction shown off (each measured overhead's 95% interval reaches within 10% "
                 "or 2 ms of it)")


def method_text(rounds: int, threads: int, retained: bool, device_text: str = "") -> str:
    """How the run measured: the paragraph that opens its section in RESULTS.md."""
    return (
        "Peak: static storages (parameters, gradients, buffers, inputs) + the highest point of one "
        "forward+backward step's allocations, kernel scratch included, as `p.verify()` measures it; *under "
        f"budget* uses it. Step time: median over {rounds} rounds, configurations alternating, {threads} intra-op "
        "thread(s), the garbage collector off, "
        + ("freed memory kept in the process as CUDA's caching allocator keeps it (`benchmarks/cpu_memory.py`)"
           if retained else "glibc's malloc as it is")
        + ". Overhead, measured: the step's median less the mean of the unplanned steps run just before and "
        "after it; predicted: the plan's `recompute_ms`, *(off)* where more than 10% and 2 ms from the measured. "
        "Share: overhead / every block's, measured (predicted). A missed share gives the plan's predicted share, "
        "whether that is the cheapest plan the planner searches (proven optimal over its regions, keeps and runs), "
        "and a lower bound for any plan of whole graph nodes (`solvers.bound.recompute`). Batch sizes give about "
        "one second per unplanned step; the *none* rows give what this run measured (a shared machine)."
        + device_text
    )


def table(result: ModelResult, brief: bool = False) -> str:
    """The run's table for one model; `brief` (for RESULTS.md) leaves out the step times' range
    and the predictions from the rounds' node times."""
    none = result.configs[0]
    every = every_overhead_ms(result)
    header = ["configuration", "budget", "peak", "under budget", "step: median" if brief else "step: median [min-max]",
              "overhead, measured", "overhead, predicted", "predicted from the rounds' node times",
              "share of every block's, measured (predicted)", "notes"]
    rows = []
    for c in result.configs:
        budget = f"{mib(c.budget_bytes)} ({c.budget_label})" if c.budget_bytes is not None else "-"
        if c.module is None:
            rows.append([c.name, budget, "-", c.infeasible, "-", "-", "-", "-", "-", ""])
            continue
        measured = overhead_ms(result, c)
        share = f"{measured / every:.2f}" if every > 0 and c is not none else "-"
        predicted = "-"
        if c.predicted_overhead_ms is not None:
            predicted = f"{c.predicted_overhead_ms:.0f} ms" + ("" if prediction_ok(result, c) else " (off)")
            if result.every_predicted_ms:
                share += f" ({c.predicted_overhead_ms / result.every_predicted_ms:.2f})"
        elif c.name == "every block" and result.every_predicted_ms is not None:
            predicted = f"{result.every_predicted_ms:.0f} ms"
        retimed = "-" if c.retimed_ms is None else (
            f"{c.retimed_ms:.0f} ms" + ("" if prediction_ok(result, c, c.retimed_ms) else " (off)"))
        under = "-" if c.budget_bytes is None else ("yes" if c.peak <= c.budget_bytes else "NO")
        notes = c.note
        if c.kind == "planner":  # (brief: without the solver's figures for other decision spaces)
            notes = f"predicted peak {mib(c.predicted_peak_bytes)}; {notes}" + ("" if brief else space_shares(result, c))
        if c.kind == "compile":
            notes = f"compile + first step {c.compile_s:.1f} s; {notes}"
        step_ms = f"{c.step_ms:.0f} ms" + ("" if brief else f" [{min(c.times_ms):.0f}-{max(c.times_ms):.0f}]")
        rows.append([c.name, budget, mib(c.peak), under, step_ms, f"{measured:+.0f} ms", predicted, retimed, share,
                     notes])
    if brief:  # no column of predictions from the rounds' node times
        header, rows = header[:7] + header[8:], [row[:7] + row[8:] for row in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


OVERVIEW_BUDGETS = ("every block's peak", "40%", "60%", "80%")


def overview(results: list[ModelResult]) -> str:
    """One row per model, for RESULTS.md: the unplanned step's peak and time, every block's peak and
    overhead, and the planner's at each of `OVERVIEW_BUDGETS` (its share of every block's
    overhead in brackets; "refused" where the budget is infeasible), and how long planning took.
    Each model's full table is in its raw figures (`section`)."""
    lines = ["| model | unplanned | every block | " + " | ".join(f"planner @ {b}" for b in OVERVIEW_BUDGETS)
             + " | planning |", "|" + "---|" * (4 + len(OVERVIEW_BUDGETS))]
    for result in results:
        none, every = result.configs[0], every_overhead_ms(result)
        by_name = {c.name: c for c in result.configs}
        cells = [f"{mib(none.peak)}, {none.step_ms:.0f} ms"]
        block = by_name.get("every block")
        cells.append("-" if block is None else f"{mib(block.peak)}, {overhead_ms(result, block):+.0f} ms")
        planners = [c for c in result.configs if c.kind == "planner"]
        for label in OVERVIEW_BUDGETS:
            c = next((c for c in planners if c.budget_label == label), None)
            if c is None:
                cells.append("-")
            elif c.module is None:
                cells.append(c.infeasible.replace("infeasible: minimum", "refused: needs"))
            else:
                measured = overhead_ms(result, c)
                share = f" ({measured / every:.2f})" if every > 0 else ""
                cells.append(f"{mib(c.peak)}, {measured:+.0f} ms{share}")
        times = [c.plan_s for c in planners if c.plan_s is not None]
        cells.append(f"{min(times):.0f}-{max(times):.0f} s" if times else "-")
        lines.append(f"| {result.spec.title} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def space_shares(result: ModelResult, config: Config) -> str:
    """The shares (of every block's predicted overhead) of the cheapest plan with every keep
    subset (`Config.every_keep_ms`), of the cheapest with regions on any run of nodes, and of the
    lower bound for any plan, at the configuration's budget."""
    every = result.every_predicted_ms
    if not every or config.bound_ms is None:
        return ""
    any_run = "" if config.any_run_ms is None else f"; whole regions on any run of nodes {config.any_run_ms / every:.2f}"
    every_keep = "" if config.every_keep_ms is None else f"; every keep subset {config.every_keep_ms / every:.2f}"
    return f"{every_keep}{any_run}; lower bound {config.bound_ms / every:.2f}"


def strides_text(result: ModelResult) -> str:
    """At each planner budget, the cheapest (measured) every-n-th-block baseline whose measured
    peak fits it (n = 1: every block), beside the planner's plan there."""
    strided = [c for c in result.configs if c.kind == "baseline" and c.name.startswith("every ")]
    parts = []
    for config in result.configs:
        if config.kind != "planner" or config.module is None or "(thorough)" in config.name:
            continue
        fitting = [c for c in strided if c.peak is not None and c.peak <= config.budget_bytes and c.overheads_ms]
        if not fitting:
            parts.append(f"{config.budget_label}: none fits")
            continue
        best = min(fitting, key=lambda c: overhead_ms(result, c))
        parts.append(f"{config.budget_label}: {best.name} {overhead_ms(result, best):+.0f} ms against the planner's "
                     f"{overhead_ms(result, config):+.0f} ms")
    return "; ".join(parts) or "-"


def verdict(result: ModelResult, brief: bool = False) -> tuple[list[str], dict[str, bool | None]]:
    """Lines for the targets and, per target, met (True), missed (False) or not applicable
    (None): every plan under budget; the share of every block's overhead at most
    `SHARE_TARGETS` at each budget; every predicted overhead within 10% (or 2 ms) of measured.
    A missed share says why: the cheapest plan the solver can choose is predicted above it
    (its decision space is the limit), or the prediction is below it and the clock is not.
    `brief` (RESULTS.md): each line its figures only, what they mean said once (`BRIEF_LEGEND`)."""
    planner = [c for c in result.configs if c.kind == "planner"]
    ran = [c for c in planner if c.module is not None]
    lines: list[str] = []
    flags: dict[str, bool | None] = {}
    noise_ms, noise_line = noise(result)

    over = [c for c in ran if c.peak > c.budget_bytes]
    flags["under budget"] = not over if ran else None
    text = (f"every planner run measured under its budget ({len(ran)} runs)" if not over else
            "OVER budget: " + ", ".join(f"{c.name} {mib(c.peak)} > {mib(c.budget_bytes)}" for c in over))
    not_run = [c for c in planner if c.module is None]
    if not_run:
        text += "; not run: " + ", ".join(f"{c.name} ({c.infeasible})" for c in not_run)
    lines.append(f"- Under budget: {text}.")
    lines.append(f"- Every n-th block at each budget: {strides_text(result)}.")

    every = every_overhead_ms(result)
    for label, target in SHARE_TARGETS.items():
        key = f"share <= {target} at {label}"
        config = next((c for c in planner if c.budget_label == label), None)
        if config is None or config.module is None:
            flags[key] = None
            why = config.infeasible if config is not None else "not run"
            lines.append(f"- Share at {label} (target {target}): no plan ({why}).")
            continue
        if every <= 0:
            flags[key] = None
            lines.append(f"- Share at {label}: every block's overhead measured {every:+.0f} ms (noise exceeds it).")
            continue
        share = overhead_ms(result, config) / every
        flags[key] = share <= target
        if config.bound_ms is not None and result.every_predicted_ms:
            flags[key + OUT_OF_REACH] = config.bound_ms / result.every_predicted_ms > target
        if config.every_keep_ms is not None and result.every_predicted_ms:
            flags[key + OUT_OF_WRAPPING] = config.every_keep_ms / result.every_predicted_ms > target
        shown = f"{share:.3f}" if share > target >= round(share, 2) else f"{share:.2f}"  # (0.604, not 0.60, missed)
        line = f"- Share at {label} (target {target}): {shown}"
        if share > target and brief:
            predicted = (config.predicted_overhead_ms / result.every_predicted_ms
                         if result.every_predicted_ms else None)
            bound = (config.bound_ms / result.every_predicted_ms
                     if config.bound_ms is not None and result.every_predicted_ms else None)
            line += " missed" + ("" if predicted is None else f"; predicted {predicted:.2f}"
                                 + (" (the cheapest plan searched)" if config.optimal else ""))
            line += "" if bound is None else f"; lower bound {bound:.2f}"
            line += "" if overhead_ms(result, config) - target * every > noise_ms else " (within the timing noise)"
        elif share > target:
            predicted = (config.predicted_overhead_ms / result.every_predicted_ms
                         if result.every_predicted_ms else None)
            if predicted is not None and predicted > target and config.optimal:
                line += (f" missed: the cheapest plan at this budget (proven optimal over regions of whole "
                         "submodule calls, each keeping nodes under a selective policy as `Problem.keep_choices` "
                         "lists them: any of up to 8, or in a block its 5 costliest, its k costliest or all but a "
                         "run, runs of nodes inside a submodule call, recomputed alone, and slices of an nn.Sequential's "
                         "children) is "
                         f"predicted at {predicted:.2f} of every block's: no plan the planner searches does better")
                line += wrapping(result, config, target)
            elif predicted is not None:  # which of the two overheads the clock moved
                line += (f" missed: predicted {predicted:.2f}; measured, the plan {overhead_ms(result, config):+.0f} ms "
                         f"against {config.predicted_overhead_ms:.0f} ms predicted and every block {every:+.0f} ms "
                         f"against {result.every_predicted_ms:.0f} ms")
            line += beyond_the_planner(result, config, target)
            beyond = overhead_ms(result, config) - target * every > noise_ms
            line += "" if beyond else " (within the timing noise)"
        lines.append(line + ".")

    def told(configs: list[Config], predictions: dict[str, float], key: str) -> str:
        """'; the rounds' 95% intervals show ...', counting `interval_verdict` over `configs`,
        and the flag of `key` + NOT_SHOWN_OFF."""
        verdicts = [interval_verdict(result, c, predictions[c.name]) for c in configs]
        shown_off = [c.name for c, v in zip(configs, verdicts) if v == "off"]
        flags[key + NOT_SHOWN_OFF] = not shown_off if configs else None
        if brief:
            return f" (95% intervals: {verdicts.count('within')} within, {len(shown_off)} off, " \
                   f"{verdicts.count('undecided')} undecided)"
        return (f"; the rounds' 95% intervals show {verdicts.count('within')} within, {len(shown_off)} off"
                + (f" ({', '.join(shown_off)})" if shown_off else "")
                + f", and leave {verdicts.count('undecided')} undecided (the timing noise wider than the tolerance)")

    predicted = [c for c in ran if c.predicted_overhead_ms is not None]
    off = [c for c in predicted if not prediction_ok(result, c)]
    flags["predicted overhead within 10% or 2 ms"] = not off if predicted else None
    if brief:
        lines.append(f"- Predicted overhead within {100 * PREDICTION_TOLERANCE:.0f}% or {PREDICTION_SLACK_MS:g} ms of "
                     f"measured: {len(predicted) - len(off)}/{len(predicted)}"
                     + told(predicted, {c.name: c.predicted_overhead_ms for c in predicted}, "predicted overhead") + ".")
        return lines, flags
    lines.append(
        f"- Predicted overhead within {100 * PREDICTION_TOLERANCE:.0f}% or {PREDICTION_SLACK_MS:g} ms of measured: "
        f"{len(predicted) - len(off)}/{len(predicted)}"
        + ("" if not off else "; off: " + ", ".join(
            f"{c.name} predicted {c.predicted_overhead_ms:.0f} ms, measured {overhead_ms(result, c):+.0f} ms"
            + interval_note(result, c, c.predicted_overhead_ms) for c in off))
        + (f"; every block: predicted {result.every_predicted_ms:.0f} ms, measured {every:+.0f} ms"
           if result.every_predicted_ms is not None else "")
        + f"; measured as the difference of the two medians instead: "
          f"{sum(within_tolerance(c.predicted_overhead_ms, median_difference_ms(result, c)) for c in predicted)}/"
          f"{len(predicted)}"
        + told(predicted, {c.name: c.predicted_overhead_ms for c in predicted}, "predicted overhead") + ".")
    retimed = [c for c in predicted if c.retimed_ms is not None]
    if retimed:
        off = [c for c in retimed if not prediction_ok(result, c, c.retimed_ms)]
        flags["predicted from the rounds' node times within 10% or 2 ms"] = not off
        every_config = next(c for c in result.configs if c.name == "every block")
        lines.append(
            f"- Predicted from node times measured in the rounds (`benchmarks/retime.py`), within "
            f"{100 * PREDICTION_TOLERANCE:.0f}% or {PREDICTION_SLACK_MS:g} ms of measured: {len(retimed) - len(off)}/"
            f"{len(retimed)}" + ("" if not off else "; off: " + ", ".join(
                f"{c.name} predicted {c.retimed_ms:.0f} ms, measured {overhead_ms(result, c):+.0f} ms"
                + interval_note(result, c, c.retimed_ms) for c in off))
            + (f"; every block: predicted {every_config.retimed_ms:.0f} ms, measured {every:+.0f} ms"
               if every_config.retimed_ms is not None else "")
            + told(retimed, {c.name: c.retimed_ms for c in retimed}, "predicted from the rounds' node times") + ".")
    lines.append(noise_line)
    return lines, flags


def wrapping(result: ModelResult, config: Config, target: float) -> str:
    """What wrapping submodule calls reaches at all at this budget (`decision_space.
    every_keep_subset`: any subset of each call's keepable nodes kept, not only the planner's
    choices), where known: above `target`, only regions across submodule calls could meet it."""
    every = result.every_predicted_ms
    if not every or config.every_keep_ms is None:
        return ""
    share = config.every_keep_ms / every
    text = (f"; with every subset of the keepable nodes of each submodule call of up to {EVERY_KEEP_LIMIT} as a "
            f"keep choice (larger calls, a whole model: the planner's), the cheapest plan is {share:.2f} (dp, "
            "proven optimal)")
    if share > target:
        text += ": no plan that wraps submodule calls with these keeps, or runs inside them, meets the target"
        if config.bound_ms is not None and config.bound_ms / every <= target:  # (else none at all does)
            text += ("; one that does would need regions across submodule calls that keep nodes (checkpoint wraps "
                     "a function: the model's forward would have to be split there)")
    return text


def beyond_the_planner(result: ModelResult, config: Config, target: float) -> str:
    """What larger decision spaces give at this budget, as shares of every block's predicted
    overhead: regions on any run of nodes (across submodule calls, which the planner applies only
    in a model's own forward of at most 200 nodes), and the
    lower bound for any plan, which where it lies above `target` proves the target out of reach
    on these node times."""
    every = result.every_predicted_ms
    if not every or config.bound_ms is None:
        return ""
    text = "; " if config.any_run_ms is None else (
        f"; whole regions on any run of graph nodes (across submodule calls too, which the planner applies "
        f"only in a model's own forward of at most 200 nodes, and without the runs' recording cost) would reach {config.any_run_ms / every:.2f}; ")
    if config.bound_ms == float("inf"):
        return text + "no plan of whole graph nodes fits"
    bound = config.bound_ms / every
    if bound > target:
        return text + (f"no plan of whole graph nodes can meet the target on these node times: none costs under "
                       f"{bound:.2f} (a lower bound, `solvers.bound.recompute.recompute_lower_bound`: recomputation, each "
                       "region's checkpoint call and, where it keeps nodes, its policy)")
    return text + f"no plan of whole graph nodes can cost under {bound:.2f} (a lower bound)"


def noise(result: ModelResult) -> tuple[float, str]:
    """The timing noise of a model's run: the median over configurations of their spread
    (max - min over rounds), and how far apart configurations running the same plan measured."""
    runnable = [c for c in result.configs if c.module is not None and len(c.times_ms) > 1]
    spread = statistics.median(c.spread_ms for c in runnable) if runnable else 0.0
    same = {}
    for c in result.configs:
        if c.regions is not None and c.module is not None:  # the same regions keeping the same nodes
            kept = tuple(c.plan.solution.kept) if c.plan is not None else ()
            same.setdefault((c.regions, kept), []).append(c)
    pairs = [group for group in same.values() if len(group) > 1]
    line = (f"- Timing noise: median spread (max - min over rounds) of a configuration's step time "
            f"{spread:.0f} ms")
    if pairs:
        worst = max(pairs, key=lambda group: max(c.step_ms for c in group) - min(c.step_ms for c in group))
        gap = max(c.step_ms for c in worst) - min(c.step_ms for c in worst)
        line += (f"; {len(pairs)} group(s) of planner runs with identical plans, whose medians differ by up to "
                 f"{gap:.0f} ms ({' vs '.join(c.name for c in worst)})")
    return spread, line + "."


def validation(results: list[ModelResult]) -> str:
    """How the allocator's view (kernel scratch left out) compares with the tensor tracker's."""
    lines = []
    for result in results:
        eager = [c for c in result.configs if c.module is not None and c.eager]
        exact = [c for c in eager if c.peak_without_scratch == c.tensor_peak]
        deviation = max(eager, key=lambda c: abs(c.peak_without_scratch - c.tensor_peak))
        difference = deviation.peak_without_scratch - deviation.tensor_peak
        scratch = [(c.peak - c.tensor_peak) / c.tensor_peak for c in eager]
        lines.append(
            f"- {result.spec.key}: {len(eager)} eager configurations, {len(exact)} identical to the byte; largest "
            f"difference {difference:+d} B ({100 * difference / deviation.tensor_peak:+.3f}%, {deviation.name}); "
            f"kernel scratch adds {100 * min(scratch):+.1f}% to {100 * max(scratch):+.1f}% to the peak")
    return "\n".join(lines)


def summary_lines(all_flags: dict[str, list[bool | None]]) -> str:
    """The Targets section: per target, on how many models it was met (or, for the lower
    bound's flags, shown out of reach), of those where it applies."""
    lines = []
    for key, values in all_flags.items():
        applies = sum(1 for value in values if value is not None)
        verb = "shown" if key.endswith((OUT_OF_REACH, OUT_OF_WRAPPING)) else "true" if key.endswith(NOT_SHOWN_OFF) else "met"
        line = f"- {key}: {verb} on {sum(1 for value in values if value)} of {applies} models where it applies"
        lines.append(line + (f" (not applicable on {values.count(None)})" if None in values else ""))
    return "\n".join(lines)
