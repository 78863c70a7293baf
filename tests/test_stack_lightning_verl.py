"""The lightning-verl stack (agentlightning==1.0.2, verl==0.9.1 pinned, no torch) in its own Python 3.12
environment: an unmodified OpenAI-SDK team harness behind agl-server's gateway, which captures every model
call's token ids and logprobs in its store.

Slow: the first run builds the environment (~2 min; cached under RUNNER_CACHE_DIR afterwards). The last test
also needs the trl environment and the cached tiny calc policy (built on first use, several minutes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
from collections import Counter
from pathlib import Path

import msgspec
import pytest
from runner_contracts import CapturedCall, EpisodeSpec
from runner_kit.continuity import chain_calls
from runner_kit.scripted_policy import ScriptedPolicyServer
from stack_checks import (
    PLAN,
    ROOT,
    SAMPLING,
    assert_crash_mid_batch_loses_nothing,
    assert_only_its_own_upstream,
    assert_service_stage,
    drive_episodes,
    installed_packages,
    scripted_episodes,
)

from runner.api import LocalEngine, get_stack, load_plan

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env():
    return LocalEngine().prepare(get_stack("lightning-verl"))


def test_environment_has_agentlightning_and_verl_and_no_other_stack(env):
    assert_only_its_own_upstream(env)  # verl is this stack's own pin, torch is absent
    assert installed_packages(env)["verl"] == "0.9.1"


BACKEND = "runner_stack_lightning_verl.backend:LightningBackend"


def test_service_stage_through_the_engine(env, tmp_path):
    assert_service_stage(env, tmp_path, timeout_s=180)


def test_scripted_episodes_score_as_the_reference_through_a_crash(env, tmp_path):
    # 21 scripted episodes, 4 at a time; agl-server and the running harnesses are SIGKILLed when the 6th starts.
    results = assert_crash_mid_batch_loses_nothing(env, tmp_path, channel="path")
    # The scripted policy returns no token ids: nothing captured, the trainer would use the server's log.
    assert all(r["captured_calls"] is None for r in results)


POLICY_SERVER = r"""
import json, sys
from pathlib import Path
import msgspec
from transformers import AutoModelForCausalLM, AutoTokenizer
from runner_contracts import SamplingSpec
from runner_kit.policy_server import PolicyServer

