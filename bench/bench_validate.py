"""Validation + audit throughput against a bare JSON parse of the same file, in the same run.

Generates a large trajectories.jsonl / training.jsonl pair, then measures (each in a fresh process, for
a clean peak-RSS reading, imports before the clock starts): orjson.loads per line (the baseline: a bare
parse that builds dicts), json.loads per line, msgspec's typed decode of each line into the contract's
records (validate's floor: the schema check alone), `runner validate`'s validate_file (schema +
consistency) and the host trace audit, whose peak memory is also measured on a file a quarter the size
(it must not grow). Prints MB/s, records/s, peak memory and speed against the baseline. Builds its files
from the contracts alone (no test code), so `make bench` needs only `.[bench]`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import figure, record

MODES = ("orjson", "json", "typed-decode", "validate", "audit")


def generate(folder: Path, episodes: int) -> tuple[Path, Path]:
    """Groups of 4 single-turn episodes, ~40 prompt and ~60 policy tokens each, and one training row each."""
    from runner_contracts import JsonlWriter, Segment, TrainingRow, Trajectory

    folder.mkdir(exist_ok=True)
    trajectories, training = folder / "trajectories.jsonl", folder / "training.jsonl"
    prompt = list(range(1, 41))
    with JsonlWriter(trajectories) as tw, JsonlWriter(training) as rw:
        for index in range(episodes):
            group, sample = divmod(index, 4)
            episode_id, reward = f"rollout/s1/g{group}/{sample}", float(sample % 2)
            policy = [(index + k) % 600 for k in range(60)]
            logprobs = [-0.01 * (k % 7) for k in range(60)]
            tw.write(Trajectory(
                run_id="run", stack="trl", stage="rollout", step=1, episode_id=episode_id, task_id=f"t{group}",
                group_id=f"rollout/s1/g{group}", sample_index=sample, policy_revision="a" * 64,
                segments=[Segment(source="prompt", token_ids=prompt, text="p" * 120),
                          Segment(source="policy", token_ids=policy, logprobs=logprobs, text="c" * 150)],
                reward=reward, outcome="success" if reward else "failure", finish_reason="stop", turns=1))
            rw.write(TrainingRow(step=1, row_id=f"rollout/s1/r{index}", episode_ids=[episode_id],
                                 input_ids=prompt + policy, loss_mask=[0] * 40 + [1] * 60,
                                 advantage=0.5 if reward else -0.5, old_logprobs=[0.0] * 40 + logprobs))
    return trajectories, training


def generate_large(path: Path, gigabytes: float) -> int:
    """A trajectories.jsonl of about `gigabytes` GB: one episode's line repeated with a fresh episode id."""
    import msgspec
    from runner_contracts import Segment, Trajectory

    line = msgspec.json.encode(Trajectory(
        run_id="run", stack="trl", stage="rollout", step=1, episode_id="@@", task_id="t", group_id="rollout/s1/g",
        sample_index=0, policy_revision="a" * 64,
        segments=[Segment(source="prompt", token_ids=list(range(1, 41)), text="p" * 120),
                  Segment(source="policy", token_ids=list(range(100, 160)), logprobs=[-0.01 * (k % 7) for k in range(60)],
                          text="c" * 150)], reward=1.0, outcome="success", finish_reason="stop", turns=1)) + b"\n"
    head, tail = line.split(b"@@")
    count = int(gigabytes * 1e9 / len(line))
    with open(path, "wb", buffering=1 << 24) as handle:
        for index in range(count):
            handle.write(head + b"rollout/s1/e%d" % index + tail)
    return count


