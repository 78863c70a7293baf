"""Environment stacks: episodes/s per stack and per-step latency through our adapter vs the upstream client.

For every environment stack (kind = "environment" in its stack.toml) the adapter's `bench` job runs in
the stack's own environment: the upstream environment server, 64 scripted calc-tool episodes (one tool
call, a correct answer) at concurrency 1 and 4 against a scripted policy, and, where the backend
provides it, the same environment step timed through the upstream's own client alone and through our
adapter's path. The baseline measured in the same run is the reference backend (a plain HTTP agent
loop, no upstream) on this host; ratios are baseline episodes/s over the stack's, and adapter p50 over
upstream-client p50. Needs the stack environments (built on first use and cached).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from results import figure, record

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "qualification" / "plans" / "calc-tool-cpu.yaml"


def p50_ms(samples: list[float]) -> float | None:
    return round(1e3 * statistics.median(samples), 3) if samples else None


def main(episodes: int = 64, steps: int = 500) -> None:
    from runner_contracts import StageRequest, StageResult, read_record
    from runner_kit.reference_backend import ReferenceBackend
    from runner_kit.rollout import bench_backend

    from runner.api import LocalEngine, all_stacks, load_plan

    engine = LocalEngine(log=lambda message: print(message, file=sys.stderr))
    plan = load_plan(PLAN)
    baseline = bench_backend(ReferenceBackend(), episodes=episodes, steps=steps)
    rows = {"reference (baseline, host)": baseline}
    only = set(sys.argv[1:])
    for manifest in all_stacks().values():
        if not manifest.is_environment or (only and manifest.name not in only):
            continue
        env = engine.prepare(manifest)
        with tempfile.TemporaryDirectory() as tmp:
            request = StageRequest(run_id="bench", stack=manifest.name, stage="bench", plan=plan, out_dir=tmp,
                                   options={"episodes": episodes, "steps": steps})
            outcome = engine.run(env, request, timeout_s=1800)
            result_path = Path(tmp) / "result.json"
            if not outcome.ok or not result_path.is_file():
                print(f"{manifest.name}: bench failed: {outcome.stderr.read_text()[-2000:]}", file=sys.stderr)
                continue
            rows[manifest.name] = read_record(result_path, StageResult).metrics
    print(f"{'stack':28} {'eps/s c=1':>10} {'eps/s c=4':>10} {'x slower':>9} {'upstream p50':>13} "
          f"{'adapter p50':>12} {'ratio':>6}")
    for name, figures in rows.items():
        latency = figures.get("step_latency_s") or {}
        upstream, adapter = p50_ms(latency.get("upstream_client", [])), p50_ms(latency.get("adapter", []))
        slower = baseline["episodes_per_s_concurrency_4"] / figures["episodes_per_s_concurrency_4"]
        ratio = f"{adapter / upstream:.2f}" if upstream and adapter else "-"
        print(f"{name:28} {figures['episodes_per_s_concurrency_1']:>10} {figures['episodes_per_s_concurrency_4']:>10} "
              f"{slower:>9.2f} {str(upstream or '-') + ' ms':>13} {str(adapter or '-') + ' ms':>12} {ratio:>6}")
    reference = baseline["episodes_per_s_concurrency_4"]
    goals = {"lightning-verl": "#22: >= 11 eps/s (10x the 1.1 at filing)",
             "verifiers": "#22: >= 11 eps/s (3x the 3.7 at filing)"}
    record("environments", [figure(f"{name} episodes/s at concurrency 4", figures["episodes_per_s_concurrency_4"],
                                   "/s", "reference loop on the host", reference, note=goals.get(name, ""))
                            for name, figures in rows.items() if name in all_stacks()])
    summary = {name: {k: v for k, v in figures.items() if k != "step_latency_s"} for name, figures in rows.items()}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