args = json.loads(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(args["policy_dir"])
model = AutoModelForCausalLM.from_pretrained(args["policy_dir"])
server = PolicyServer(model, tokenizer, sampling=msgspec.convert(args["sampling"], SamplingSpec),
                      calls_path=Path(args["calls_path"]), revision="test").start()
print(server.base_url, flush=True)
sys.stdin.read()
server.close()
"""


@contextlib.contextmanager
def trl_policy_server(calls_path: Path):
    """The trl stack's PolicyServer on the cached tiny calc policy, in the trl environment; yields its URL."""
    from runner.api import build_tiny

    engine = LocalEngine()
    plan = load_plan(PLAN)
    policy_dir = build_tiny(engine, dict(plan.policy.tiny or {}), plan)
    trl = engine.prepare(get_stack("trl"))
    server = subprocess.Popen(
        [str(trl.python), "-c", POLICY_SERVER, json.dumps({
            "policy_dir": str(policy_dir), "calls_path": str(calls_path), "sampling": msgspec.to_builtins(SAMPLING)})],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        base_url = server.stdout.readline().strip()
        assert base_url.startswith("http://127.0.0.1:"), base_url
        yield base_url
    finally:
        server.stdin.close()
        server.wait(timeout=60)


def test_gateway_capture_equals_the_policy_servers_log(env, tmp_path):
    """The trl stack's real PolicyServer (tiny calc policy, trl env) behind the gateway: every episode's
    captured prompt ids, sampled ids and logprobs equal what the server logged, and chain into one row."""
    from qualification.tasks import get_family

    plan = load_plan(PLAN)
    calls_path = tmp_path / "calls.jsonl"
    with trl_policy_server(calls_path) as base_url:
        family = get_family("calc-tool")
        episodes = [EpisodeSpec(episode_id=f"real/{index}", task_id=item.task_id, family=family.name,
                                item=item.to_json(), seed=0, max_turns=plan.budget.max_turns)
                    for index, item in enumerate(family.generate("train", 4, 7))]
        results = drive_episodes(env, BACKEND, base_url, episodes, model="policy")
    served = [json.loads(line) for line in Path(calls_path).read_text().splitlines()]
    assert {c["channel"] for c in served} == {"path"} and all(c["episode_id"] for c in served)
    assert [r["episode_id"] for r in results] == [e.episode_id for e in episodes]
    for result in results:
        assert result["status"] == "completed", result
        captured = [msgspec.convert(c, CapturedCall) for c in result["captured_calls"]]
        logged = [c for c in served if c["episode_id"] == result["episode_id"]]
        assert len(captured) == len(logged) == result["turns"] >= 1
        assert [(c.prompt_ids, c.completion_ids, c.logprobs) for c in captured] == \
               [(c["prompt_ids"], c["completion_ids"], c["logprobs"]) for c in logged]
        row = chain_calls(captured)
        assert row is not None and row.breaks == 0 and row.calls_used == len(captured), row


OPENAI_PROGRAM = r"""
import json, os, threading
from openai.types.chat import ChatCompletion, ChatCompletionChunk

if __name__ == "__main__":
    print(json.dumps({"ppid": os.getppid(), "threads": threading.active_count(),
                      "built": [model.__pydantic_complete__ for model in (ChatCompletion, ChatCompletionChunk)],
                      "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd"))}))
"""

PREFORK_DRIVER = r"""
import json, subprocess, sys, time
from pathlib import Path
from runner_kit.prefork import OPENAI_MODULES, start_prefork

folder, script = Path(sys.argv[1]), Path(sys.argv[2])
server, launcher, _ = start_prefork(folder, script, OPENAI_MODULES)
deadline = time.monotonic() + 60
while True:  # until the fork server answers (the launcher starts the program plainly before that)
    said = json.loads(subprocess.run([str(launcher), str(script)], capture_output=True, text=True, check=True).stdout)
    if said["ppid"] == server.pid or time.monotonic() > deadline:
        break
    time.sleep(0.2)
server.kill()
server.wait()
print(json.dumps({**said, "server": said["ppid"] == server.pid}))
"""


def test_the_fork_server_warms_the_openai_sdk_for_the_programs_it_forks(env, tmp_path):
    """The fork server makes chat-completion calls through the OpenAI SDK against a throwaway server before it
    forks: a forked program finds the SDK's response models built (a plain start builds them on first use),
    and neither that server's thread nor its socket."""
    script = tmp_path / "program.py"
    script.write_text(OPENAI_PROGRAM)
    plain = json.loads(subprocess.run([str(env.python), str(script)], capture_output=True, text=True,
                                      check=True).stdout)
    assert plain["built"] == [False, False]
    forked = subprocess.run([str(env.python), "-c", PREFORK_DRIVER, str(tmp_path / "prefork"), str(script)],
                            capture_output=True, text=True, timeout=120)
    assert forked.returncode == 0, forked.stderr[-2000:]
    said = json.loads(forked.stdout)
    assert said["server"], "the fork server never answered"
    assert said["built"] == [True, True]
    assert said["threads"] == 1
    assert said["fds"] == plain["fds"]  # stdio and the listing's own descriptor


KEEP_ALIVE = r"""
import json, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from runner_stack_lightning_verl.backend import Gateway

ports = []


class ClosesWhenAsked(BaseHTTPRequestHandler):
    # Answers HTTP/1.1 without "Connection: close" and then closes on /close, as a server closes an idle
    # keep-alive connection: the client learns it only on its next request.
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        ports.append(self.client_address[1])
        body = json.dumps({"answered": len(ports)}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = self.path == "/close"

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), ClosesWhenAsked)
threading.Thread(target=server.serve_forever, daemon=True).start()
gateway = Gateway()
gateway.port = server.server_address[1]
said = [gateway.api("GET", path)["answered"] for path in ("/keep", "/keep", "/close", "/keep", "/keep")]
print(json.dumps({"said": said, "ports": ports}))
"""


def test_store_calls_share_a_connection_and_survive_the_server_closing_it(env):
    """The adapter's store calls (six an episode) reuse one keep-alive connection per thread; when the server
    has closed it, the next call goes once more on a new connection, and nothing is sent twice."""
    run = subprocess.run([str(env.python), "-c", KEEP_ALIVE], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["said"] == [1, 2, 3, 4, 5]
    first, second = out["ports"][0], out["ports"][3]
    assert out["ports"] == [first, first, first, second, second] and first != second


HARNESS_KILL = r"""
import json, sys, threading, time
import msgspec
from runner_kit.rollout import BatchRunner
from runner_contracts import EpisodeSpec, RolloutRequest, SamplingSpec
from runner_stack_lightning_verl.backend import LightningBackend

args = json.loads(sys.stdin.read())
backend = LightningBackend()
backend.start()
killed = []

def kill_when_busy():
    # SIGKILL only the team harnesses (agl-server stays up), once two episodes are mid-harness, until two
    # harnesses were killed while running (a harness against the scripted policy lasts milliseconds).
    while sum(killed) < 2:
        if killed or len(backend.running_harnesses()) >= 2:
            killed.append(backend.kill_harnesses())
        time.sleep(0.005)

try:
    threading.Thread(target=kill_when_busy, daemon=True).start()
    request = RolloutRequest(episodes=[msgspec.convert(e, EpisodeSpec) for e in args["episodes"]],
                             policy_base_url=args["base_url"], policy_model=args["model"],
                             sampling=msgspec.convert(args["sampling"], SamplingSpec), concurrency=4, max_attempts=3)
    response = BatchRunner(backend).run(request)
    marked = backend.gateway.api("GET", "/api/rollouts?state_in=failed")
finally:
    backend.stop()
print(json.dumps({"response": msgspec.to_builtins(response), "killed": killed, "marked": marked}))
"""


def test_harness_killed_mid_episode_is_marked_failed_in_the_store_and_retried(env):
    from stack_checks import reference

    episodes, cases = scripted_episodes(["business-comm", "calc-tool"])
    with ScriptedPolicyServer({e: c[2]["turns"] for e, c in cases.items()}) as policy:
        args = {"base_url": policy.base_url, "model": policy.model, "sampling": msgspec.to_builtins(SAMPLING),
                "episodes": [msgspec.to_builtins(e) for e in episodes]}
        run = subprocess.run([str(env.python), "-c", HARNESS_KILL], input=json.dumps(args), capture_output=True,
                             text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    results = out["response"]["results"]
    assert sum(out["killed"]) >= 2
    assert [r["episode_id"] for r in results] == [e.episode_id for e in episodes]
    retried = {r["episode_id"] for r in results if r["attempts"] > 1}
    assert len(retried) >= 2
    for result in results:
        assert result["status"] == "completed", result
        family, item, case = cases[result["episode_id"]]
        assert result["reward"] == reference(family, item, result).reward
    # Each abandoned attempt stays in agl-server's store as a failed rollout naming its episode.
    marked = out["marked"]
    assert {m["metadata"]["episode_id"] for m in marked} == retried
    assert all(m["status"]["error_message"] == "team harness killed by signal 9" for m in marked)


STORE_WORKER = r"""
import json, sys, time, threading, uuid
import numpy as np
from agentlightning.hooks import RolloutHooks
from agentlightning.verl.agl_rollout_manager import AglRolloutManager
from runner_stack_lightning_verl.backend import LightningBackend
from runner_stack_lightning_verl.store_worker import StoreWorker

args = json.loads(sys.stdin.read())


class NameEpisodes(RolloutHooks):
    # The trl policy server that stands in for verl's vLLM servers attributes every call to an episode
    # (vLLM needs no such name: verl's own rollouts are enqueued without one).
    def on_enqueue(self, request):
        return request.model_copy(update={"metadata": {"episode_id": f"verl/{uuid.uuid4().hex}"}})


def kill_when_two_run(backend):
    # Until two harnesses were killed while running (against the scripted policy they last milliseconds).
    killed = 0
    while killed < 2:
        if killed or len(backend.running_harnesses()) >= 2:
            killed += backend.kill_harnesses()
        time.sleep(0.005)


backend = LightningBackend()
backend.gateway.model, backend.gateway.temperature = args["model"], 1.0
backend.start()
worker = StoreWorker(backend, model=args["model"], max_turns=args["max_turns"], poll_s=0.1).start()
out = {}
try:
    for phase in ("plain", "harness-killed"):
        manager = AglRolloutManager(agl_base_url=backend.gateway.url, agl_key=backend.gateway.key,
                                    model=args["model"], step=1, train_rollout_n=args["n"], hooks=NameEpisodes(),
                                    poll_interval_seconds=0.1)
        manager.delete_model()
        manager.register_model([args["base_url"]])
        data = {key: np.array([row[key] for row in args["rows"]], dtype=object) for key in ("item", "task_id", "family")}
        if phase == "harness-killed":
            threading.Thread(target=kill_when_two_run, args=(backend,), daemon=True).start()
        completed = manager.enqueue_and_wait_until_completed(data, is_train=True)
        out[phase] = [c.model_dump(mode="json") for c in completed]
    # A rollout whose input is not a task row: failed with the reason, the worker keeps going.
    backend.gateway.api("POST", "/api/rollouts", [{"rollout_id": "not-a-task", "input": {"prompt": "hi"}}])
    for _ in range(100):
        state = backend.gateway.api("GET", "/api/rollouts/not-a-task")
        state = state.get("rollout", state)["status"]
        if state["state"] in ("succeeded", "failed"):
            break
        time.sleep(0.1)
    out["not-a-task"] = state
finally:
    worker.stop()
    backend.stop()
out["counts"] = vars(worker.counts)
print(json.dumps(out))
"""


def test_store_worker_runs_the_rollouts_verls_manager_enqueues(env, tmp_path):
    """The GPU path's rollout half with upstream's own AglRolloutManager (what verl's trainer calls each step):
    it registers the policy endpoint and enqueues G samples per task row; the StoreWorker runs each with the
    team harness and posts the reference score; the manager reads back the gateway's captured calls. The trl
    policy server stands in for verl's vLLM servers (no vLLM or GPU here). Then a second batch whose running
    harnesses are SIGKILLed: those rollouts come back failed with the reason, none is lost."""
    import importlib.util

    from qualification.tasks import get_family

    plan = load_plan(PLAN)
    calls_path = tmp_path / "calls.jsonl"
    family = get_family("calc-tool")
    rows = [{"item": item.to_json(), "task_id": item.task_id, "family": family.name}
            for item in family.generate("train", 3, 11)]
    with trl_policy_server(calls_path) as base_url:
        run = subprocess.run([str(env.python), "-c", STORE_WORKER], input=json.dumps({
            "base_url": base_url, "model": "policy", "n": 2, "max_turns": plan.budget.max_turns, "rows": rows}),
            capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    served = [json.loads(line) for line in calls_path.read_text().splitlines()]

    plain = out["plain"]
    assert len(plain) == 6 and {r["rollout_state"] for r in plain} == {"succeeded"}
    assert sorted(Counter(r["data_id"] for r in plain).values()) == [2, 2, 2]  # G = 2 per task row
    for rollout in plain:
        reward = [e["data"] for e in rollout["events"] if e["event_type"] == "reward"][-1]
        assert reward["source"] == "reference-scorer" and rollout["final_reward"] == reward["value"]
        logged = [c for c in served if c["episode_id"] == rollout["metadata"]["episode_id"]]
        captured = [(t["prompt"]["token_ids"], t["response"]["token_ids"], t["response"]["log_probs"])
                    for t in rollout["triplets"]]
        assert captured == [(c["prompt_ids"], c["completion_ids"], c["logprobs"]) for c in logged]
        assert len(captured) == reward["turns"] >= 1

    spec = importlib.util.spec_from_file_location(
        "verl_evidence", ROOT / "stacks/lightning-verl/adapter/src/runner_stack_lightning_verl/verl_evidence.py")
    evidence = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evidence)
    trajectories = evidence.trajectories_of(plain, run_id="run", stack="lightning-verl", stage="update", step=1,
                                            revision="rev0")
    for trajectory, rollout in zip(trajectories, plain, strict=True):
        logged = [c for c in served if c["episode_id"] == rollout["metadata"]["episode_id"]]
        policy = [t for s in trajectory.segments if s.source == "policy" for t in s.token_ids]
        assert policy == [t for c in logged for t in c["completion_ids"]]

    killed = out["harness-killed"]
    assert len(killed) == 6  # every enqueued rollout came back
    failed = [r for r in killed if r["rollout_state"] == "failed"]
    assert len(failed) >= 2 and all(r["error_message"] == "team harness killed by signal 9" for r in failed)
    marked = evidence.trajectories_of(killed, run_id="run", stack="lightning-verl", stage="update", step=2,
                                      revision="rev1")
    assert sum(t.outcome == "error" for t in marked) == len(failed)
    counts = out["counts"]
    assert out["not-a-task"]["state"] == "failed" and "lacks ['family', 'item']" in out["not-a-task"]["error_message"]
    assert counts["claimed"] == 13 and counts["failed"] == len(failed) + 1 and counts["succeeded"] == 12 - len(failed)


def test_gpu_plan_routes_training_jobs_to_the_stacks_gpu_environment(env, tmp_path):
    """On a GPU plan the arm probes its GPU environment and runs update/train as its own job (verl), not as
    a trl trainer job against the rollout service. This machine has no GPU and the GPU environment's lock
    (torch + vLLM, ~10 GB) is not installed here, so the CPU environment stands in for it: the probe's gpu:
    gates name the difference, and the update job fails saying what verl lacks. Nothing is faked below the
    engine: real environments, real adapter jobs."""
    from runner_contracts import StageRequest, read_record

    from runner._stages import Arm, run_stage
    from runner.api import resolve_policy

    engine = LocalEngine()
    manifest = get_stack("lightning-verl")
    plan = load_plan(PLAN)
    plan = resolve_policy(msgspec.structs.replace(plan, budget=msgspec.structs.replace(plan.budget, gpus=1)), engine)
    stand_in = dataclasses.replace(env, manifest=manifest.for_gpu())  # the CPU environment, as the GPU one
    arm = Arm(manifest=manifest, engine=engine, env=engine.prepare(get_stack("trl")), plan=plan,
              run_dir=tmp_path / "run", service_env=env, gpu_env=stand_in)
    assert arm.trains_on_gpu("update") and arm.trains_on_gpu("train") and not arm.trains_on_gpu("rollout")
    try:
        probe = run_stage(arm, "probe")
        update = run_stage(arm, "update")
    finally:
        arm.close()
    gates = {g.name: g for g in probe.gates}
    assert gates["probe:lock-match"].passed and gates["trainer:lock-match"].passed  # the CPU arm as before
    assert not gates["gpu:lock-match"].passed and "torch" in gates["gpu:lock-match"].detail
    assert not gates["gpu:pins"].passed and "was built from lock" in gates["gpu:pins"].detail
    assert probe.metrics["gpu_environment"]["lock_sha256"] == env.lock_sha256
    assert update.status == "error" and update.error.kind == "GpuUnavailable"
    assert "lacks torch, vllm" in update.error.message and "requirements-gpu.lock" in update.error.message
    request = read_record(tmp_path / "run" / "stages" / "update" / "request.json", StageRequest)
    assert request.plan.budget.gpus == 1 and "rollout_service" not in request.options  # its own job
