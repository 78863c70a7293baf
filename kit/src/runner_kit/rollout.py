"""The rollout service every environment adapter exposes, and the scaffold that runs it.

An adapter subclasses RolloutBackend (lifecycle hooks: start, run_episode, kill_environment,
restart_environment, stop) and its entry point returns `adapter_main(Backend(), request)`. The scaffold
handles the stages an environment stack runs itself:

- probe: python, installed packages, upstream version, capabilities;
- service: every scripted case of the plan's families through run_episode against a ScriptedPolicyServer
  (service.jsonl), so the stack's native scoring is checked against the reference scorer;
- serve: the long-running rollout service on 127.0.0.1 (GET /health, GET /info, POST /prepare, POST
  /rollouts); it writes service.json {url, pid} when ready and stops on SIGTERM.

POST /rollouts takes a RolloutRequest and answers a RolloutResponse with exactly one EpisodeResult per
requested episode: an episode whose environment went down (EnvironmentDown), or that gave no result within
episode_timeout_s (the environment is then killed first: a hung server may still pass its health check), is
retried after a restart up to max_attempts, then reported as failed; none is dropped. See
docs/rollout-service.md. POST /prepare (a RolloutPrepare, advisory) names the policy endpoint ahead of the first
batch, so the backend starts what waits for that address while the trainer loads.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.metadata
import os
import platform
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from qualification.tasks import get_family, service_cases, use_plan
from runner_contracts import (
    ENVIRONMENT_FILE,
    SERVICE_CALLS_FILE,
    EnvironmentInfo,
    EpisodeResult,
    EpisodeSpec,
    ErrorInfo,
    Hardware,
    JsonlWriter,
    RolloutPrepare,
    RolloutRequest,
    RolloutResponse,
    SamplingSpec,
    ServiceCase,
    StageRequest,
    StageResult,
    Upstream,
    write_atomic,
)
from runner_contracts.processes import StopSignal

from .http import Call, HttpError, JsonServer, Reply, post_json
from .policy import EPISODE_HEADER, attempt_id
from .processes import ServerProcess
from .scripted_policy import ScriptedPolicyServer

SERVICE_FILE = "service.json"


class EnvironmentDown(Exception):
    """The upstream environment server is unreachable or died during an episode (retryable)."""


class EpisodeTimeout(EnvironmentDown):
    """An attempt gave no result within the request's episode_timeout_s (a hung or stalled environment)."""


def post_to_environment(url: str, body: Any, *, timeout: float = 30.0) -> Any:
    """POST JSON to an environment server the adapter runs. Any transport failure (a refused connection, a
    reply cut off by a dying server) and a 404 (a restarted server has lost the episode) raise
    EnvironmentDown; other HTTP errors raise HttpError."""
    try:
        return post_json(url, body, timeout=timeout)
    except (OSError, http.client.HTTPException) as error:
        raise EnvironmentDown(f"{url} unreachable: {type(error).__name__}: {error}") from None
    except HttpError as error:
        if error.status == 404:
            raise EnvironmentDown(str(error)) from None
        raise


@dataclass(frozen=True)
class PolicyEndpoint:
    """Where and how an episode calls the policy."""

    base_url: str  # http://127.0.0.1:PORT/v1
    model: str
    sampling: SamplingSpec
    tokenizer_dir: str | None = None
    tool_format: str = "hermes"  # how the policy writes tool calls (runner_kit.tool_formats)

    def headers(self, episode_id: str) -> dict[str, str]:
        return {EPISODE_HEADER: episode_id}

    def chat(self, episode_id: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
             timeout_s: float = 300.0) -> tuple[dict[str, Any], str]:
        """One /chat/completions call under the episode's header: (choices[0].message, finish_reason).
        Failures raise RuntimeError: the policy is not the environment, so they are never retried."""
        sampling = self.sampling
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k, "max_tokens": sampling.max_new_tokens, "stream": False,
        }
        if tools:
            body["tools"] = tools
        try:
            reply = post_json(self.base_url.rstrip("/") + "/chat/completions", body,
                              headers=self.headers(episode_id), timeout=timeout_s)
        except HttpError as error:
            raise RuntimeError(f"policy server answered {error.status}: {str(error)[:500]}") from None
        except OSError as error:
            raise RuntimeError(f"policy server unreachable: {error}") from None
        choice = reply["choices"][0]
        return choice["message"], choice.get("finish_reason") or ""


