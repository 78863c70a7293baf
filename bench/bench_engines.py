"""Engine overhead: the trl probe stage (imports torch and the adapter, reports the environment) run
by the local engine and in a container (docker engine), `repeat` times each, medians and the ratio
docker / local measured in the same run. The container figure includes create, start, wait, log
collection and removal.

Needs root and Debian's docker.io + debootstrap: it starts its own dockerd (tests/container_daemons.py)
and reuses the trl image and environment from the cache (built on first use)."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from results import figure, record

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "qualification" / "plans" / "calc-tool-cpu.yaml"
sys.path.insert(0, str(ROOT / "tests"))


def main(repeat: int = 5) -> None:
    from container_daemons import docker_daemon, missing
    from runner_contracts import StageRequest, write_record

    from runner._engines.container import ContainerEngine
    from runner.api import LocalEngine, get_stack, load_plan, resolve_policy

    reason = missing("dockerd", "debootstrap")
    if reason:
        print(f"bench_engines: skipped ({reason})")
        return
    local = LocalEngine()
    plan = resolve_policy(load_plan(PLAN), local)
    manifest = get_stack("trl")
    with docker_daemon() as url, tempfile.TemporaryDirectory() as scratch:
        os.environ["DOCKER_HOST"] = url
        docker = ContainerEngine("docker")
        environments = {"local": (local, local.prepare(manifest)), "docker": (docker, docker.prepare(manifest))}
        run_dir = Path(scratch)
        run_dir.chmod(0o755)  # the container's non-root user enters the run directory
        write_record(run_dir / "plan.json", plan)
        times: dict[str, list[float]] = {name: [] for name in environments}
        for index in range(repeat):
            for name, (engine, env) in environments.items():
                out = run_dir / f"{name}-{index}"
                request = StageRequest(run_id="bench", stack="trl", stage="probe", plan=plan, out_dir=str(out),
                                       policy_dir=plan.policy.path)
                started = time.perf_counter()
                outcome = engine.run(env, request, timeout_s=300)
                times[name].append(time.perf_counter() - started)
                assert outcome.ok, f"{name} probe failed: {outcome.stderr.read_text()[-1000:]}"
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"probe stage, median of {repeat}: local {medians['local']:.2f} s, docker {medians['docker']:.2f} s; "
          f"docker / local = {medians['docker'] / medians['local']:.2f}x "
          f"(container overhead {medians['docker'] - medians['local']:+.2f} s per job)")
    record("engines", [figure("trl probe job in docker", medians["docker"], "s", "local engine", medians["local"])])


if __name__ == "__main__":
    main()
