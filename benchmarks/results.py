"""Append a benchmark's table to benchmarks/RESULTS.md under its own dated heading."""
from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def append_results(title: str, command: str, body: str, gpu: str | None = None) -> None:
    """Add `## title` with the date, machine (`gpu`: the GPU it ran on) and command, then `body`,
    to RESULTS.md.

    Example:
        >>> append_results("Memory accuracy", "python benchmarks/memory_accuracy.py", table)
    """
    if not RESULTS.exists():
        RESULTS.write_text("# Benchmark results\n\nEach section is appended by the script it names.\n")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, " + (gpu or "torch CPU")
    with RESULTS.open("a") as results:
        results.write(f"\n## {title} ({stamp}; {machine})\n\n`{command}`\n\n{body.rstrip()}\n")