class RolloutBackend:
    """One environment stack driven natively. Subclasses set the class attributes and the hooks."""

    stack: str = ""
    upstream_name: str = ""
    capabilities: list[str] = []
    episode_id_channel: str = ""

    def start(self) -> None:
        """Starts the upstream environment server(s) on 127.0.0.1 and waits until they answer."""

    def warm_up(self) -> None:
        """Optional: loads what the first episode would otherwise load (a heavy import, a server that waits
        for the policy's address). The rollout service calls it in the background once it is up, so it
        overlaps the trainer's start instead of the first batch; it must be safe to run alongside episodes."""

    def prepare(self, policy: PolicyEndpoint, families: list[str], max_turns: int) -> None:
        """Optional: starts what episodes of `families` against `policy` will need and that waits for its address
        (a server configured with the policy's URL). The service runs it on a thread when the trainer announces
        its policy (POST /prepare), so it overlaps the trainer's start; episodes may run alongside it."""

    def run_episode(self, episode: EpisodeSpec, policy: PolicyEndpoint) -> EpisodeResult:
        raise NotImplementedError

    def environment_pids(self) -> list[int]:
        """The running upstream environment's processes (each with whatever it started), for the host's
        crash test: the host SIGKILLs them itself, by pid. Empty when the environment runs in this process."""
        return []

    def kill_environment(self) -> None:
        """SIGKILLs the upstream environment server (an attempt that hung: its server may still look up)."""
        raise NotImplementedError

    def restart_environment(self) -> None:
        """Brings the environment server back after a crash; a no-op when it is up."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stops everything start() started."""

    def bench_step_latency(self, steps: int) -> dict[str, list[float]]:
        """Optional (for `make bench`): seconds per environment step through the upstream's own client
        alone ("upstream_client") and through this adapter's path ("adapter"), same server, same step."""
        return {}


class ServerBackend(RolloutBackend):
    """A backend whose environment is server processes it starts (`self.server`, a ServerProcess, and any
    others `servers()` names): start, kill, restart and stop, all of them together, under one lock.
    Subclasses set `server` in __init__ and write run_episode, taking the URL from running_url()."""

    server: ServerProcess

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def servers(self) -> list[ServerProcess]:
        return [self.server]

    def start(self) -> None:
        with self._lock:
            for server in self.servers():
                if not server.alive():
                    server.start()

    def environment_pids(self) -> list[int]:
        with self._lock:
            return [server.process.pid for server in self.servers() if server.alive() and server.process]

    def kill_environment(self) -> None:
        with self._lock:
            for server in self.servers():
                server.kill()

    def restart_environment(self) -> None:
        with self._lock:
            for server in self.servers():
                if not (server.alive() and server.healthy()):
                    server.kill()
                    server.start()

    def stop(self) -> None:
        with self._lock:
            for server in self.servers():
                server.stop()

    def running_url(self, server: ServerProcess | None = None) -> str:
        """The URL of `server` (default: `self.server`); EnvironmentDown if it is not running (killed and not
        yet restarted)."""
        server = server or self.server
        with self._lock:
            if not server.alive():
                raise EnvironmentDown(f"{server.name} {server.url} is not running")
            return server.url


# --- probe -------------------------------------------------------------------------------------------


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def environment_info(upstream_name: str, gpus: list[str] | None = None) -> EnvironmentInfo:
    """What is installed in this environment (names normalised), with the upstream's version. A name found
    twice on the path reports the version an import gets (the first)."""
    packages: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        packages.setdefault(dist.metadata["Name"].lower().replace("_", "-").replace(".", "-"), dist.version)
    return EnvironmentInfo(
        engine="", python=platform.python_version(), packages=packages,
        upstream=Upstream(name=upstream_name, version=packages.get(upstream_name.lower().replace("_", "-"), "")),
        hardware=Hardware(cpu=cpu_name(), cpu_count=os.cpu_count() or 0, gpus=gpus or []),
        deviations=python_deviations(),
    )


