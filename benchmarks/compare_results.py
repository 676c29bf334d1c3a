"""What one run of `benchmarks/compare.py` measured, per model and configuration, and how a
measured overhead is read against a prediction: the median over rounds, a 95% interval for it,
issue 14's tolerance (within 10% or 2 ms), and what the interval can tell of a prediction.

Example:
    >>> within_tolerance(predicted_ms=100.0, measured_ms=108.0)
    True
"""
from __future__ import annotations

import contextlib
import logging
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterator

PREDICTION_TOLERANCE = 0.10  # predicted overhead within 10% of the measured one,
PREDICTION_SLACK_MS = 2.0  # or within 2 ms


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f} MiB"


@dataclass
class Config:
    name: str
    kind: str  # "baseline", "compile", "planner"
    module: Any = None
    budget_bytes: int | None = None
    solver: str = ""
    fraction: float | None = None
    infeasible: str = ""  # why there is no module
    note: str = ""
    compile_s: float | None = None
    predicted_peak_bytes: int | None = None
    peak: int | None = None  # the allocator's, kernel scratch included
    peak_without_scratch: int | None = None
    tensor_peak: int | None = None  # LiveBytesTracker's (eager configurations only)
    times_ms: list[float] = field(default_factory=list)
    # per round, the step less the mean of the two unplanned steps around it (`clock.sandwiched_rounds`)
    overheads_ms: list[float] = field(default_factory=list)
    backend: Any = None
    regions: tuple[tuple[str, ...], ...] | None = None  # planner: the recomputed node ranges
    budget_label: str = ""  # planner: "every block's peak", "40%", ...
    predicted_overhead_ms: float | None = None  # planner: p.recompute_ms
    optimal: bool = False  # planner: the solver proved its plan the cheapest of its decision space
    bound_ms: float | None = None  # planner: no plan of whole graph nodes costs less at this budget
    any_run_ms: float | None = None  # planner: cheapest of whole regions on any run of nodes (dp)
    # planner: cheapest with every keep subset of small submodule calls (dp, proven optimal;
    # `decision_space.every_keep_subset`)
    every_keep_ms: float | None = None
    plan: Any = None  # planner: the Plan
    retimed_ms: float | None = None  # planner, every block: predicted from node times of the rounds
    plan_s: float | None = None  # planner: seconds plan() took at this budget (or replan(), with --replan)

    @property
    def eager(self) -> bool:
        return self.kind != "compile"

    @property
    def step_ms(self) -> float | None:
        return statistics.median(self.times_ms) if self.times_ms else None

    @property
    def spread_ms(self) -> float:
        """max - min of the step times over rounds."""
        return max(self.times_ms) - min(self.times_ms) if self.times_ms else 0.0


@dataclass
class ModelResult:
    spec: Any  # compare_models.Spec
    description: str
    configs: list[Config]  # "none" first
    plan_s: float
    notes: list[str]
    every_predicted_ms: float | None = None  # the planner's prediction of every block's overhead


def overhead_ms(result: ModelResult, config: Config) -> float:
    """Measured overhead: the median over rounds of the configuration's step time less the mean
    of the two unplanned steps around it (`planner.measure.clock.sandwiched_rounds`): the machine's speed
    changes cancel, as they would not between the two medians (`median_difference_ms`) or steps
    a round apart. 0 for the unplanned one."""
    return statistics.median(config.overheads_ms) if config.overheads_ms else 0.0


def median_difference_ms(result: ModelResult, config: Config) -> float:
    """The configuration's median step time less the unplanned one's: the plain reading, which
    the machine's drift between the two medians moves (the report gives it for comparison)."""
    return config.step_ms - result.configs[0].step_ms


def every_overhead_ms(result: ModelResult) -> float:
    every = next(c for c in result.configs if c.name == "every block")
    return overhead_ms(result, every)


def prediction_ok(result: ModelResult, config: Config, predicted_ms: float | None = None) -> bool:
    """Whether `predicted_ms` (default: the plan's `recompute_ms`) is within the tolerance of
    the configuration's measured overhead."""
    predicted_ms = config.predicted_overhead_ms if predicted_ms is None else predicted_ms
    return within_tolerance(predicted_ms, overhead_ms(result, config))


