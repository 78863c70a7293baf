"""bench/results.json: every figure `make bench` measured, each with the baseline measured in the same run,
their ratio and the goal the ratio is held to. Each bench script records its figures; run this module to
print them as one table (`make bench` does, last).

    python bench/results.py          # the table of the last run's figures
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

RESULTS = Path(os.environ.get("RUNNER_BENCH_RESULTS", Path(__file__).with_name("results.json")))


def figure(name: str, value: float, unit: str, baseline_name: str, baseline: float, *, goal: str = "",
           note: str = "") -> dict:
    """One figure. `goal` is a bound on the ratio value/baseline, e.g. ">= 1.0" or "<= 1.05"; empty when the
    figure is reported without one (`note` then says what it is compared with, if anything)."""
    ratio = value / baseline if baseline else float("nan")
    met = None
    if goal:
        op, bound = goal.split()
        met = ratio >= float(bound) if op == ">=" else ratio <= float(bound)
    return {"name": name, "value": round(value, 4), "unit": unit, "baseline": baseline_name,
            "baseline_value": round(baseline, 4), "ratio": round(ratio, 4), "goal": goal, "met": met,
            "note": note}


def record(bench: str, figures: list[dict]) -> None:
    """Replaces `bench`'s figures in results.json (atomically), keeping the other scripts'."""
    data = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    data[bench] = figures
    with tempfile.NamedTemporaryFile("w", dir=RESULTS.parent, delete=False, suffix=".tmp") as handle:
        json.dump(data, handle, indent=1)
    os.replace(handle.name, RESULTS)


def table() -> str:
    data = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    lines = [f"{'figure':<44}{'value':>13}  {'baseline (same run)':<32}{'ratio':>8}  {'goal':<9}met  note"]
    for bench, figures in data.items():
        lines.append(f"[{bench}]")
        for f in figures:
            met = {True: "yes", False: "NO", None: "-"}[f["met"]]
            lines.append(f"{f['name']:<44}{f['value']:>8.4g} {f['unit']:<5} {f['baseline']:<22}"
                         f"{f['baseline_value']:>10.4g}  {f['ratio']:>8.3f}  {f['goal'] or '-':<9}{met:<5}{f['note']}")
    return "\n".join(lines)


if __name__ == "__main__":
    if not RESULTS.is_file():
        sys.exit(f"{RESULTS}: no figures yet; run `make bench`")
    print(table())