def python_deviations() -> list[str]:
    """Installed distributions whose declared Requires-Python excludes this interpreter (pip's
    --ignore-requires-python lets such a release in), measured from their metadata."""
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
    except ImportError:  # not every stack locks packaging; pip's copy is in every venv
        from pip._vendor.packaging.specifiers import InvalidSpecifier, SpecifierSet
    running = platform.python_version()
    found = []
    for dist in importlib.metadata.distributions():
        declared = dist.metadata.get("Requires-Python")
        try:
            if declared and not SpecifierSet(declared).contains(running, prereleases=True):
                found.append(f"{dist.metadata['Name']} {dist.version} declares Python {declared}; runs on {running}")
        except InvalidSpecifier:
            continue
    return sorted(set(found))


def reachability(read_only_inputs: list[str] | tuple[str, ...] = (), host: str = "pypi.org",
                 port: int = 443) -> dict[str, Any]:
    """What this process can reach beyond its run directory: an outbound TCP connection to a public host,
    a write outside the working directory, and a write into its inputs (the policy), all expected to
    fail inside an isolating engine. A probe file that could be created is removed at once."""
    import socket
    import tempfile

    try:
        with socket.create_connection((host, port), timeout=3):
            outbound = True
    except OSError:
        outbound = False

    def can_write(folder: Path) -> bool:
        try:
            handle, name = tempfile.mkstemp(prefix=".runner-isolation-probe-", dir=folder)
        except OSError:
            return False
        os.close(handle)
        os.unlink(name)
        return True

    def own(folder: Path) -> bool:  # the job's private TMPDIR (in its run directory), e.g. a sandbox's /tmp
        with contextlib.suppress(OSError, KeyError):
            return folder.samefile(os.environ["TMPDIR"])
        return False

    # The engine points TMPDIR into the run directory; /tmp and /var/tmp are the host's shared ones.
    outside = [folder for folder in (Path("/tmp"), Path("/var/tmp")) if folder.is_dir() and not own(folder)]
    inputs = [Path(p) for p in read_only_inputs if Path(p).is_dir()]
    return {"outbound_tcp": outbound, "outbound_target": f"{host}:{port}",
            "write_outside_run_dir": any(can_write(folder) for folder in outside),
            "write_target": ", ".join(map(str, outside)),
            "write_inputs": any(can_write(folder) for folder in inputs),
            "inputs": [str(folder) for folder in inputs]}


# --- running batches -----------------------------------------------------------------------------------


def policy_endpoint(request: RolloutRequest | RolloutPrepare) -> PolicyEndpoint:
    """The policy a rollout request (or a prepare) names."""
    return PolicyEndpoint(base_url=request.policy_base_url, model=request.policy_model, sampling=request.sampling,
                          tokenizer_dir=request.tokenizer_dir, tool_format=request.tool_format)