def within_tolerance(predicted_ms: float, measured_ms: float) -> bool:
    """Issue 14's test of a prediction: within 10% of the measured overhead, or within 2 ms."""
    return abs(predicted_ms - measured_ms) <= max(PREDICTION_TOLERANCE * abs(measured_ms), PREDICTION_SLACK_MS)


def overhead_interval_ms(result: ModelResult, config: Config) -> tuple[float, float] | None:
    """A 95% interval for the configuration's overhead from its rounds (`clock.median_interval`
    of `overheads_ms`). None with fewer than 6 rounds, where no such interval reaches 95%."""
    from planner.measure.clock import median_interval

    return median_interval(config.overheads_ms)


def interval_verdict(result: ModelResult, config: Config, predicted_ms: float) -> str:
    """What the rounds can say of a prediction: "within" where it passes `within_tolerance`
    against every overhead in the measured one's 95% interval (`overhead_interval_ms`), "off"
    where it passes against none, else "undecided" (the timing noise is wider than the
    tolerance). It passes on one stretch of measured values around the prediction, so the
    interval's two ends decide "within", and its point nearest to the prediction "off".

    Example:
        >>> interval_verdict(result, config, predicted_ms=100.0)  # overheads_ms all near +100
        'within'
    """
    interval = overhead_interval_ms(result, config)
    if interval is None:
        return "undecided"
    low, high = interval
    if within_tolerance(predicted_ms, low) and within_tolerance(predicted_ms, high):
        return "within"
    nearest = min(max(predicted_ms, low), high)
    return "undecided" if within_tolerance(predicted_ms, nearest) else "off"


def interval_note(result: ModelResult, config: Config, predicted_ms: float) -> str:
    """' (...)' after a prediction its median measurement misses: what the whole 95% interval
    of the measured overhead says of it (`interval_verdict`: "off", or "undecided" where the
    timing noise is wider than the tolerance; never "within", which the median would pass)."""
    interval = overhead_interval_ms(result, config)
    if interval is None:
        return ""
    where = "shown off by" if interval_verdict(result, config, predicted_ms) == "off" else "undecided by"
    return f" ({where} the measured overhead's 95% interval, {interval[0]:+.0f} to {interval[1]:+.0f} ms)"


class PlanningReadings(logging.Handler):
    """The readings a planning took off the model's own steps and a block's
    (`planner.measure.clock.reading_or_price` logs each): what was read, its interval (at
    `planner.measure.clock.READING_LEVEL`), the price it was held against, and whether it replaced the
    price. Kept with the run's notes, so that runs
    can be read together: one planning's interval rarely tells a small cost from its price.

    Example:
        >>> readings = PlanningReadings()
        >>> with readings.watching():
        ...     base = plan(model, sample, budget_gb=80)
        >>> readings.lines[0]
        '8 calls in the model's step +4.46 ms (99.5% -39.17 to +47.89) against 1.82 ms priced: the price stood'
    """

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        from planner.measure.clock import (
            READING_LEVEL,
            READING_STOOD,
            READING_TAKEN,
            READING_TAKEN_ALONE,
        )

        if record.msg not in (READING_STOOD, READING_TAKEN, READING_TAKEN_ALONE):
            return
        if record.msg == READING_TAKEN_ALONE:
            (what, measured_ms, price_ms), interval = record.args, ""
        else:
            what, measured_ms, low, high, price_ms = record.args
            interval = f" ({100 * READING_LEVEL:g}% {low:+.2f} to {high:+.2f})"
        outcome = "the price stood" if record.msg == READING_STOOD else "the reading replaced it"
        self.lines.append(f"{what} {measured_ms:+.2f} ms{interval} against {price_ms:.2f} ms priced: {outcome}")

    @contextlib.contextmanager
    def watching(self) -> Iterator[PlanningReadings]:
        """Attached to planner.measure.clock's logger, at INFO at least, for a `with` block."""
        logger = logging.getLogger("planner.measure.clock")
        level = logger.level
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
        logger.addHandler(self)
        try:
            yield self
        finally:
            logger.removeHandler(self)
            logger.setLevel(level)
