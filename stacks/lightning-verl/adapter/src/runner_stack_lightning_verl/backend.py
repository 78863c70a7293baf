"""The lightning-verl rollout backend: an unmodified team harness behind Agent Lightning's gateway.

Per episode (one Agent Lightning rollout per attempt, as its local controller runs them):
1. enqueue a rollout in agl-server's store (`POST /api/rollouts`, metadata.episode_id = the wire id) and
   mark it running with attempt "0";
2. run the team harness (`team_agent.py`, a separate program) as a process in its own session (a child of
   runner_kit.prefork's fork server, an interpreter that imported it and the OpenAI SDK once), whose
   only model setting is OPENAI_BASE_URL = the gateway's per-rollout proxy URL
   `/proxy/rollout/<rid>/attempt/0/mode/train/openai/v1`;
3. the gateway forwards every call to the policy at `<policy root>/episodes/<episode id>/v1` (see
   gateway.py), adding the vLLM fields `return_token_ids: true` and `logprobs: true`, and stores the call;
4. score the harness's transcript with the task family's reference scorer, post it as the rollout's
   `reward` event (with outcome, finish reason and turns) and mark the rollout succeeded (`run_rollout`,
   which the GPU path's store worker shares);
5. read the rollout's calls back from the store in Agent Lightning's training ("triplet") format:
   prompt_token_ids, response_token_ids, response_log_probs → EpisodeResult.captured_calls, call order,
   and drop the rollout from the in-memory store.

A harness killed by a signal, or a gateway that is down, raises EnvironmentDown (the scaffold restarts the
gateway and retries the episode as a new rollout); the abandoned rollout is marked failed in the store
when the store is still up.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from qualification.tasks import NativeFamily, Score, TaskItem, ToolCall, Transcript, get_family
from runner_contracts import CapturedCall, EpisodeResult, EpisodeSpec, NativeAsset, ToolCallRecord
from runner_kit.native import load_asset
from runner_kit.prefork import OPENAI_MODULES, ForkedProgram, Prefork, start_prefork, stop_prefork
from runner_kit.processes import ServerProcess, bind_loopback, spawn
from runner_kit.rollout import EnvironmentDown, PolicyEndpoint, RolloutBackend

TEAM_AGENT = Path(__file__).with_name("team_agent.py")  # run as a program, never imported here
NATIVE_HARNESS = Path(__file__).with_name("native_harness.py")  # runs a team's own module:function harness
# What the team harness imports and looks up before its first call. families(): get_family's entry-point
# lookup reads every installed distribution (~10 ms of CPU), which each forked harness would repeat.
HARNESS_WARM = [*OPENAI_MODULES, "qualification.tasks:families", "runner_kit.policy"]
ATTEMPT = "0"  # agentlightning.schemas.DEFAULT_ATTEMPT_ID: a retry is a new rollout, as agl-controller runs them


class StoreError(Exception):
    """agl-server answered with an HTTP error (it is up)."""


class Gateway(ServerProcess):
    """agl-server (gateway + in-memory store) as a subprocess on a 127.0.0.1 socket bound here."""

    name = "agl-server"
    health_path = "/healthz"

    def __init__(self, ready_timeout_s: float = 60.0):
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.key = secrets.token_hex(16)
        self.model = "policy"
        self.temperature = 1.0
        self.upstream: str | None = None  # the policy base URL registered as the model's endpoint
        self.starts = 0
        self._connections = threading.local()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        sock = bind_loopback()
        try:
            self.port = sock.getsockname()[1]
            self.process = spawn(
                [sys.executable, "-m", "runner_stack_lightning_verl.gateway", "--fd", str(sock.fileno()),
                 "--key", self.key, "--model", self.model, "--temperature", repr(float(self.temperature))],
                pass_fds=(sock.fileno(),), stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
                env={**os.environ, "HYDRA_FULL_ERROR": "1"})
        finally:
            sock.close()  # the child holds the only listening copy: once it dies, connections are refused
        self.starts += 1
        self.upstream = None
        self.wait_ready()

    def api(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> Any:
        """A call to agl-server's store API with the bearer key, on this thread's keep-alive connection (a new
        connection per call costs ~1 ms of CPU here and ~0.6 in agl-server, six calls an episode); HTTP errors
        raise StoreError, a dead or unreachable server raises EnvironmentDown."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}
        for _ in range(2):  # a second time only after a reused connection turned out closed
            conn, reused = self._connection(timeout)
            try:
                conn.request(method, path, body=data, headers=headers)
                response = conn.getresponse()
                raw = response.read()
            except (OSError, http.client.HTTPException) as error:  # refused, reset, or an answer cut short
                self._connections.conn = None
                conn.close()
                if reused and isinstance(error, (http.client.RemoteDisconnected, BrokenPipeError,
                                                 ConnectionResetError)):
                    continue  # the server had closed the idle connection: once more on a new one
                raise EnvironmentDown(f"agl-server {self.url} unreachable ({method} {path}): "
                                      f"{type(error).__name__}: {error}") from None
            if response.will_close:
                self._connections.conn = None
                conn.close()
            if response.status >= 400:
                raise StoreError(f"agl-server {method} {path}: {response.status} "
                                 f"{raw.decode(errors='replace')[:300]}")
            return json.loads(raw) if raw else None

    def _connection(self, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to the running server (a restarted server has a new port), and whether it
        was used before."""
        conn = getattr(self._connections, "conn", None)
        if conn is not None and conn.port == self.port:
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            return conn, True
        if conn is not None:
            conn.close()
        conn = self._connections.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        return conn, False


class LightningBackend(RolloutBackend):
    stack = "lightning-verl"
    upstream_name = "agentlightning"
    capabilities = ["multi-turn-tools", "stateful-tools", "concurrent-episodes", "environment-restart", "cpu",
                    "reward:reference-scorer", "token-capture:stack-gateway", "unmodified-harness",
                    "episode-id:path", "native-assets"]
    episode_id_channel = ("URL prefix /episodes/<id>/v1: agl-server's gateway forwards each rollout to the "
                          "registered policy endpoint under the rollout's episode id (metadata.episode_id)")

    def __init__(self, harness_timeout_s: float = 600.0, native: NativeAsset | None = None):
        self.native = native  # a team's own harness (module:function), run by native_harness.py
        self.gateway = Gateway()
        self.harness_timeout_s = harness_timeout_s
        self._lock = threading.Lock()  # the gateway process and its configuration
        self._harnesses: set[ForkedProgram] = set()
        self._harness_lock = threading.Lock()
        self._down = False  # killed (fault injection or crash) and not yet restarted
        # Per program (team_agent.py; native_harness.py with a native asset): its fork server.
        self._preforks: dict[Path, Prefork | None] = {}

    # --- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self.native is not None:
                check_native_harness(self.native.env)
            programs = {TEAM_AGENT: HARNESS_WARM}
            if self.native is not None:
                programs[NATIVE_HARNESS] = [*OPENAI_MODULES, self.native.env.partition(":")[0]]
            for program, warm in programs.items():
                if program not in self._preforks:
                    self._preforks[program] = start_prefork(Path(tempfile.mkdtemp(prefix="agl-harness-")), program,
                                                            warm)
            if not self.gateway.alive():
                self.gateway.start()
            self._down = False

    def environment_pids(self) -> list[int]:
        """agl-server (the harnesses running through it fail with it; they come and go per episode)."""
        with self._lock:
            return [self.gateway.process.pid] if self.gateway.alive() and self.gateway.process else []

    def kill_environment(self) -> None:
        """SIGKILLs agl-server and every running team harness (all started here)."""
        with self._lock:
            self._down = True
            self.gateway.kill()
        self.kill_harnesses()

    def restart_environment(self) -> None:
        with self._lock:
            if not (self.gateway.alive() and self.gateway.healthy()):
                self.gateway.kill()
                self.gateway.start()
            self._down = False

    def stop(self) -> None:
        self.kill_harnesses()
        with self._lock:
            self.gateway.stop()
            for prefork in self._preforks.values():
                if prefork is not None:
                    stop_prefork(prefork.process)
                    shutil.rmtree(prefork.launcher.parent.parent, ignore_errors=True)
            self._preforks.clear()

    def running_harnesses(self) -> list[ForkedProgram]:
        with self._harness_lock:
            return [p for p in self._harnesses if p.poll() is None]

    def kill_harnesses(self) -> int:
        """SIGKILLs the running team harnesses only (agl-server stays up), each with its session (anything it
        started); how many were still running."""
        running = self.running_harnesses()
        for process in running:
            process.kill()
        return len(running)

    def _gateway_for(self, policy: PolicyEndpoint) -> tuple[Gateway, int]:
        """The running gateway, configured for this policy, and its start count: model name and temperature
        are agl-server startup config (a change restarts it); the policy URL is a registered model endpoint
        (POST /api/models)."""
        with self._lock:
            gateway = self.gateway
            if self._down or not gateway.alive():
                raise EnvironmentDown(f"agl-server {gateway.url} is not running")
            temperature = float(policy.sampling.temperature)
            if (gateway.model, gateway.temperature) != (policy.model, temperature):
                gateway.stop()
                gateway.model, gateway.temperature = policy.model, temperature
                gateway.start()
            if gateway.upstream != policy.base_url:
                gateway.api("DELETE", "/api/models")
                gateway.api("POST", "/api/models", [{"model": policy.model, "endpoint": policy.base_url}])
                gateway.upstream = policy.base_url
            return gateway, gateway.starts

    def _lost(self, gateway: Gateway, generation: int) -> bool:
        """Whether the agl-server an episode started on died or was replaced (its store is gone)."""
        with self._lock:
            if self._down or gateway.starts != generation or not gateway.alive():
                return True
        # A server SIGKILLed a moment ago has closed its sockets but may not be reaped yet: ask it.
        return not gateway.healthy()

    # --- one episode -------------------------------------------------------------------------------------

    def run_episode(self, episode: EpisodeSpec, policy: PolicyEndpoint) -> EpisodeResult:
        started = time.monotonic()
        gateway, generation = self._gateway_for(policy)
        try:
            return self._episode(gateway, episode, policy, started)
        except EnvironmentDown:
            raise
        except Exception as error:
            if self._lost(gateway, generation):  # e.g. the harness lost its connection, the store its rollout
                raise EnvironmentDown(f"agl-server died or restarted during the episode: "
                                      f"{type(error).__name__}: {str(error)[:300]}") from error
            raise

    def _episode(self, gateway: Gateway, episode: EpisodeSpec, policy: PolicyEndpoint, started: float) -> EpisodeResult:
        rollout_id = uuid.uuid4().hex  # the episode id goes in metadata: it may hold "/" (a path segment here)
        gateway.api("POST", "/api/rollouts", [{
            "rollout_id": rollout_id, "input": {"data_id": episode.task_id, "family": episode.family},
            "is_train": True, "metadata": {"episode_id": episode.episode_id, "task_id": episode.task_id}}])
        task = {"family": episode.family, "item": episode.item, "max_turns": episode.max_turns}
        transcript, score = self.run_rollout(gateway, rollout_id, task, policy.model)
        events = gateway.api("GET", f"/api/rollouts/{rollout_id}/events?event_type=model_request&format=triplet")
        if transcript["turns"] is None:  # a team's own harness: its calls are what the gateway saw
            transcript["turns"] = len(events)
        captured = _captured_calls(events, transcript["turns"])
        gateway.api("DELETE", f"/api/rollouts/{rollout_id}")  # read out: keep the in-memory store small
        finish = transcript["finish_reason"]
        return EpisodeResult(
            episode_id=episode.episode_id, task_id=episode.task_id, status="completed", reward=score.reward,
            reward_components=dict(score.components), success=score.success, outcome=outcome_of(score, finish),
            finish_reason=finish, turns=transcript["turns"], final_text=transcript["final_text"],
            tool_calls=[ToolCallRecord(name=c["name"], arguments=c["arguments"], result=c["result"])
                        for c in transcript["tool_calls"]],
            seconds=round(time.monotonic() - started, 3), captured_calls=captured)

    def run_rollout(self, gateway: Gateway, rollout_id: str, task: dict[str, Any],
                    model: str) -> tuple[dict[str, Any], Score]:
        """One attempt at a rollout already in the store: marks it running, runs the team harness against
        the gateway's proxy URL for it, scores the transcript with the family's reference scorer, posts the
        score as the rollout's `reward` event and marks it succeeded. A failure marks it failed (with the
        reason) and raises: EnvironmentDown when the harness was killed or the gateway is gone."""
        self._patch(gateway, rollout_id, state="running", last_attempt_id=ATTEMPT)
        family = get_family(task["family"])
        native = isinstance(family, NativeFamily)
        try:
            if native:  # its own reward: the harness returns it
                row = TaskItem.from_json(task["item"]).reference.get("row", {})
                returned = self._run_harness(gateway, rollout_id, {"harness": family.native.env, "row": row}, model,
                                             NATIVE_HARNESS)
                solved = family.solved(returned["reward"])
                score = Score(reward=returned["reward"], success=solved, components={},
                              outcome="success" if solved else "failure")
                transcript = {"final_text": returned["final_text"], "tool_calls": [], "turns": None,
                              "finish_reason": "stop"}
            else:
                transcript = self._run_harness(gateway, rollout_id, task, model, TEAM_AGENT)
                calls = [ToolCall(c["name"], c["arguments"], c["result"]) for c in transcript["tool_calls"]]
                score = family.score(TaskItem.from_json(task["item"]),
                                     Transcript(final_text=transcript["final_text"], tool_calls=calls))
        except Exception as error:
            self.mark_failed(gateway, rollout_id, str(error) if isinstance(error, EnvironmentDown)
                              else f"{type(error).__name__}: {error}")
            raise
        gateway.api("POST", f"/api/rollouts/{rollout_id}/attempt/{ATTEMPT}/events", {
            "event_type": "reward", "data": {
                "value": score.reward, "source": "harness" if native else "reference-scorer", "reason": score.outcome,
                "success": score.success, "components": dict(score.components),
                "outcome": outcome_of(score, transcript["finish_reason"]),
                "finish_reason": transcript["finish_reason"], "turns": transcript["turns"]}})
        self._patch(gateway, rollout_id, state="succeeded", last_attempt_id=ATTEMPT)
        return transcript, score

    def _run_harness(self, gateway: Gateway, rollout_id: str, task: dict[str, Any], model: str,
                     program: Path) -> dict[str, Any]:
        env = {**os.environ,
               "OPENAI_BASE_URL": f"{gateway.url}/proxy/rollout/{rollout_id}/attempt/{ATTEMPT}/mode/train/openai/v1",
               "OPENAI_API_KEY": gateway.key, "OPENAI_MODEL": model}
        process = ForkedProgram(self._preforks.get(program), [str(program)], env=env)
        with self._harness_lock:
            self._harnesses.add(process)
        try:
            try:
                out, err = process.communicate(json.dumps(task), timeout=self.harness_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                raise RuntimeError(f"team harness ran past {self.harness_timeout_s:.0f} s") from None
        finally:
            with self._harness_lock:
                self._harnesses.discard(process)
        # A forked harness killed by signal N reports 128 + N; a plain start, -N.
        killed_by = -process.returncode if process.returncode < 0 else \
            process.returncode - 128 if process.forked and process.returncode > 128 else 0
        if killed_by:
            raise EnvironmentDown(f"team harness killed by signal {killed_by}")
        if process.returncode != 0:  # the whole stderr goes to the stage's log, its last line to the result
            print(f"team harness of rollout {rollout_id} exited with {process.returncode}:\n{err}", file=sys.stderr)
            last = (err.strip().splitlines() or ["(no stderr)"])[-1]
            raise RuntimeError(f"team harness exited with {process.returncode}: {last[-500:]}")
        return json.loads(out.strip().splitlines()[-1])

    def _patch(self, gateway: Gateway, rollout_id: str, **status: Any) -> None:
        gateway.api("PATCH", f"/api/rollouts/{rollout_id}", {"status": status})

    def mark_failed(self, gateway: Gateway, rollout_id: str, message: str) -> None:
        """Best effort: a store that went down with the gateway has lost the rollout anyway."""
        try:
            self._patch(gateway, rollout_id, state="failed", error_message=message[:500])
        except (EnvironmentDown, StoreError):
            pass


def check_native_harness(reference: str) -> None:
    """The team's harness imports and is callable, or the stage fails here with the cause in one line."""
    if not callable(load_asset(reference, "function")):
        raise RuntimeError(f"native asset: {reference} is not callable")


