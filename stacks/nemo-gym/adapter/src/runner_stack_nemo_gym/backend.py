"""The rollout backend: NeMo Gym servers as local processes, one episode = one POST to simple_agent's /run.

Processes (all on 127.0.0.1, started without NeMo Gym's launcher, which would start Ray on all interfaces
and build a venv per server from PyPI):

- a resources server per task family (`servers.FamilyResourcesServer`): the environment, the process
  kill_environment() SIGKILLs;
- a model server per policy endpoint (`servers.EpisodeVLLMModel`, vllm_model's Responses -> Chat
  Completions path);
- a stock `simple_agent` per (family, policy, max_turns): its `max_steps` is a server setting.

The model server and the agent wait for the policy's address and max_turns (each stage's trainer serves the
policy at a new address, so each stage starts its own): the trainer announces them (POST /prepare, `prepare()`)
while it loads, else the first episode that needs them starts them. They are
forks of a fork server that imported NeMo Gym once at start (runner_kit.prefork): a stage's first batch
neither waits for two cold imports (~4 s of CPU each) nor shares the two cores with them. The resources
servers, the environment the host kills and restarts, are plain processes of their own.

Servers find each other the way NeMo Gym's launcher wires them: each process gets the global config dict
in NEMO_GYM_CONFIG_DICT and its own instance name in NEMO_GYM_CONFIG_PATH; ServerClient resolves names to
host:port from that dict.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qualification.tasks import NativeFamily, TaskItem, get_family, opening_messages
from runner_contracts import EpisodeResult, EpisodeSpec, NativeAsset, ToolCallRecord
from runner_kit.native import load_asset
from runner_kit.policy import openai_tools
from runner_kit.prefork import start_prefork, stop_prefork
from runner_kit.processes import HOST, free_port, spawn
from runner_kit.rollout import EnvironmentDown, PolicyEndpoint, RolloutBackend

READY_TIMEOUT_S = 90.0
EPISODE_TIMEOUT_S = 900.0
HARNESS_KINDS = ("model", "agent")  # forked from the fork server
# The harness servers' program: what `python -m runner_stack_nemo_gym.servers KIND` runs, as a script the
# fork server can run in its children (imported there once, so a child runs only these lines).
HARNESS_SCRIPT = """import sys

from runner_stack_nemo_gym.servers import main

if __name__ == "__main__":
    main(*sys.argv[1:2])
