"""The container engine: each adapter job runs in its stack's image under Docker Engine or Podman
(docker SDK), with the same contract as the local engine.

Container policy: no network (a trainer job that needs its arm's rollout service joins that service
container's network namespace: loopback only); the run directory is the only writable mount, the
policy and other inputs are mounted read-only at their host paths, the root filesystem is read-only;
a non-root user, no capabilities, no new privileges; CPU and memory limits from the plan; logs and
exit code captured into the stage folder; the container is removed whether the job passed or failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner_contracts import StageRequest

from .jobs import (
    STACK_PREFIX,
    RunOutcome,
    StackEnvironment,
    read_only_inputs,
    run_dir_of,
    scrubbed_env,
    wait_for_service,
    watch,
    write_request,
)
from .._errors import EngineError
from .images import StackImage, build_stack_image, connect, stack_image
from .._stacks import StackManifest

CONTAINER_USER = (1000, 1000)  # the images' non-root user, used when the runner itself runs as root
LABEL_OWNER = "runner.owner-pid"


class ContainerEngine:
    """Stack images run by Docker Engine or Podman through the docker SDK."""

    def __init__(self, kind: str, *, log: Callable[[str], None] = lambda message: None,
                 images: dict[str, str] | None = None):
        self.name = kind
        self.log = log
        self.client = connect(kind)
        self.is_podman = kind == "podman"
        self.images = dict(images or {})  # stack -> image reference to use as is (no build)
        self._remove_orphans()

    def prepare(self, manifest: StackManifest) -> StackEnvironment:
        """The stack's image: the one given for it, else built (or reused) from its definition."""
        if manifest.name in self.images:
            image = stack_image(self.client, self.images[manifest.name])
            if image.stack != manifest.name:
                raise EngineError(f"image {image.tag} is the {image.stack} stack's image, not {manifest.name}'s")
            self.log(f"using {image.tag} ({image.digest[:19]}) as given, without rebuilding")
        else:
            image = build_stack_image(self.client, manifest, flavour=manifest.variant, log=self.log)
            self.log(f"{manifest.name} image {image.tag} ({image.digest[:19]})")
        return environment_of(manifest, image)

    # --- jobs -------------------------------------------------------------------------------------

    def run(self, env: StackEnvironment, request: StageRequest, *, timeout_s: float,
            kill_when: Callable[[], bool] | None = None, peer: Any = None) -> RunOutcome:
        """Runs the adapter on `request` in a fresh container; SIGKILLs it on timeout or `kill_when()`."""
        out_dir = Path(request.out_dir)
        container = self._create(env, request, peer=peer)
        started = time.monotonic()
        waiter = _Waiter(container)
        try:
            container.start()
            waiter.start()
            killed, timed_out = watch(waiter.done.wait, lambda: _kill(container), timeout_s=timeout_s,
                                      kill_when=kill_when)
            exit_code = waiter.exit_code
        finally:
            stdout, stderr = self._collect_logs(container, out_dir)
            _remove(container)
        return RunOutcome(exit_code=exit_code, killed=killed, timed_out=timed_out,
                          seconds=time.monotonic() - started, stdout=stdout, stderr=stderr)

    def start_service(self, env: StackEnvironment, request: StageRequest, *, ready_timeout_s: float = 300.0,
                      ) -> ContainerService:
        """Starts the adapter's `serve` job in a container and waits for its service.json (url, pid)."""
        out_dir = Path(request.out_dir)
        (out_dir / "service.json").unlink(missing_ok=True)
        container = self._create(env, request, peer=None)
        container.start()
        service = ContainerService(engine=self, container=container, out_dir=out_dir, url="")
        service.url = wait_for_service(out_dir, service.alive, service.stop,
                                       what=f"{env.manifest.name} rollout service", ready_timeout_s=ready_timeout_s)
        return service

    # --- container policy ---------------------------------------------------------------------------

    def _create(self, env: StackEnvironment, request: StageRequest, *, peer: Any) -> Any:
        out_dir, request_path = write_request(request)
        run_dir = run_dir_of(out_dir)
        environment = scrubbed_env(STACK_PREFIX / "bin", out_dir / ".home", request.plan, env.manifest.name,
                                   host_paths=False)
        environment = {key: value for key, value in environment.items() if not key.startswith("PIP_")}
        user = _container_user()
        if os.geteuid() == 0:
            _chown_tree(out_dir, *CONTAINER_USER)
        _check_readable(run_dir, user)
        # /tmp is the job's own TMPDIR in its stage folder, as under the local sandbox: upstreams that write to
        # /tmp by name (verifiers' tool servers put their port files there) work, and nothing leaves the run.
        volumes = {str(run_dir): {"bind": str(run_dir), "mode": "rw"},
                   environment["TMPDIR"]: {"bind": "/tmp", "mode": "rw"}}
        for path in read_only_inputs(request, env.manifest.name, outside=run_dir):
            _check_readable(path, user)
            volumes[str(path)] = {"bind": str(path), "mode": "ro"}
        budget = request.plan.budget
        options: dict[str, Any] = dict(
            image=env.image, command=[env.manifest.adapter, str(request_path)], working_dir=str(out_dir),
            environment=environment, user=user, volumes=volumes, read_only=True,
            # Podman mounts a writable tmpfs on /var/tmp of a read-only container; this one stays read-only.
            tmpfs={"/var/tmp": "ro,size=64k"},
            network_mode=f"container:{peer.container.id}" if peer is not None else "none",
            cap_drop=["ALL"], security_opt=["no-new-privileges"],
            labels={"runner.run-id": request.run_id, "runner.stage": request.stage, "runner.stack": request.stack,
                    LABEL_OWNER: str(os.getpid())},
        )
        if budget.cpus:
            options["nano_cpus"] = int(budget.cpus * 1e9)
        if budget.memory_gb:
            options["mem_limit"] = f"{int(budget.memory_gb * 1024)}m"
        if budget.gpus:
            import docker

            options["device_requests"] = [docker.types.DeviceRequest(count=budget.gpus, capabilities=[["gpu"]])]
        if self.is_podman:
            # Podman's compat API: default ulimits fail with EPERM on these hosts, and any ulimit
            # given must name both nofile and nproc (FIELD-NOTES); its containers.conf sets them.
            options.pop("security_opt")
        else:
            options["init"] = True  # docker-init reaps the adapter's children and forwards SIGTERM
        return self.client.containers.create(**options)

    def _collect_logs(self, container: Any, out_dir: Path) -> tuple[Path, Path]:
        stdout, stderr = out_dir / "stdout.log", out_dir / "stderr.log"
        with contextlib.suppress(Exception):
            stdout.write_bytes(container.logs(stdout=True, stderr=False))
            stderr.write_bytes(container.logs(stdout=False, stderr=True))
        return stdout, stderr

    def _remove_orphans(self) -> None:
        """Removes containers an earlier runner process (now gone) left behind; never anyone else's."""
        for container in self.client.containers.list(all=True, filters={"label": LABEL_OWNER}):
            owner = int(container.labels.get(LABEL_OWNER, "0") or 0)
            if owner and owner != os.getpid() and not _pid_alive(owner):
                _remove(container)