def outcome_of(score: Score, finish_reason: str) -> str:
    """The contract outcome: a failed episode that ran out of tokens or turns is truncated."""
    return "truncated" if finish_reason in ("length", "max_turns") and not score.success else score.outcome


def _captured_calls(events: list[dict[str, Any]], turns: int) -> list[CapturedCall] | None:
    """The store's model calls of one rollout → CapturedCall list in call order; None when the policy server
    returned no token data at all (a scripted policy), so the trainer falls back to the policy server's log."""
    if len(events) != turns:
        raise RuntimeError(f"agl-server captured {len(events)} model calls, the harness made {turns}")
    calls = []
    for event in events:
        data = event["data"]
        if data.get("status", "ok") != "ok":
            raise RuntimeError(f"captured call failed upstream: HTTP {data.get('http_status')} {data.get('error')}")
        calls.append((data.get("prompt_token_ids") or [], data.get("response_token_ids") or [],
                      data.get("response_log_probs")))
    if not any(prompt or completion for prompt, completion, _ in calls):
        return None
    out = []
    for index, (prompt, completion, logprobs) in enumerate(calls):
        if not prompt or logprobs is None or len(logprobs) != len(completion):
            raise RuntimeError(f"captured call {index} lacks token data: {len(prompt)} prompt ids, "
                               f"{len(completion)} sampled ids, logprobs {None if logprobs is None else len(logprobs)}")
        out.append(CapturedCall(prompt_ids=list(prompt), completion_ids=list(completion), logprobs=list(logprobs)))
    return out
