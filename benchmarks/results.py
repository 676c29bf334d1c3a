"""Where benchmarks put what they measured: each run's raw figures in
`benchmarks/results/<bench>_<device>_<date>.json`, and the run's table as the one section of
`benchmarks/RESULTS.md` that belongs to its benchmark (replaced, not appended: RESULTS.md shows
the latest figures of each benchmark)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
RAW = HERE / "results"
HEADER = ("# Benchmark results\n\nThe latest run of each benchmark on current code, one section each, written by "
          "the script it names. Each run's raw figures are in `benchmarks/results/`.\n")


def machine(gpu: str | None = None) -> str:
    """This machine in a few words: architecture, cores, last-level cache (CPU timings depend on
    what fits in it), and the GPU or "CPU", with the torch version."""
    import torch

    cache = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")  # Linux: "307200K"
    size = re.fullmatch(r"(\d+)([KM])", cache.read_text().strip()) if cache.exists() else None
    l3 = f", {int(size[1]) // (1024 if size[2] == 'K' else 1)} MiB L3" if size else ""
    return f"{platform.machine()}, {os.cpu_count()} cores{l3}, {gpu or 'CPU'}, torch {torch.__version__}"


def commit() -> str:
    """The checked-out commit (short), with "+changes" where the tree differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--", "planner", "solvers") else "")


# The code a run measures is the code checked out when it started: a long run outlives commits.
COMMIT_AT_START = commit()


def write_run(bench: str, figures: dict[str, Any], device: str = "cpu") -> Path:
    """Write a run's raw figures to `benchmarks/results/<bench>_<device>_<date>.json`, stamped
    with the commit, the machine and the time; returns the path.

    Example:
        >>> write_run("fuzz", {"seeds": records})
        PosixPath('.../benchmarks/results/fuzz_cpu_2026-12-06.json')
    """
    now = datetime.datetime.now()
    RAW.mkdir(exist_ok=True)
    path = RAW / f"{bench}_{device}_{now:%Y-%m-%d}.json"
    stamp = {"bench": bench, "device": device, "commit": COMMIT_AT_START, "machine": machine(None if device == "cpu"
                                                                                        else device),
             "time": now.isoformat(timespec="minutes")}
    path.write_text(json.dumps({**stamp, **figures}, indent=1, default=str) + "\n")
    return path


def set_section(bench: str, title: str, command: str, body: str, gpu: str | None = None) -> None:
    """Make `body` the section of RESULTS.md that belongs to `bench` (its heading `title`, the
    command, commit, machine and date), in place of that benchmark's earlier section.

    Example:
        >>> set_section("fuzz", "Fuzz: 400 random models", "python -m benchmarks.fuzz --seeds 400", table)
    """
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    stamp = f"{datetime.datetime.now():%Y-%m-%d %H:%M}; commit {COMMIT_AT_START}; {machine(gpu)}"
    section = f"<!-- bench: {bench} -->\n## {title}\n\n`{command}` ({stamp})\n\n{body.rstrip()}\n"
    pattern = re.compile(rf"<!-- bench: {re.escape(bench)} -->\n.*?(?=<!-- bench: |\Z)", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    RESULTS.write_text(text)