def measure(mode: str, trajectories: Path, training: Path) -> dict:
    import msgspec
    import orjson
    from qualification.gates import TraceAudit
    from runner_contracts import Trajectory

    from runner import _validate
    from runner.api import validate_file

    if mode == "audit":
        import numpy  # noqa: F401  (the audit's mismatch panel imports it on first use: an import, not audit time)
    started = time.perf_counter()
    records = 0
    if mode in ("orjson", "json"):
        loads = orjson.loads if mode == "orjson" else json.loads
        with open(trajectories, "rb") as handle:
            for line in handle:
                loads(line)
                records += 1
    elif mode == "typed-decode":
        decoder = msgspec.json.Decoder(Trajectory)
        with open(trajectories, "rb") as handle:
            for line in handle:
                decoder.decode(line)
                records += 1
    elif mode == "validate":
        report = validate_file(trajectories)
        assert report.ok, report.errors[:3]
        records = report.records
    else:
        audit = TraceAudit(vocab_size=1000, group_size=4, tolerance=1e-3)
        audit.add_files(trajectories, training)
        gates = audit.gates()
        assert all(g.passed for g in gates), [g for g in gates if not g.passed]
        records = audit.counts["episodes"]
    seconds = time.perf_counter() - started
    # validate's and the audit's worker processes count too: each at most as large as the largest of them (an
    # upper bound, as pages a worker shares with its parent are counted twice)
    if mode == "validate" and trajectories.stat().st_size >= _validate.PARALLEL_FROM_BYTES:
        workers = _validate._workers()
    else:
        workers = audit.processes if mode == "audit" else 0
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 if workers else 0.0
    return {"mode": mode, "seconds": seconds, "records": records, "workers": workers,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 + workers * children}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--episodes", type=int, default=40000)
    parser.add_argument("--gigabytes", type=float, default=0.0,
                        help="also validate a generated trajectories file this large (needs the disk space twice over)")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "TRAJ", "TRAIN"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], Path(args.child[1]), Path(args.child[2]))))
        return
    if args.gigabytes:
        scale(args.gigabytes)
    def fastest(mode: str, trajectories: Path, training: Path) -> dict:
        """The fastest of three fresh processes: the others lost the CPU to something else."""
        runs = [json.loads(subprocess.run([sys.executable, __file__, "--child", mode, str(trajectories), str(training)],
                                          capture_output=True, text=True, check=True).stdout) for _ in range(3)]
        return min(runs, key=lambda r: r["seconds"])

    with tempfile.TemporaryDirectory() as tmp:
        quarter = generate(Path(tmp) / "quarter", args.episodes // 4)
        trajectories, training = generate(Path(tmp), args.episodes)
        size_mb = trajectories.stat().st_size / 1e6
        both_mb = size_mb + training.stat().st_size / 1e6
        results = {mode: fastest(mode, trajectories, training) for mode in MODES}
        audit_quarter = fastest("audit", *quarter)
    base = results["orjson"]
    print(f"trajectories.jsonl: {args.episodes} episodes, {size_mb:.1f} MB")
    print(f"{'mode':<14}{'MB/s':>9}{'records/s':>12}{'peak MB':>9}{'speed vs orjson':>17}")
    for mode, r in results.items():
        print(f"{mode:<14}{size_mb / r['seconds']:>9.1f}{r['records'] / r['seconds']:>12.0f}{r['peak_rss_mb']:>9.0f}"
              f"{base['seconds'] / r['seconds']:>16.2f}x")
    print(f"(audit reads training.jsonl too: {both_mb:.1f} MB in all, {both_mb / results['audit']['seconds']:.1f} MB/s; "
          f"at {args.episodes // 4} episodes its peak was {audit_quarter['peak_rss_mb']:.0f} MB)")
    speed = {mode: size_mb / r["seconds"] for mode, r in results.items()}
    record("validate", [
        figure("validate speed", speed["validate"], "MB/s", "orjson.loads per line", speed["orjson"], goal=">= 1.0"),
        figure("typed decode alone (validate's floor)", speed["typed-decode"], "MB/s", "orjson.loads per line",
               speed["orjson"]),
        figure("audit speed (the two files it reads)", both_mb / results["audit"]["seconds"], "MB/s", "validate",
               speed["validate"], goal=">= 0.5"),
        figure(f"audit peak memory at {args.episodes} episodes", results["audit"]["peak_rss_mb"], "MB",
               f"audit at {args.episodes // 4} episodes", audit_quarter["peak_rss_mb"], goal="<= 1.1",
               note="flat in file size: parts of the files on worker processes, each holding its own part"),
    ])



def scale(gigabytes: float, budget_mb: float = 256.0) -> None:
    """Validates a generated file of `gigabytes` GB in a fresh process; its peak memory against the budget."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("RUNNER_BENCH_TMP")) as tmp:
        path = Path(tmp) / "trajectories.jsonl"
        episodes = generate_large(path, gigabytes)
        result = json.loads(subprocess.run([sys.executable, __file__, "--child", "validate", str(path), str(path)],
                                           capture_output=True, text=True, check=True).stdout)
    print(f"validate of {gigabytes:g} GB ({episodes} episodes): {gigabytes * 1e3 / result['seconds']:.0f} MB/s, "
          f"peak {result['peak_rss_mb']:.0f} MB with {result['workers']} worker processes")
    record("validate_scale", [figure(f"validate peak memory, {gigabytes:g} GB trajectories", result["peak_rss_mb"], "MB",
                                     "budget", budget_mb, goal="<= 1.0",
                                     note=f"{episodes} episodes; parent + {result['workers']} workers x the largest")])


if __name__ == "__main__":
    main()
