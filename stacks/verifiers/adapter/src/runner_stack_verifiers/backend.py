"""The verifiers rollout backend: episodes run natively by verifiers' env server (a process we start, forked
from a fork server that imported verifiers once, so a restart skips those imports), driven through its own ZMQ
EnvClient, the way prime-rl's trainer drives it.

Per episode the env server runs one rollout of SingleAgentEnv: the null harness's chat program (a subprocess,
forked pre-imported by a fork server the env server starts) talks to verifiers' interception server, which calls
the policy through the episode's client; the taskset's MCP tool server (one subprocess per env server, reached
by each rollout under its own state route) runs the family's tools on the rollout's state; the task's @vf.reward
calls the reference scorer. The tool server is a fork of the backend's fork server, as the env server is:
verifiers starts it as `sys.executable -m MODULE`, and the env server's `sys.executable` is the fork server's
launcher. A plan's native asset (a team's taskset package) gets an env server of its own, loaded by verifiers'
`load_environment`, and its tasks' own rewards score its episodes; our taskset's server then starts only when an
episode of our families (the retention probe) comes. Every rollout of a stage gets the same client config (the
policy's base URL), so the interception server builds one model client for them all: TrainClient (token-in/
token-out with the policy's local tokenizer) when the endpoint has a tokenizer_dir, EvalClient (relay to
/v1/chat/completions) otherwise. The episode id travels in the rollout's sampling config, as `metadata`, which
TrainClient sends as sampling_params.metadata and EvalClient as the body's metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qualification.tasks import NativeFamily, TaskItem, get_family
from qualification.tasks.native import row_id
from runner_contracts import EpisodeResult, EpisodeSpec, ErrorInfo, NativeAsset, ToolCallRecord
from runner_kit.native import import_asset_module
from runner_kit.prefork import FORK_SERVER_MODULE, Prefork, start_prefork, stop_prefork, wait_listening
from runner_kit.processes import command_line, kill_identified, same_process, tree
from runner_kit.rollout import EnvironmentDown, PolicyEndpoint, RolloutBackend

from .envserver import RENDERER_MODULES, TOOL_PYTHON_VARIABLE

READY_TIMEOUT_S = 180.0
POLL_S = 0.2
# Trace errors that mean the environment (not the policy or the episode) failed; the episode is retried.
ENVIRONMENT_ERRORS = {"ToolsetError", "SandboxError"}
ENV_SERVER_MODULE = "runner_stack_verifiers.envserver"
TOOL_SERVER_MODULE = "runner_stack_verifiers.toolset"
# Env servers and their tool servers are forks of one fork server that imported these (verifiers, ~3 s of a
# cold start, each) when the backend started: a restart after a crash starts in ~0.1 s.
ENV_SERVER_MODULES = ["verifiers.v1", "verifiers.v1.serve.pool", "verifiers.v1.serve.server",
                      "runner_stack_verifiers.taskset", *RENDERER_MODULES]
# What a tool server imports once it runs (verifiers' `_serve`, uvicorn's loop and protocol).
TOOL_SERVER_WARM = ["uvicorn", "uvicorn.loops.auto", "uvicorn.loops.asyncio", "uvicorn.protocols.http.auto",
                    "uvicorn.protocols.http.h11_impl", "uvicorn.protocols.websockets.auto", "uvicorn.lifespan.on",
                    "mcp.server.mcpserver", "mcp.server.transport_security", "mcp.server.streamable_http_manager",
                    "httpx", "anyio.streams.stapled", "anyio.streams.tls", "anyio._core._sockets"]
TASKS, NATIVE = "tasks", "native"  # the env servers: our taskset, a plan's native taskset


@dataclass
class _EnvServer:
    """One started env server and the EnvClient connected to it. `process` is what the backend started: the
    fork server's launcher, which exits with the env server's status (and, killed, takes it along), or the
    env server itself where the launcher fell back to a plain start."""

    process: subprocess.Popen
    address: str
    client: Any  # verifiers.v1.serve.client.EnvClient, owned by the backend's event loop
    # (pid, start time) of the processes every rollout needs: the env server, its shared MCP tool server and,
    # unless disabled, the chat program's fork server (its children, the running chat programs, die with it).
    helpers: list[tuple[int, str]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        """The env server's own pid (the first helper): a fork's is not `process.pid`."""
        return self.helpers[0][0]

    def alive(self) -> bool:
        """The env server runs, and so do its tool server and fork server."""
        if self.process.poll() is not None:
            return False
        return all(same_process(pid, start) for pid, start in self.helpers)


class VerifiersBackend(RolloutBackend):
    stack = "verifiers"
    upstream_name = "verifiers"
    capabilities = ["multi-turn-tools", "stateful-tools", "mcp-tools", "concurrent-episodes", "environment-restart",
                    "cpu", "reward:reference-scorer", "token-capture:policy-server", "token-in-token-out",
                    "episode-id:metadata", "native-assets"]
    # TrainClient GETs /v1/models once per policy, then POSTs /inference/v1/generate; EvalClient posts
    # /v1/chat/completions. Every call also carries verifiers' X-Session-ID (its trace id).
    episode_id_channel = ("sampling config metadata.episode_id: TrainClient's sampling_params.metadata, "
                          "EvalClient's body metadata")

    def __init__(self, max_concurrent: int | None = None, log_dir: str | Path | None = None,
                 native: NativeAsset | None = None,
                 max_turns: int = 3) -> None:
        self.max_concurrent = max_concurrent
        self.native = native
        self.max_turns = max_turns  # a native taskset's turn cap (our tasks carry their own)
        self._native_tasks: dict[str, Any] | None = None  # task id -> the native taskset's task
        self._native_tool_modules: list[str] = []  # the modules of its toolsets' MCP servers
        self.log_dir = Path(log_dir) if log_dir is not None else Path.cwd()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: dict[str, _EnvServer] = {}
        self._prefork: Prefork | None = None  # the env servers' and our tool servers' fork server
        self._native_tool_prefork: Prefork | None = None  # a native taskset's tool servers' fork server
        self._lock = threading.Lock()
        self._work: Path | None = None
        self.starts = 0

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        if self._work is None:
            # Short: the env server's fork server listens on a unix socket in here (paths are capped at 108 bytes).
            base = tempfile.gettempdir()
            if len(base) > 48 and os.access("/tmp", os.W_OK):
                base = "/tmp"
            self._work = Path(tempfile.mkdtemp(prefix="vf-backend-", dir=base))
            self._prefork = start_prefork(self._work / "prefork", [ENV_SERVER_MODULE, TOOL_SERVER_MODULE],
                                          [*ENV_SERVER_MODULES, *TOOL_SERVER_WARM], _env_server_env())
            if self._prefork is not None:
                wait_listening(self._prefork)  # the first env server then waits for it, not a cold start beside it
        # This process's own import of verifiers (~3 s of CPU), while the fork server imports it: after the env
        # server's start, it would hold up the first connection.
        from verifiers.v1.serve.client import EnvClient  # noqa: F401
        if self.native is not None and self._native_tasks is None:
            # The client owns the taskset (as prime-rl's does): loaded here, the cause of a broken one is one line.
            self._native_tasks, self._native_tool_modules = load_native_taskset(self.native)
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="verifiers-client", daemon=True)
            self._thread.start()
        with self._lock:
            self._ensure(NATIVE if self.native is not None else TASKS)

    def _ensure(self, kind: str) -> _EnvServer:
        """The running env server of `kind`, started (or replaced, if it died) here. Holds the lock."""
        server = self._servers.get(kind)
        if server is not None and not server.alive():
            del self._servers[kind]
            self._retire(server)  # a running env server whose tool server died goes too
            server = None
        if server is None:
            server = self._servers[kind] = self._spawn(kind)
        return server

    def restart_environment(self) -> None:
        with self._lock:
            for kind in list(self._servers):
                self._ensure(kind)

    def environment_pids(self) -> list[int]:
        """The env servers and the helpers every rollout needs (their tool servers, their fork servers)."""
        return [pid for server in list(self._servers.values()) if server.alive()
                for pid, _ in server.helpers]

    def kill_environment(self) -> None:
        """SIGKILLs the env servers and every process they started (rollout harness programs, MCP tool servers)."""
        for server in list(self._servers.values()):
            _kill_tree(server.pid)
            server.process.kill()
            server.process.wait()

    def stop(self) -> None:
        with self._lock:
            servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            self._retire(server)
        for prefork in (self._prefork, self._native_tool_prefork):
            if prefork is not None:
                stop_prefork(prefork.process)
        self._prefork, self._native_tool_prefork = None, None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10)
            self._loop.close()
            self._loop, self._thread = None, None
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None

    def _retire(self, server: _EnvServer) -> None:
        processes = tree(server.pid)  # before it exits: the rollout processes it started
        if server.alive():
            with contextlib.suppress(ProcessLookupError):  # it may have died since
                os.kill(server.pid, signal.SIGTERM)  # verifiers turns SIGTERM into a clean serving() teardown
            try:
                server.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        kill_identified(processes)  # whatever outlived the teardown (a pid reused since is left alone)
        server.process.kill()  # the launcher, should it outlive the env server
        server.process.wait()
        self._close_client(server)

    def _spawn(self, kind: str) -> _EnvServer:
        self.starts += 1
        ready = self._work / f"envserver-{self.starts}.address"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / ("verifiers-envserver.log" if kind == TASKS else "verifiers-native-envserver.log")
        log = open(log_path, "ab")
        interpreter = str(self._prefork.launcher) if self._prefork is not None else sys.executable
        cmd = [interpreter, "-m", ENV_SERVER_MODULE, str(ready)]
        if self.max_concurrent:
            cmd.append(str(self.max_concurrent))
        if kind == NATIVE:
            cmd += ["--native", json.dumps({"taskset": {**self.native.kwargs, "id": self.native.env},
                                            "max_turns": self.max_turns})]
        env = _env_server_env()
        if (tool_python := self._tool_python(kind)) is not None:
            env[TOOL_PYTHON_VARIABLE] = tool_python

        async def popen() -> subprocess.Popen:
            # From the long-lived loop thread: the server's parent-death signal fires when the spawning
            # *thread* exits, and episode threads (which restart the server) come and go with each batch.
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)

        try:
            process = self._call(popen(), timeout=60)
        finally:
            log.close()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.is_file():
            if process.poll() is not None or time.monotonic() > deadline:
                _kill_tree(process.pid)
                raise RuntimeError(f"verifiers env server did not start (exit {process.poll()}){_last_error(log_path)}; "
                                   f"see {log_path}")
            time.sleep(0.05)
        address, server_pid = ready.read_text().split()  # the env server's own pid: a fork's is not process.pid
        client = self._call(self._connect(address), timeout=60)
        # The env serves only once its tool server answered (the fork server starts before), so both run now.
        processes = [(pid, start, command_line(pid)) for pid, start in tree(int(server_pid))]
        # The env server first (a fork: it has its fork server's command line).
        helpers = [(pid, start) for pid, start, _ in processes[:1]]
        # A forked tool server is the fork server's child: its launcher, which lives as long, stands for it.
        tool_modules = [TOOL_SERVER_MODULE] if kind == TASKS else self._native_tool_modules
        for module in [*tool_modules, FORK_SERVER_MODULE]:
            found = [(pid, start) for pid, start, cmd in processes[1:] if f"-m {module} " in f"{cmd} "]
            if not found and module != FORK_SERVER_MODULE:
                _kill_tree(int(server_pid))
                process.kill()
                raise RuntimeError(f"verifiers env server started no tool server {module}; see {log_path}")
            helpers += found[:1]
        return _EnvServer(process=process, address=address, client=client, helpers=helpers)

    def _tool_python(self, kind: str) -> str | None:
        """The launcher that forks `kind`'s MCP tool servers, for the env server's `sys.executable`: verifiers
        starts a tool server as `sys.executable -m MODULE` (~2.5 s of imports cold, a fork in ~0.1 s). Our
        taskset's come from the env servers' fork server; a native taskset's from one started on first use.
        None when forks are turned off."""
        if kind == NATIVE and self._native_tool_prefork is None and self._native_tool_modules:
            self._native_tool_prefork = start_prefork(self._work / "native-tools", self._native_tool_modules,
                                                      TOOL_SERVER_WARM, _env_server_env())
            if self._native_tool_prefork is not None:
                wait_listening(self._native_tool_prefork)
        prefork = self._prefork if kind == TASKS else self._native_tool_prefork
        return None if prefork is None else str(prefork.launcher)

    async def _connect(self, address: str):
        from verifiers.v1.serve.client import EnvClient

        client = EnvClient(address)
        await client.wait_for_server_startup(timeout=60, interval=0.2)
        return client

    def _close_client(self, server: _EnvServer) -> None:
        if self._loop is not None and self._loop.is_running():
            with contextlib.suppress(Exception):
                self._call(server.client.close(), timeout=10)

    def _call(self, coroutine, timeout: float | None = None):
        assert self._loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    # --- episodes ----------------------------------------------------------------------------------

    def run_episode(self, episode: EpisodeSpec, policy: PolicyEndpoint) -> EpisodeResult:
        item = TaskItem.from_json(episode.item)
        native = self.native is not None and isinstance(get_family(item.family), NativeFamily)
        kind = NATIVE if native else TASKS
        with self._lock:
            server = self._servers.get(kind)
            if server is None and kind == TASKS:
                server = self._ensure(TASKS)  # a native plan's retention probe: our taskset, started on first use
            if server is None or not server.alive():
                raise EnvironmentDown("the verifiers env server is not running")
        started = time.monotonic()
        task_data = self._native_task_data(item) if native else None
        wire = self._call(self._run(server, episode, policy, task_data))
        if (wire.errors or any(trace.errors for trace in wire.traces)) and not server.alive():
            raise EnvironmentDown("the verifiers env server or its tool server died during episode "
                                  f"{episode.episode_id}")
        environment_errors = [e for trace in wire.traces for e in trace.errors if e.type in ENVIRONMENT_ERRORS]
        if environment_errors:  # the rollout's tool server or runtime failed: retryable, like a dead env server
            raise EnvironmentDown("; ".join(f"{e.type}: {e.message}" for e in environment_errors)[:2000])
        if native:
            return native_episode_result(episode, get_family(item.family), wire, seconds=time.monotonic() - started)
        return episode_result(episode, wire, seconds=time.monotonic() - started)

    def _native_task_data(self, item: TaskItem) -> dict[str, Any]:
        """The wire data of the native taskset's task behind `item` (its dataset row's id)."""
        task_id = row_id(item.reference.get("row", {}))
        task = (self._native_tasks or {}).get(task_id)
        if task is None:
            raise RuntimeError(f"native asset: taskset {self.native.env}'s load() yields no task with id "
                               f"{task_id!r} (a dataset row's id must be its task's TaskData.id)")
        return task.data.model_dump(mode="json")

    async def _run(self, server: _EnvServer, episode: EpisodeSpec, policy: PolicyEndpoint,
                   task_data: dict[str, Any] | None = None):
        if task_data is None:
            from .taskset import task_for

            task = task_for(TaskItem.from_json(episode.item), episode.max_turns, episode_id=episode.episode_id)
            task_data = task.data.model_dump(mode="json")
        run = asyncio.ensure_future(server.client.run(
            client=client_config(policy), model=policy.model,
            sampling=sampling_config(policy, episode), task_data=task_data))
        while True:
            done, _ = await asyncio.wait({run}, timeout=POLL_S)
            if done:
                break
            if not server.alive():
                run.cancel()
                raise EnvironmentDown(f"verifiers env server (pid {server.pid}, exit "
                                      f"{server.process.returncode}) or its tool server died during episode "
                                      f"{episode.episode_id}")
        try:
            return run.result()
        except RuntimeError as error:  # the env server answered the request with a failure
            if not server.alive():
                raise EnvironmentDown(f"verifiers env server died: {error}") from None
            raise


def client_config(policy: PolicyEndpoint):
    """The model client of every rollout against `policy`: one config, so verifiers' interception server builds
    one client (an HTTP client and its SSL context, ~20 ms of CPU) for them all, not one per rollout."""
    import verifiers.v1 as vf
    from renderers.configs import CustomRendererConfig

    from .renderer import import_path

    # api_key_var names an unset variable: the key is "EMPTY" and no hosted-service credential is read.
    common = {"base_url": policy.base_url, "api_key_var": "RUNNER_POLICY_API_KEY"}
    if policy.tokenizer_dir:
        return vf.TrainClientConfig(**common, renderer=CustomRendererConfig(import_path=import_path(policy.tool_format)),
                                    renderer_model_name=policy.tokenizer_dir)
    return vf.EvalClientConfig(**common)


def sampling_config(policy: PolicyEndpoint, episode: EpisodeSpec):
    """The rollout's sampling config; its extras name the episode (`metadata`, the policy server's metadata
    channel) and its seed."""
    import verifiers.v1 as vf

    spec = policy.sampling
    extra: dict[str, Any] = {"seed": episode.seed, "metadata": {"episode_id": episode.episode_id}}
    if spec.top_k:
        extra["top_k"] = spec.top_k
    return vf.SamplingConfig(temperature=spec.temperature, top_p=spec.top_p, max_tokens=spec.max_new_tokens, **extra)


def episode_result(episode: EpisodeSpec, wire, seconds: float) -> EpisodeResult:
    """An EpisodeResult from verifiers' episode record (its one trace): reward and components as the task's
    @vf.reward / @vf.metric recorded them, tool calls with the results the harness fed back."""
    from .taskset import tool_calls_of

    if not wire.traces:
        message = "; ".join(f"{e.type}: {e.message}" for e in wire.errors) or "no trace"
        return EpisodeResult(episode_id=episode.episode_id, task_id=episode.task_id, status="failed",
                             outcome="error", error=ErrorInfo(kind="verifiers-episode", message=message),
                             seconds=round(seconds, 3))
    trace = wire.traces[0]
    calls, final_text = tool_calls_of(trace, trace.info.get("executed_tool_calls"))
    reward = trace.rewards.get("reference")
    components = {key.removeprefix("component/"): float(value) for key, value in trace.metrics.items()
                  if key.startswith("component/") and value is not None}
    success = bool(trace.metrics.get("success"))
    truncated = trace.stop_condition in ("turn_limit", "max_turns")
    last_finish = trace.calls[-1].finish_reason if trace.calls else None
    finish = "max_turns" if truncated else (last_finish or "stop")
    errors = [*wire.errors, *trace.errors]
    tool_calls = [ToolCallRecord(name=c["name"], arguments=c["arguments"], result=c["result"]) for c in calls]
    if errors or reward is None:
        message = "; ".join(f"{e.type}: {e.message}" for e in errors) or "the reference reward was not recorded"
        return EpisodeResult(episode_id=episode.episode_id, task_id=episode.task_id, status="failed",
                             outcome="error", finish_reason=finish, turns=trace.num_turns, final_text=final_text,
                             tool_calls=tool_calls, error=ErrorInfo(kind=errors[0].type if errors else "no-reward",
                                                                    message=message[:2000]),
                             seconds=round(seconds, 3))
    outcome = "success" if success else ("truncated" if truncated or last_finish == "length" else "failure")
    return EpisodeResult(episode_id=episode.episode_id, task_id=episode.task_id, status="completed",
                         reward=float(reward.score), reward_components=components, success=success, outcome=outcome,
                         finish_reason=finish, turns=trace.num_turns, final_text=final_text, tool_calls=tool_calls,
                         seconds=round(seconds, 3))


def load_native_taskset(native: NativeAsset) -> tuple[dict[str, Any], list[str]]:
    """(task id -> task, the modules of its toolsets' servers) of a team's taskset package, loaded as verifiers
    loads one (`env` is the taskset id: a package exporting its Taskset subclass via `__all__`; `kwargs` are the
    taskset's config; `module`, if given, is imported first)."""
    from pydantic import ValidationError
    from verifiers.v1.utils.loaders import taskset_class, taskset_config_type

    if not native.dataset:
        raise RuntimeError("native asset: a verifiers taskset is qualified on its rows: task.native.dataset names "
                           "the JSONL whose rows its load() yields as tasks (each row's id is its task's id)")
    for module in filter(None, (native.module, native.env)):
        import_asset_module(module.replace("-", "_"))
    taskset_id = native.env
    try:
        cls = taskset_class(taskset_id)
        config = taskset_config_type(taskset_id).model_validate({**native.kwargs, "id": taskset_id})
        taskset = cls(config)
        tasks: dict[str, Any] = {}
        for task in taskset.load():
            if task.data.id is None:
                raise ValueError(f"task {task.data.name or task.key} has no TaskData.id")
            tasks[str(task.data.id)] = task
        toolsets = cls.toolsets(config)
    except ValidationError as error:
        first = error.errors()[0]
        raise RuntimeError(f"native asset: taskset {taskset_id} config (task.native.kwargs): "
                           f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    except Exception as error:
        raise RuntimeError(f"native asset: loading taskset {taskset_id} failed: {type(error).__name__}: "
                           f"{error}".replace("\n", " ")) from None
    return tasks, [type(toolset).__module__ for toolset in toolsets]


def native_episode_result(episode: EpisodeSpec, family: NativeFamily, wire, seconds: float) -> EpisodeResult:
    """An EpisodeResult of a native taskset's episode: its reward is the trace's (verifiers' weighted sum of the
    task's @vf.reward functions), each reward a component; solved at the asset's success_reward."""
    from .taskset import tool_calls_of

    if not wire.traces:
        return episode_result(episode, wire, seconds)
    trace = wire.traces[0]
    calls, final_text = tool_calls_of(trace)
    truncated = trace.stop_condition in ("turn_limit", "max_turns")
    last_finish = trace.calls[-1].finish_reason if trace.calls else None
    finish = "max_turns" if truncated else (last_finish or "stop")
    tool_calls = [ToolCallRecord(name=c["name"], arguments=c["arguments"], result=c["result"]) for c in calls]
    errors = [*wire.errors, *trace.errors]
    unscored = [name for name, reward in trace.rewards.items() if reward is None]
    if errors or unscored or not trace.rewards:
        message = ("; ".join(f"{e.type}: {e.message}" for e in errors)
                   or (f"the taskset's rewards {unscored} did not run" if unscored else "the task recorded no reward"))
        return EpisodeResult(episode_id=episode.episode_id, task_id=episode.task_id, status="failed",
                             outcome="error", finish_reason=finish, turns=trace.num_turns, final_text=final_text,
                             tool_calls=tool_calls, error=ErrorInfo(kind=errors[0].type if errors else "no-reward",
                                                                    message=message[:2000]),
                             seconds=round(seconds, 3))
    reward = float(trace.reward)
    success = family.solved(reward)
    outcome = "success" if success else ("truncated" if truncated or last_finish == "length" else "failure")
    return EpisodeResult(episode_id=episode.episode_id, task_id=episode.task_id, status="completed", reward=reward,
                         reward_components={name: float(r.score) for name, r in trace.rewards.items()},
                         success=success, outcome=outcome, finish_reason=finish, turns=trace.num_turns,
                         final_text=final_text, tool_calls=tool_calls, seconds=round(seconds, 3))


def _last_error(log: Path) -> str:
    """': <the last exception line>' of a log, or ''."""
    try:
        lines = log.read_text(errors="replace").splitlines()[-200:]
    except OSError:
        return ""
    causes = [line.strip() for line in lines if re.match(r"^[\w.]+(Error|Exception)\b.*: ", line.strip())]
    return f": {causes[-1][:500]}" if causes else ""


def _env_server_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "UV_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1"}


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and its descendants (collected first: killed children are re-parented)."""
    kill_identified(tree(pid))
