"""Policy server: 64 concurrent two-turn episodes (greedy, top-k and top-p calls mixed, chat and token-in/
token-out) on the tiny calc policy, sampled batched and, as the baseline in the same run, one call at a time.
The clients run in a process of their own, as an environment's do. Figures: calls/s batched over
one-at-a-time (wall time, the clients' start included), the seconds the model itself took each way, and
the share of calls whose prompt ids, sampled ids, logprobs and finish reason are bit-identical both ways
(every call is attributed to its episode by header), and what exactness costs: the model's seconds batched
against batching that is not batch-invariant (one gemm per linear over all rows, one masked attention call per
layer; `batching_check.PaddedSampler`), with how many calls that changes.
Needs the trl environment and the tiny policy (built on first use and cached)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from results import figure, record

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "qualification" / "plans" / "calc-tool-cpu.yaml"


def main(episodes: int = 64) -> None:
    from runner.api import LocalEngine, build_tiny, get_stack, load_plan

    engine = LocalEngine(log=lambda message: print(message, file=sys.stderr))
    plan = load_plan(PLAN)
    policy_dir = build_tiny(engine, dict(plan.policy.tiny or {}), plan)
    trl = engine.prepare(get_stack("trl"))
    run = subprocess.run([str(trl.python), "-m", "runner_kit.batching_check", str(policy_dir), "--episodes",
                          str(episodes), "--padded"], capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        sys.exit(f"batching check failed: {run.stderr[-3000:]}")
    found = json.loads(run.stdout.strip().splitlines()[-1])
    alone, batched, padded = found["alone"], found["batched"], found["padded"]
    identical = found["calls"] - len(found["differing"]) if found["same_calls"] else 0
    record("policy_server", [
        figure(f"calls/s, {episodes} concurrent episodes, batched", found["calls"] / batched["seconds"], "/s",
               "one call at a time", found["calls"] / alone["seconds"],
               note=f"{batched['mode']}; {batched['mean_rows']} rows per decode step, up to {batched['max_rows']}"),
        figure("model seconds, batched", batched["model_s"], "s", "one call at a time", alone["model_s"],
               note="the scheduler's forward passes and sampling alone"),
        figure("calls bit-identical to one-at-a-time", identical, "calls", "calls", found["calls"], goal=">= 1.0",
               note="prompt ids, sampled ids, logprobs, finish reason"),
        figure("model seconds, batched exact", batched["model_s"], "s", "batched, not batch-invariant",
               padded["model_s"], note=f"what exactness costs; not batch-invariant, {padded['differing']} of "
                                       f"{found['calls']} calls differ from one-at-a-time ({padded['ids_differing']} "
                                       f"in their sampled ids)"),
    ])
    print(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