@dataclass
class ContainerService:
    """A running adapter service in its own container (started by us)."""

    engine: ContainerEngine
    container: Any
    out_dir: Path
    url: str

    def alive(self) -> bool:
        with contextlib.suppress(Exception):
            self.container.reload()
            return self.container.status in ("created", "running")
        return False

    def kill_processes(self, pids: list[int]) -> list[int]:
        """Inside the container (every process in it is the service's), with the stack's own Python."""
        script = (f"import json; from runner_contracts.processes import kill_trees; "
                  f"print(json.dumps(kill_trees({[int(pid) for pid in pids]!r})))")
        try:
            code, output = self.container.exec_run([f"{STACK_PREFIX}/bin/python", "-c", script])
        except Exception as error:  # noqa: BLE001 - a container that is gone killed nothing
            raise EngineError(f"cannot reach the service's container to kill {pids}: {error}") from None
        if code != 0:
            raise EngineError(f"killing {pids} in the service's container failed: {output.decode(errors='replace')[-300:]}")
        return json.loads(output.decode().strip().splitlines()[-1])

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, SIGKILL after `grace_s`; logs into the service folder; the container is removed."""
        exit_code = None
        with contextlib.suppress(Exception):
            self.container.stop(timeout=int(grace_s))
            exit_code = self.container.wait(timeout=grace_s + 5).get("StatusCode")
        self.engine._collect_logs(self.container, self.out_dir)
        _remove(self.container)
        return exit_code


class _Waiter(threading.Thread):
    def __init__(self, container: Any):
        super().__init__(daemon=True)
        self.container = container
        self.done = threading.Event()
        self.exit_code: int | None = None

    def run(self) -> None:
        try:
            self.exit_code = self.container.wait().get("StatusCode")
        finally:
            self.done.set()


def environment_of(manifest: StackManifest, image: StackImage) -> StackEnvironment:
    return StackEnvironment(manifest=manifest, path=STACK_PREFIX, python_version=image.python,
                            lock_sha256=image.lock_sha256, image=image.tag, image_digest=image.digest)


def _check_readable(folder: Path, user: str) -> None:
    """Refuses an input the container's user could not read (it would fail deep inside the adapter)."""
    uid = int(user.split(":")[0])
    for path in [folder, *folder.iterdir()] if folder.is_dir() else [folder]:
        mode = path.stat().st_mode
        needed = 0o005 if path.is_dir() else 0o004
        if path.stat().st_uid != uid and mode & needed != needed:
            raise EngineError(f"input {path} is not readable by the container user {user} (mode "
                              f"{oct(mode & 0o777)}); make it world-readable (chmod -R a+rX) to mount it read-only")


def _container_user() -> str:
    uid = os.geteuid()
    return f"{uid}:{os.getegid()}" if uid != 0 else "{}:{}".format(*CONTAINER_USER)


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    for root, dirs, files in os.walk(path):
        os.chown(root, uid, gid)
        for name in files:
            os.chown(os.path.join(root, name), uid, gid)


def _kill(container: Any) -> None:
    with contextlib.suppress(Exception):
        container.kill()


def _remove(container: Any) -> None:
    with contextlib.suppress(Exception):
        container.remove(force=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