class BatchRunner:
    """Runs a RolloutRequest's episodes on a backend: concurrency, retries after an environment crash
    (the environment restarted once per crash), a bounded time per attempt."""

    def __init__(self, backend: RolloutBackend):
        self.backend = backend
        self._restart_lock = threading.Lock()
        self._generation = 0  # bumped on every restart, so concurrent failures restart once

    def run(self, request: RolloutRequest) -> RolloutResponse:
        started = time.monotonic()
        policy = policy_endpoint(request)
        counter = {"restarts": 0}
        counter_lock = threading.Lock()

        def one(episode: EpisodeSpec) -> EpisodeResult:
            return self._run_with_retries(episode, policy, request, counter, counter_lock)

        with ThreadPoolExecutor(max_workers=request.concurrency, thread_name_prefix="episode") as pool:
            results = list(pool.map(one, request.episodes))
        return RolloutResponse(stack=self.backend.stack, results=results, environment_restarts=counter["restarts"],
                               seconds=round(time.monotonic() - started, 3))

    def _run_with_retries(self, episode, policy, request, counter, counter_lock) -> EpisodeResult:
        errors: list[str] = []
        max_attempts, timed_out = request.max_attempts, False
        for attempt in range(1, max_attempts + 1):
            generation = self._generation
            began = time.monotonic()
            try:
                # A retry runs under its own wire id, so the policy server keeps its calls apart from the
                # abandoned attempt's; the result is reported under the episode's id.
                wire = msgspec.structs.replace(episode, episode_id=attempt_id(episode.episode_id, attempt))
                result = self._attempt(wire, policy, request.episode_timeout_s)
                return msgspec.structs.replace(result, episode_id=episode.episode_id, attempts=attempt,
                                               seconds=round(time.monotonic() - began, 3))
            except EnvironmentDown as error:
                errors.append(f"attempt {attempt}: {error}")
                timed_out = isinstance(error, EpisodeTimeout)
                with self._restart_lock:
                    if self._generation == generation:  # the first failure of this generation restarts
                        if timed_out:  # a hung server may still answer its health check
                            self.backend.kill_environment()
                        self.backend.restart_environment()
                        self._generation += 1
                        with counter_lock:
                            counter["restarts"] += 1
            except Exception as error:  # a failure of the episode itself is reported, never dropped
                return EpisodeResult(episode_id=episode.episode_id, task_id=episode.task_id, status="failed",
                                     outcome="error", attempts=attempt,
                                     error=ErrorInfo(kind=type(error).__name__, message=str(error)),
                                     seconds=round(time.monotonic() - began, 3))
        return EpisodeResult(episode_id=episode.episode_id, task_id=episode.task_id, status="failed", outcome="error",
                             attempts=max_attempts,
                             error=ErrorInfo(kind="environment-timeout" if timed_out else "environment-down",
                                             message="; ".join(errors)))

    def _attempt(self, episode: EpisodeSpec, policy: PolicyEndpoint, timeout_s: float) -> EpisodeResult:
        """backend.run_episode on a thread of its own, waited for at most `timeout_s`. An abandoned attempt's
        thread ends when the environment it waits on is killed; its late result is dropped."""
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def target() -> None:
            try:
                outcome["result"] = self.backend.run_episode(episode, policy)
            except BaseException as error:  # noqa: BLE001 - re-raised on the waiting thread
                outcome["error"] = error
            finally:
                done.set()

        threading.Thread(target=target, name=f"attempt {episode.episode_id}", daemon=True).start()
        if not done.wait(timeout_s):
            raise EpisodeTimeout(f"no result after {timeout_s:g} s (episode_timeout_s): the environment hung "
                                 f"or stalled")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]


# --- stages ------------------------------------------------------------------------------------------


def adapter_main(backend: RolloutBackend, request: StageRequest) -> StageResult:
    handlers = {"probe": _probe, "service": _service, "serve": _serve, "bench": _bench}
    use_plan(request.plan)  # a plan's native task is a family of its own in this process
    if request.stage not in handlers:
        raise ValueError(f"{backend.stack} adapter has no stage {request.stage!r}; it has {', '.join(handlers)}")
    return handlers[request.stage](backend, request)


def _probe(backend: RolloutBackend, request: StageRequest) -> StageResult:
    return StageResult(stage="probe", environment=environment_info(backend.upstream_name),
                       capabilities=list(backend.capabilities),
                       metrics={"episode_id_channel": backend.episode_id_channel,
                                "reach": reachability([request.policy_dir] if request.policy_dir else [])})


