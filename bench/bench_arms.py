"""Every language-model arm on the calc-tool CPU plan, in one `runner compare` per round (stages probe to update,
then train): each environment arm's train-stage rollouts/s against the trl arm's of the same round (#22's goal:
>= 0.8x), and each arm's time to its first reproducible update against the one-minute budget. Also prints the
policy server's batching figures per environment arm (calls, decode steps, mean rows per step and per attention
call, model seconds).

One arm's train stage varies by about +-10% from one run to the next, so a single round's ratio can land on
either side of 0.8 for the same code: each figure recorded is the arm's median round (by its ratio), and the
note lists every round's ratio.

    python bench/bench_arms.py [--stacks trl,openenv,...] [--rounds 3]

Needs the stack environments and the tiny policy (built on first use and cached); ~7 minutes a round on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results import figure, record

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "qualification" / "plans" / "calc-tool-cpu.yaml"
STACKS = "trl,openenv,nemo-gym,verifiers,lightning-verl,skyrl-gym"
FIRST_UPDATE_BUDGET_S = 60.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stacks", default=STACKS, help="comma-separated; trl (the baseline) is always run")
    parser.add_argument("--rounds", type=int, default=3, help="one `runner compare` each; figures are medians")
    args = parser.parse_args()
    stacks = ["trl", *(s for s in args.stacks.split(",") if s and s != "trl")]
    rounds = []
    for number in range(1, args.rounds + 1):
        arms = run_round(stacks)
        rounds.append(arms)
        print(f"round {number} of {args.rounds}")
        print_round(arms)
    figures = []
    for name in stacks[1:]:
        ratios = [arms[name]["throughput"]["rollouts_per_s"] / arms["trl"]["throughput"]["rollouts_per_s"]
                  for arms in rounds]
        median = ratios.index(statistics.median_low(ratios))
        arm, trl = rounds[median][name], rounds[median]["trl"]
        figures.append(figure(f"{name} train-stage rollouts/s", arm["throughput"]["rollouts_per_s"], "/s",
                              "trl arm, same run", trl["throughput"]["rollouts_per_s"], goal=">= 0.8",
                              note=f"median of {len(rounds)} rounds' ratios ({', '.join(f'{r:.2f}' for r in ratios)}); "
                                   "same tokens as one-at-a-time sampling"))
    for name in stacks:
        times = [arms[name]["time_to_first_reproducible_update_s"] for arms in rounds]
        figures.append(figure(f"{name} first reproducible update", statistics.median_low(times), "s", "budget",
                              FIRST_UPDATE_BUDGET_S, goal="<= 1.0",
                              note=f"median of {len(rounds)} rounds ({', '.join(f'{t:.0f}' for t in times)} s)"))
    record("arms", figures)


def run_round(stacks: list[str]) -> dict[str, dict]:
    """One `runner compare` of `stacks`: each arm's comparison entry, with its policy server's batching figures."""
    runner_bin = Path(sys.executable).parent / "runner"
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run([str(runner_bin), "compare", "--stacks", ",".join(stacks), "--plan", str(PLAN),
                              "--stages", "probe,service,rollout,update,train", "--run-dir", f"{tmp}/cmp", "--json"],
                             capture_output=True, text=True)
        comparison_path = Path(tmp) / "cmp" / "comparison.json"
        if not comparison_path.is_file():
            sys.exit(f"runner compare failed ({run.returncode}): {run.stderr[-3000:]}")
        comparison = json.loads(comparison_path.read_text())
        return {arm["stack"]: {**arm, "batching": _policy_batching(Path(tmp) / "cmp" / "arms" / arm["stack"])}
                for arm in comparison["arms"]}


def print_round(arms: dict[str, dict]) -> None:
    trl_rate = arms["trl"]["throughput"]["rollouts_per_s"]
    print(f"{'arm':16}{'rollouts/s':>11}{'x trl':>7}{'first update s':>16}  policy server")
    for name, arm in arms.items():
        rate, first = arm["throughput"].get("rollouts_per_s"), arm["time_to_first_reproducible_update_s"]
        server = arm["batching"] or {}
        print(f"{name:16}{rate:>11.1f}{rate / trl_rate:>7.2f}{first:>16.1f}  "
              + (f"{server.get('calls')} calls ({server.get('prefills_shared')} from a shared prefill), "
                 f"{server.get('decode_steps')} steps, {server.get('mean_rows')} rows per step, "
                 f"{server.get('mean_rows_per_attention_call')} per attention call, model {server.get('model_s')} s "
                 f"({server.get('model_cpu_s')} s of CPU)"
                 if server else "-"), flush=True)


def _policy_batching(arm_dir: Path) -> dict | None:
    result = arm_dir / "stages" / "train" / "result.json"
    if not result.is_file():
        return None
    return json.loads(result.read_text()).get("metrics", {}).get("policy_batching")


if __name__ == "__main__":
    main()