"""
HARNESS_MODULES = ["runner_stack_nemo_gym.servers", "responses_api_agents.simple_agent.app"]


def responses_tools(family_name: str) -> list[dict[str, Any]]:
    """The family's tools as Responses API function tools, built from qualification's openai_tools;
    vllm_model converts them back to exactly that chat form (`strict` is required by the Responses schema;
    None is dropped in the conversion)."""
    return [{"type": "function", **tool["function"], "strict": None} for tool in openai_tools(get_family(family_name))]


@dataclass
class Server:
    """One NeMo Gym server process: its instance name, kind, type entry and port."""

    name: str
    kind: str  # resources | model | agent
    server_type: str  # resources_servers | responses_api_models | responses_api_agents
    impl: str  # the key under the type, as in NeMo Gym's yaml configs
    settings: dict[str, Any]
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    generation: int = 0  # bumped on every (re)start
    server_class: str | None = None  # a team's own resources server (module:Class) instead of ours

    def entry(self) -> dict[str, Any]:
        return {self.server_type: {self.impl: {"entrypoint": "app.py", "host": HOST, "port": self.port,
                                               **self.settings}}}

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class NemoGymBackend(RolloutBackend):
    stack = "nemo-gym"
    upstream_name = "nemo-gym"
    capabilities = ["multi-turn-tools", "cpu", "reward:reference-scorer", "environment-restart",
                    "episode-id:metadata", "episode-id:header", "native-assets"]
    # The /run request's responses_create_params.metadata reaches the policy as body metadata (stock
    # vllm_model forwards it); the EpisodeVLLMModel subclass adds the header from it.
    episode_id_channel = "body metadata.episode_id + header X-Episode-ID"

    def __init__(self, families: Iterable[str] = (), native: NativeAsset | None = None) -> None:
        self.families = sorted(set(families))  # resources servers start() brings up; others start on first use
        self.native = native  # a team's resources server, serving the plan's native task
        self._lock = threading.RLock()  # the server table
        self._start_locks: dict[str, threading.Lock] = {}
        self._servers: dict[str, Server] = {}
        self._workdir: Path | None = None
        self._head_port = 0
        self._prefork: tuple[subprocess.Popen, Path] | None = None  # the fork server and its launcher

    # --- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the resources servers of `families` and waits until they answer. The model server and
        the agents depend on the policy endpoint and max_turns, so they start in prepare() or with the first
        episode that needs them, as does the resources server of a family not named here."""
        if self.native is not None:
            check_native_server(self.native.env)
        with self._lock:
            if self._workdir is None:
                self._workdir = Path(tempfile.mkdtemp(prefix="nemo-gym-"))
                # ServerClient validates a head-server entry; nothing listens there (no head server runs).
                self._head_port = free_port()
                script = self._workdir / "harness_server.py"
                script.write_text(HARNESS_SCRIPT)
                self._prefork = start_prefork(self._workdir / "prefork", script, HARNESS_MODULES)
        self._bring_up([self._resources_server(family) for family in self.families])

    def prepare(self, policy: PolicyEndpoint, families: list[str], max_turns: int) -> None:
        """Starts the model server and agents the coming episodes need (they wait for the policy's address)."""
        for family in families:
            self._servers_for(family, policy, max_turns)

    def stop(self) -> None:
        with self._lock:
            servers = list(self._servers.values())
            self._servers.clear()
            workdir, self._workdir = self._workdir, None
            prefork, self._prefork = self._prefork, None
        if prefork is not None:  # the fork server with the harness servers forked from it
            stop_prefork(prefork.process)
        processes = [server.process for server in servers if server.process is not None]
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)

    def environment_pids(self) -> list[int]:
        """The running resources servers (agents and model servers are the harness)."""
        with self._lock:
            return [s.process.pid for s in self._servers.values() if s.kind == "resources" and s.alive() and s.process]

    def kill_environment(self) -> None:
        """SIGKILLs every resources server started so far (the environment; agents and model servers
        are the harness and stay up)."""
        with self._lock:
            targets = [s for s in self._servers.values() if s.kind == "resources" and s.alive()]
        for server in targets:
            server.process.send_signal(signal.SIGKILL)
            server.process.wait()

    def restart_environment(self) -> None:
        """Restarts every dead resources server on its old port (agents keep their config); idempotent."""
        with self._lock:
            targets = [s for s in self._servers.values() if s.kind == "resources" and not s.alive()]
        for server in targets:
            with self._start_lock(server.name):
                if not server.alive():
                    self._spawn(server)
                    self._wait_ready(server)

    # --- servers -------------------------------------------------------------------------------------

    def _start_lock(self, name: str) -> threading.Lock:
        with self._lock:
            return self._start_locks.setdefault(name, threading.Lock())

    def _server(self, name: str, make: Any) -> Server:
        with self._lock:
            if name not in self._servers:
                self._servers[name] = make()
            return self._servers[name]

    def _bring_up(self, servers: list[Server]) -> None:
        """Starts the servers that are not running yet, all at once, and waits until each answers. A dead
        harness server (model, agent) is started again; a dead resources server is the environment being
        down, which restart_environment() handles. Locks are taken in list order (resources, model, agent)."""
        with contextlib.ExitStack() as held:
            for server in servers:
                held.enter_context(self._start_lock(server.name))
            started = []
            for server in servers:
                if server.alive():
                    continue
                if server.kind == "resources" and server.process is not None:
                    raise EnvironmentDown(f"resources server {server.name} is down "
                                          f"(exit {server.process.returncode})")
                self._spawn(server)
                started.append(server)
            for server in started:
                self._wait_ready(server)

    def _config_for(self, *servers: Server) -> dict[str, Any]:
        config: dict[str, Any] = {"head_server": {"host": HOST, "port": self._head_port}, "dry_run": False}
        for server in servers:
            config[server.name] = server.entry()
        return config

    def _spawn(self, server: Server) -> None:
        """Starts `server` in its own process: NeMo Gym's run_webserver() with the injected global config."""
        if self._workdir is None:
            raise RuntimeError("start() was not called")
        peers = [server]
        if server.kind == "agent":
            peers += [self._servers[server.settings["resources_server"]["name"]],
                      self._servers[server.settings["model_server"]["name"]]]
        config = {"NEMO_GYM_CONFIG_DICT": json.dumps(self._config_for(*peers)), "NEMO_GYM_CONFIG_PATH": server.name}
        if server.kind in HARNESS_KINDS:
            # The fork server's launcher (when it runs; the plain interpreter otherwise) stands for the server:
            # it exits with the server's status, and the server dies when it is killed.
            interpreter = str(self._prefork.launcher) if self._prefork else sys.executable
            command = [interpreter, str(self._workdir / "harness_server.py"), server.kind]
        else:
            command = [sys.executable, "-m", "runner_stack_nemo_gym.servers", server.kind,
                       *([server.server_class] if server.server_class else [])]
        with open(self._workdir / f"{server.name}.log", "ab") as log:
            process = spawn(command, cwd=self._workdir, env={**os.environ, **config}, stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT)
        with self._lock:
            server.process = process
            server.generation += 1

    def _wait_ready(self, server: Server) -> None:
        process = server.process
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if process.poll() is not None:
                message = (f"NeMo Gym {server.kind} server {server.name} exited {process.returncode} while starting: "
                           f"{self._log_tail(server)}")
                if server.kind == "resources":  # e.g. killed by fault injection while it started
                    raise EnvironmentDown(message)
                raise RuntimeError(message)
            try:
                conn = http.client.HTTPConnection(HOST, server.port, timeout=2)
                conn.request("GET", "/health")
                ok = conn.getresponse().status == 200
                conn.close()
                if ok:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"NeMo Gym {server.kind} server {server.name} did not answer /health in "
                                   f"{READY_TIMEOUT_S:.0f} s: {self._log_tail(server)}")
            time.sleep(0.1)

    def _log_tail(self, server: Server, lines: int = 15) -> str:
        try:
            text = (self._workdir / f"{server.name}.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return " | ".join(text.strip().splitlines()[-lines:])

    def _resources_server(self, family: str) -> Server:
        name = f"runner_resources_{family.replace('-', '_')}"
        if self.native is not None and isinstance(get_family(family), NativeFamily):
            module = self.native.env.partition(":")[0]
            return self._server(name, lambda: Server(name, "resources", "resources_servers", module.rpartition(".")[2],
                                                     dict(self.native.kwargs), server_class=self.native.env))
        return self._server(name, lambda: Server(name, "resources", "resources_servers", "runner_family",
                                                 {"family": family}))

    def _servers_for(self, family: str, policy: PolicyEndpoint, max_turns: int) -> tuple[Server, Server, Server]:
        """(resources, model, agent) for an episode: a resources server per family, a model server per
        policy endpoint, an agent per (family, policy, max_turns) since max_steps is an agent setting."""
        key = family.replace("-", "_")
        resources = self._resources_server(family)
        with self._lock:
            match = [s for s in self._servers.values() if s.kind == "model"
                     and s.settings["base_url"] == policy.base_url and s.settings["model"] == policy.model]
            index = int(match[0].name.rsplit("_", 1)[1]) if match else sum(s.kind == "model"
                                                                           for s in self._servers.values())
        model = self._server(f"runner_policy_{index}", lambda: Server(
            f"runner_policy_{index}", "model", "responses_api_models", "vllm_model", {
                "base_url": policy.base_url, "api_key": "none", "model": policy.model,
                # The policy server logs token ids and logprobs of every call; asking vllm_model to echo them
                # too would require every endpoint (the scripted one included) to return them.
                "return_token_id_information": False,
                "uses_reasoning_parser": False,
            }))
        name = f"runner_agent_{key}_{index}_t{max_turns}"
        agent = self._server(name, lambda: Server(name, "agent", "responses_api_agents", "simple_agent", {
            "resources_server": {"type": "resources_servers", "name": resources.name},
            "model_server": {"type": "responses_api_models", "name": model.name},
            "max_steps": max_turns,
        }))
        self._bring_up([resources, model, agent])
        return resources, model, agent

    # --- episodes ------------------------------------------------------------------------------------

    def run_request(self, episode: EpisodeSpec, policy: PolicyEndpoint) -> dict[str, Any]:
        """The simple_agent /run body for one episode: for a native asset, its dataset row as NeMo Gym's
        rollout collection sends it (the row's responses_create_params with our sampling and the episode's id
        added; its other fields, the verifier's, as they are)."""
        family = get_family(episode.family)
        item = TaskItem.from_json(episode.item)
        sampling = policy.sampling
        extra_body: dict[str, Any] = {"seed": episode.seed}
        if sampling.top_k > 0:
            extra_body["top_k"] = sampling.top_k
        if isinstance(family, NativeFamily):
            row = dict(item.reference["row"])
            params = {**row.pop("responses_create_params"), "model": policy.model, "temperature": sampling.temperature,
                      "top_p": sampling.top_p, "max_output_tokens": sampling.max_new_tokens,
                      "metadata": {"episode_id": episode.episode_id, "extra_body": json.dumps(extra_body)}}
            for field in ("id", "split"):
                row.pop(field, None)
            return {**row, "responses_create_params": params, "_ng_rollout_id": f"runner-{uuid.uuid4().hex}"}
        params: dict[str, Any] = {
            "input": opening_messages(family, item),
            "model": policy.model,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_output_tokens": sampling.max_new_tokens,
            # Responses metadata (string values) reaches the policy as body `metadata`; vllm_model merges the
            # JSON in `extra_body` into the chat request (sampling fields the Responses API has no name for).
            "metadata": {"episode_id": episode.episode_id, "extra_body": json.dumps(extra_body)},
        }
        tools = responses_tools(episode.family)
        if tools:
            params["tools"] = tools
        return {"responses_create_params": params,
                "_ng_rollout_id": f"runner-{uuid.uuid4().hex}",  # unique per /run (NeMo Gym's ids restart at 0)
                "episode_id": episode.episode_id, "task_item": episode.item}

    def run_episode(self, episode: EpisodeSpec, policy: PolicyEndpoint) -> EpisodeResult:
        started = time.monotonic()
        if self._workdir is None:
            self.start()
        resources, _, agent = self._servers_for(episode.family, policy, episode.max_turns)
        generation = resources.generation

        def environment_problem() -> str | None:
            if not resources.alive():
                return f"resources server {resources.name} died during the episode"
            if resources.generation != generation:
                return f"resources server {resources.name} restarted during the episode"
            return None

        status, raw = _post_watched(agent.port, "/run", self.run_request(episode, policy), environment_problem,
                                    EPISODE_TIMEOUT_S)
        text = raw.decode(errors="replace")
        if status != 200:
            # A 200 is always whole: the session lives from /seed_session to /verify on one resources server
            # process, and a restarted one answers 409 "unknown session" for it.
            problem = environment_problem()
            if problem:
                raise EnvironmentDown(problem)
            if "unknown session" in text:
                raise EnvironmentDown(f"resources server {resources.name} lost the episode's session: {text[:300]}")
            raise RuntimeError(f"simple_agent /run answered HTTP {status}: {text[:500]}")
        body = json.loads(text)
        if body.get("mask_sample"):
            raise RuntimeError(f"verify flagged the episode: {body.get('failure_reason')}")
        family = get_family(episode.family)
        if isinstance(family, NativeFamily):
            return native_result(episode, family, body, started)
        return EpisodeResult(
            episode_id=episode.episode_id, task_id=episode.task_id, status="completed",
            reward=float(body["reward"]), reward_components={k: float(v) for k, v in body["reward_components"].items()},
            success=bool(body["success"]), outcome=body["outcome"], finish_reason=body["finish_reason"],
            turns=int(body["turns"]), final_text=body["final_text"],
            tool_calls=[ToolCallRecord(name=c["name"], arguments=c["arguments"], result=c["result"])
                        for c in body["tool_calls"]],
            seconds=round(time.monotonic() - started, 3),
        )


def native_result(episode: EpisodeSpec, family: NativeFamily, body: dict[str, Any], started: float) -> EpisodeResult:
    """A team's verify response as an episode: its reward as it is; turns, final text and tool calls read
    from the Responses output the way our own resources server reads them."""
    from .servers import transcript_from_output

    response = body.get("response") or {}
    seen = transcript_from_output(response.get("output") or [])
    finish = "length" if response.get("incomplete_details") else ("max_turns" if seen["ended_on_tool_call"] else "stop")
    reward = float(body["reward"])
    success = family.solved(reward)
    return EpisodeResult(
        episode_id=episode.episode_id, task_id=episode.task_id, status="completed", reward=reward,
        success=success, outcome="success" if success else ("truncated" if finish != "stop" else "failure"),
        finish_reason=finish, turns=seen["turns"], final_text=seen["final_text"],
        tool_calls=[ToolCallRecord(name=c["name"], arguments=c["arguments"], result=str(c["result"]))
                    for c in seen["tool_calls"]],
        seconds=round(time.monotonic() - started, 3))


def check_native_server(reference: str) -> None:
    """The team's resources server imports and is a SimpleResourcesServer, or the stage fails here in one line."""
    from nemo_gym.base_resources_server import SimpleResourcesServer

    cls = load_asset(reference, "Class")
    if not (isinstance(cls, type) and issubclass(cls, SimpleResourcesServer)):
        raise RuntimeError(f"native asset: {reference} is not a nemo_gym SimpleResourcesServer subclass")


def _post_watched(port: int, path: str, payload: dict[str, Any], problem: Any, timeout_s: float) -> tuple[int, bytes]:
    """POSTs JSON to 127.0.0.1:port and waits for the answer while `problem()` stays None; otherwise closes
    the connection (simple_agent cancels the request when its client goes away: its calls to a dead
    resources server would retry forever) and raises EnvironmentDown."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            conn.request("POST", path, body=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            outcome["reply"] = (response.status, response.read())
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = error

    worker = threading.Thread(target=work, name="nemo-gym-run", daemon=True)
    worker.start()
    deadline = time.monotonic() + timeout_s
    while worker.is_alive():
        worker.join(0.05)
        why = problem()
        timed_out = why is None and time.monotonic() > deadline
        if (why is not None or timed_out) and worker.is_alive():
            with contextlib.suppress(OSError):
                if conn.sock is not None:
                    conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
            worker.join(2)
            if timed_out:
                raise TimeoutError(f"no answer from simple_agent {path} in {timeout_s:.0f} s")
            raise EnvironmentDown(why)
    conn.close()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["reply"]
