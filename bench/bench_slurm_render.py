"""The time to render a Slurm comparison, measured in the same run: `runner compare --executor slurm --dry-run`
(plan loading and freezing, the policy's resolution, one sbatch script per arm with its stages and seeds, the
report job) for six arms x three seeds, against one arm x one seed. Nothing is submitted.
Needs the tiny policy (`make demo` builds it; this reuses the cache)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import figure, record

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "qualification" / "plans" / "calc-tool-cpu.yaml"
PROFILE = ROOT / "clusters" / "example-h100.toml"
SIX_ARMS = "trl,nemo-gym,openenv,verifiers,lightning-verl,skyrl-gym"


def render(stacks: str, plan: Path, run_dir: Path) -> tuple[float, int]:
    """(seconds, sbatch scripts written) of one dry-run render."""
    command = "compare" if "," in stacks else "qualify"
    selector = ["--stacks", stacks] if command == "compare" else ["--stack", stacks]
    started = time.perf_counter()
    result = subprocess.run([str(Path(sys.executable).parent / "runner"), command, *selector, "--plan", str(plan),
                             "--executor", "slurm", "--cluster", str(PROFILE), "--dry-run", "--run-dir", str(run_dir),
                             "--json"], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"runner {command} --dry-run failed: {result.stderr[-2000:]}")
    json.loads(result.stdout)
    return seconds, len(list(run_dir.rglob("*.sbatch")))


def main(repeat: int = 3) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        seeds = tmp / "three-seeds.yaml"
        seeds.write_text(PLAN.read_text().replace("seeds: [7]", "seeds: [7, 8, 9]"))
        one = [render("trl", PLAN, tmp / f"one-{i}") for i in range(repeat)]
        six = [render(SIX_ARMS, seeds, tmp / f"six-{i}") for i in range(repeat)]
    single, full = statistics.median(s for s, _ in one), statistics.median(s for s, _ in six)
    print(f"slurm render, median of {repeat}: 1 arm x 1 seed {single:.2f} s ({one[0][1]} scripts), "
          f"6 arms x 3 seeds {full:.2f} s ({six[0][1]} scripts), {full / single:.2f}x")
    record("slurm_render", [figure("slurm render: 6 arms x 3 seeds (--dry-run)", full, "s",
                                   "1 arm x 1 seed (--dry-run)", single, note=f"{six[0][1]} sbatch scripts")])


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