def announce_policy(service_url: str, prepare: RolloutPrepare) -> str | None:
    """POST /prepare: None when the service took it, else why not (advisory: the first batch starts what is
    missing, so the caller goes on either way)."""
    try:
        post_json(f"{service_url}/prepare", msgspec.to_builtins(prepare), timeout=10)
    except (OSError, HttpError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def post_rollouts(service_url: str, batch: RolloutRequest, *, timeout: float) -> RolloutResponse:
    """The rollout service's answer to `batch`; raises when an episode came back without a result."""
    response = msgspec.convert(post_json(f"{service_url}/rollouts", msgspec.to_builtins(batch), timeout=timeout),
                               RolloutResponse)
    returned = {result.episode_id for result in response.results}
    lost = [episode.episode_id for episode in batch.episodes if episode.episode_id not in returned]
    if lost:
        raise RuntimeError(f"the rollout service returned no result for {len(lost)} episode(s): {lost[:3]}")
    return response


def _service(backend: RolloutBackend, request: StageRequest) -> StageResult:
    """Scripted known-good and known-bad episodes through the stack's native loop and scoring: on the arm's
    running rollout service when the request names one (option `rollout_service`: the environment is not
    started a second time), else on a backend started here."""
    plan = request.plan
    episodes = [(EpisodeSpec(episode_id=f"service/{item.task_id}/{case['case']}", task_id=item.task_id,
                             family=family_name, item=item.to_json(), seed=0, max_turns=plan.budget.max_turns), item, case)
                for family_name, item, case in service_cases(plan, int(request.options.get("items_per_family", 3)))]
    scripts = {episode.episode_id: case["turns"] for episode, _, case in episodes}
    service_url = request.options.get("rollout_service")
    with ScriptedPolicyServer(scripts, plan.policy.tool_format) as scripted:
        batch = RolloutRequest(episodes=[e for e, _, _ in episodes], policy_base_url=scripted.base_url,
                               policy_model=scripted.model, sampling=plan.sampling, concurrency=2,
                               tool_format=plan.policy.tool_format, episode_timeout_s=plan.budget.attempt_timeout_s())
        if service_url:
            response = post_rollouts(service_url, batch, timeout=plan.budget.wall_clock_s)
        else:
            backend.start()
            try:
                response = BatchRunner(backend).run(batch)
            finally:
                backend.stop()
        calls = scripted.call_records()
    out = Path(request.out_dir)
    with JsonlWriter(out / "service.jsonl") as writer:
        for (episode, item, case), result in zip(episodes, response.results, strict=True):
            writer.write(ServiceCase(
                task_id=item.task_id, item=item.to_json(), case=case["case"], expected_success=case["expected_success"],
                final_text=result.final_text,
                tool_calls=[{"name": c.name, "arguments": c.arguments, "result": c.result} for c in result.tool_calls],
                stack_reward=result.reward, stack_components=result.reward_components,
                episode_id=episode.episode_id, status=result.status, error=result.error,
            ))
    with JsonlWriter(out / SERVICE_CALLS_FILE) as writer:
        for call in calls:
            writer.write(call)
    return StageResult(stage="service", files={"service": "service.jsonl", "calls": SERVICE_CALLS_FILE},
                       metrics={"episode_id_channel": backend.episode_id_channel, "seconds": response.seconds})


def _scripted_calc_batch(n: int, max_turns: int = 3) -> tuple[list[EpisodeSpec], dict[str, list[dict[str, Any]]]]:
    """n calc-tool episodes whose scripted policy answers correctly after one tool call."""
    family = get_family("calc-tool")
    episodes, scripts = [], {}
    for index, item in enumerate(family.generate("train", n, 1)):
        case = family.scripted_cases(item)[0]
        episode = EpisodeSpec(episode_id=f"bench/{index}", task_id=item.task_id, family=family.name,
                              item=item.to_json(), seed=0, max_turns=max_turns)
        episodes.append(episode)
        scripts[episode.episode_id] = case["turns"]
    return episodes, scripts


def bench_backend(backend: RolloutBackend, *, episodes: int, steps: int) -> dict[str, Any]:
    """Episodes/s with a scripted policy (so the figure is the environment's cost) at concurrency 1 and 4,
    and the backend's per-step latency pair when it has one."""
    batch, scripts = _scripted_calc_batch(episodes)
    figures: dict[str, Any] = {"stack": backend.stack}
    began = time.monotonic()
    backend.start()
    figures["start_s"] = round(time.monotonic() - began, 3)
    try:
        with ScriptedPolicyServer(scripts) as scripted:
            runner = BatchRunner(backend)
            for concurrency in (1, 4):
                request = RolloutRequest(episodes=batch, policy_base_url=scripted.base_url, policy_model=scripted.model,
                                         sampling=SamplingSpec(), concurrency=concurrency)
                runner.run(msgspec.structs.replace(request, episodes=batch[:2]))  # warm-up: imports, connections
                response = runner.run(request)
                failed = [r.episode_id for r in response.results if r.status != "completed" or not r.success]
                if failed:
                    raise RuntimeError(f"scripted bench episodes failed: {failed[:3]}")
                figures[f"episodes_per_s_concurrency_{concurrency}"] = round(len(batch) / response.seconds, 2)
        figures["step_latency_s"] = backend.bench_step_latency(steps)
    finally:
        backend.stop()
    return figures


def _bench(backend: RolloutBackend, request: StageRequest) -> StageResult:
    return StageResult(stage="bench", metrics=bench_backend(
        backend, episodes=int(request.options.get("episodes", 64)), steps=int(request.options.get("steps", 500))))


class RolloutService:
    """The rollout service's HTTP server around a started backend (one batch at a time)."""

    def __init__(self, backend: RolloutBackend):
        self.backend = backend
        self.runner = BatchRunner(backend)
        self._batch_lock = threading.Lock()
        self.info = {"stack": backend.stack, "upstream": environment_info(backend.upstream_name).upstream,
                     "python": platform.python_version(), "capabilities": list(backend.capabilities),
                     "episode_id_channel": backend.episode_id_channel}
        self.server = JsonServer([
            ("GET", "/health", lambda call: Reply(body={"status": "ok"})),
            ("GET", "/info", lambda call: Reply(body=msgspec.to_builtins(self.info))),
            ("POST", "/prepare", self._prepare),
            ("POST", "/rollouts", self._rollouts),
        ])
        self._preparing: list[threading.Thread] = []

    @property
    def url(self) -> str:
        return self.server.url

    def _rollouts(self, call: Call) -> Reply:
        try:
            batch = msgspec.convert(call.body, RolloutRequest)
        except msgspec.ValidationError as error:
            raise HttpError(422, f"not a rollout-request: {error}") from None
        with self._batch_lock:  # restarts are counted per batch
            return Reply(body=msgspec.to_builtins(self.runner.run(batch)))

    def _prepare(self, call: Call) -> Reply:
        try:
            prepare = msgspec.convert(call.body, RolloutPrepare)
        except msgspec.ValidationError as error:
            raise HttpError(422, f"not a rollout-prepare: {error}") from None
        thread = threading.Thread(target=self._run_prepare, args=(prepare,), name="prepare", daemon=True)
        self._preparing.append(thread)
        thread.start()
        return Reply(202, {"status": "preparing"})

    def _run_prepare(self, prepare: RolloutPrepare) -> None:
        started = time.monotonic()
        try:
            self.backend.prepare(policy_endpoint(prepare), prepare.families, prepare.max_turns)
        except Exception as error:  # noqa: BLE001 - the first batch meets the same fault and reports it
            print(f"rollout service: prepare failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            return
        print(f"rollout service: prepared for {prepare.policy_base_url} in {time.monotonic() - started:.1f} s",
              file=sys.stderr, flush=True)

    def __enter__(self) -> RolloutService:
        self.backend.start()
        self.server.start()
        self._warming = threading.Thread(target=self._warm_up, name="warm-up", daemon=True)
        self._warming.start()
        return self

    def _warm_up(self) -> None:
        started = time.monotonic()
        try:
            self.backend.warm_up()
        except Exception as error:  # noqa: BLE001 - the first episode meets the same fault and reports it
            print(f"rollout service: warm-up failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            return
        print(f"rollout service: warmed up in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)

    def __exit__(self, *exc: Any) -> None:
        self.server.stop()
        for thread in [self._warming, *self._preparing]:  # the backend stops after them, not while they run
            thread.join()
        self.backend.stop()


class _PublishedEnvironment:
    """Keeps ENVIRONMENT_FILE current ({"pids": backend.environment_pids()}, rewritten atomically when they
    change, checked every 0.1 s): the host reads it to crash the environment, from outside the service's
    network namespace."""

    def __init__(self, backend: RolloutBackend, path: Path):
        self.backend, self.path = backend, path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="environment-pids", daemon=True)

    def _run(self) -> None:
        published = None
        while True:
            with contextlib.suppress(Exception):  # a backend between states answers next time
                pids = self.backend.environment_pids()
                if pids != published:
                    write_atomic(self.path, msgspec.json.encode({"pids": pids}))
                    published = pids
            if self._stop.wait(0.1):
                return

    def __enter__(self) -> _PublishedEnvironment:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def publish_service(out_dir: Path, url: str, stack: str) -> None:
    """service.json {url, pid, stack}: a long-running job's word to the host that it answers at `url`."""
    write_atomic(out_dir / SERVICE_FILE, msgspec.json.encode({"url": url, "pid": os.getpid(), "stack": stack}))


def _serve(backend: RolloutBackend, request: StageRequest) -> StageResult:
    """The rollout service; blocks until SIGTERM/SIGINT, then stops the backend."""
    stop = StopSignal()
    with RolloutService(backend) as service, _PublishedEnvironment(backend, Path(request.out_dir) / ENVIRONMENT_FILE):
        publish_service(Path(request.out_dir), service.url, backend.stack)
        stop.wait()
        print(f"rollout service: stop signal, stopping {backend.stack}", file=sys.stderr, flush=True)
        stopping = time.monotonic()
    print(f"rollout service: stopped in {time.monotonic() - stopping:.1f} s", file=sys.stderr, flush=True)
    return StageResult(stage="serve")
