"""Per-step latency of the openenv stack: our TaskEnvClient vs upstream's GenericEnvClient vs a bare WebSocket,
all against the same OpenEnv server (create_app + uvicorn on 127.0.0.1), plus whole scripted episodes through
OpenEnvBackend.run_episode. Run with the stack environment's python:

    <env>/bin/python stacks/openenv/bench_step_latency.py [--steps 2000] [--episodes 200]

Prints one JSON object (milliseconds; p50/p90/mean per tool step, a calc-tool `rechner` call).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": round(1e3 * ordered[len(ordered) // 2], 3), "p90_ms": round(1e3 * ordered[int(len(ordered) * 0.9)], 3),
            "mean_ms": round(1e3 * statistics.fmean(ordered), 3), "n": len(ordered)}


def timed(step, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        began = time.perf_counter()
        step()
        samples.append(time.perf_counter() - began)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--episodes", type=int, default=200)
    args = parser.parse_args()

    from openenv.core.generic_client import GenericEnvClient
    from qualification.rollout import PolicyEndpoint
    from qualification.scripted_policy import ScriptedPolicyServer
    from qualification.tasks import get_family
    from runner_contracts import EpisodeSpec, SamplingSpec
    from websockets.sync.client import connect

    from runner_stack_openenv.backend import OpenEnvBackend
    from runner_stack_openenv.client import TaskEnvClient
    from runner_stack_openenv.models import TaskAction

    family = get_family("calc-tool")
    item = family.generate("train", 1, 1)[0]
    arguments = {"ausdruck": item.reference["expression"]}
    backend = OpenEnvBackend()
    began = time.perf_counter()
    backend.start()
    out: dict[str, object] = {"server_start_s": round(time.perf_counter() - began, 3)}
    url = backend.server.url
    try:
        # Tool steps never end the episode, so one session serves all samples; warm up first.
        with connect(url.replace("http", "ws") + "/ws") as ws:
            ws.send(json.dumps({"type": "reset", "data": {"item": item.to_json(), "episode_id": "raw"}}))
            ws.recv()
            message = json.dumps({"type": "step", "data": {"kind": "tool", "name": "rechner", "arguments": arguments}})

            def raw_step() -> None:
                ws.send(message)
                ws.recv()

            timed(raw_step, 50)
            out["bare_websocket_step"] = summary(timed(raw_step, args.steps))

        with GenericEnvClient(base_url=url).sync() as generic:
            generic.reset(item=item.to_json(), episode_id="generic")
            action = {"kind": "tool", "name": "rechner", "arguments": arguments}
            timed(lambda: generic.step(action), 50)
            out["upstream_generic_envclient_step"] = summary(timed(lambda: generic.step(action), args.steps))

        with TaskEnvClient(base_url=url).sync() as ours:
            ours.reset(item=item.to_json(), episode_id="ours")
            timed(lambda: ours.step(TaskAction(kind="tool", name="rechner", arguments=arguments)), 50)
            out["task_envclient_step"] = summary(timed(
                lambda: ours.step(TaskAction(kind="tool", name="rechner", arguments=arguments)), args.steps))

        # Whole episodes (connect, reset, 2 policy calls, 1 tool step, answer step, state, close).
        case = family.scripted_cases(item)[0]
        specs = [EpisodeSpec(episode_id=f"bench/{i}", task_id=item.task_id, family=family.name,
                             item=item.to_json(), seed=0, max_turns=4) for i in range(args.episodes)]
        with ScriptedPolicyServer({spec.episode_id: case["turns"] for spec in specs}) as policy:
            endpoint = PolicyEndpoint(base_url=policy.base_url, model=policy.model,
                                      sampling=SamplingSpec(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64,
                                                            seed=0))
            backend.run_episode(specs[0], endpoint)  # imports, first connection
            samples = []
            for spec in specs[1:]:
                began = time.perf_counter()
                result = backend.run_episode(spec, endpoint)
                samples.append(time.perf_counter() - began)
                assert result.success, result
            out["scripted_episode"] = summary(samples)
        began = time.perf_counter()
        backend.kill_environment()
        backend.restart_environment()
        out["kill_and_restart_s"] = round(time.perf_counter() - began, 3)
    finally:
        backend.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
