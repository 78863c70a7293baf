"""The local engine: one virtualenv per stack, keyed by lock hash, under the user cache.

The heavy part (the stack's lock) is installed once per (lock, Python); our own small packages
(contracts, tasks, the kit, the adapter) are reinstalled whenever their content hash changes. Jobs run
through the shared job runner (jobs.py): own session, allow-listed environment, logs to files, a
wall-clock limit that kills the whole group.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from runner_contracts import StageRequest

from .._errors import EngineError
from .._paths import cache_dir, local_packages
from .._stacks import VCS_PIN, StackManifest, vcs_pins
from .jobs import (
    RunOutcome,
    ServiceHandle,
    StackEnvironment,
    file_lock,
    read_only_inputs,
    run_dir_of,
    run_process,
    scrubbed_env,
    start_process_service,
    tree_hash,
    write_request,
)
from .sandbox import Sandbox, local_sandbox

ENV_MARKER = ".runner-env.json"
LOCAL_MARKER = ".runner-local.json"


@functools.cache
def find_python(version: str) -> tuple[Path, str]:
    """An interpreter whose version starts with `version` (e.g. "3.11"), and its full version: the one running
    the runner when it is that version (asked nothing), else the first on PATH, /usr/bin, /usr/local/bin or
    pyenv's versions that says it is (a PATH entry may be a pyenv shim, slow to start)."""
    own = platform.python_version()
    base = Path(getattr(sys, "_base_executable", "") or sys.executable)
    if (own.startswith(version + ".") or own == version) and os.access(base, os.X_OK):
        return base, own
    candidates = [shutil.which(f"python{version}"), f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    candidates += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")),
                         reverse=True)
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            full = subprocess.run([candidate, "-c", "import platform; print(platform.python_version())"],
                                  capture_output=True, text=True, check=False).stdout.strip()
            if full.startswith(version + ".") or full == version:
                return Path(candidate), full
    raise EngineError(f"no Python {version} interpreter found (looked for python{version} on PATH, /usr/bin, "
                      "~/.pyenv/versions); install it or change the stack's manifest")


def _run_logged(cmd: list[str], log: Path, what: str) -> None:
    with open(log, "a") as handle:
        handle.write(f"$ {' '.join(cmd)}\n")
        handle.flush()
        result = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False)
    if result.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise EngineError(f"{what} failed (exit {result.returncode}); log: {log}\n{tail}")


class LocalEngine:
    """Per-stack virtualenvs on this host (the embedded default)."""

    name = "local"

    def __init__(self, cache_root: Path | None = None, log: Callable[[str], None] = lambda message: None, *,
                 host_network: bool = False):
        """`host_network`: jobs share the host's network namespace (for a caller on the host that talks to a
        job's service itself, as the stack tests do); their files stay confined."""
        self.root = (cache_root or cache_dir()) / "envs"
        self.log = log
        self.host_network = host_network

    def environment_key(self, manifest: StackManifest, python_version: str) -> str:
        digest = hashlib.sha256(manifest.lock_bytes())
        digest.update("\0".join(manifest.pip_args).encode())
        digest.update(f"\0{python_version}\0{platform.machine()}\0{sys.platform}".encode())
        return digest.hexdigest()[:16]

    def env_path(self, manifest: StackManifest, python_version: str) -> Path:
        """Where the stack's environment for this Python lives (built or not)."""
        return self.root / f"{manifest.image_name}-{self.environment_key(manifest, python_version)}"

    def prepare(self, manifest: StackManifest) -> StackEnvironment:
        """Builds or reuses the stack's environment and brings our local packages up to date."""
        interpreter, python_version = find_python(manifest.python)
        path = self.env_path(manifest, python_version)
        log = path.with_name(path.name + ".build.log")
        with file_lock(path.with_name(path.name + ".lock")):
            if not (path / ENV_MARKER).is_file():
                self.log(f"building {manifest.name} environment (Python {python_version}, lock "
                         f"{manifest.lock_sha256[:12]}) in {path}")
                shutil.rmtree(path, ignore_errors=True)
                log.write_text("")
                _run_logged([str(interpreter), "-m", "venv", str(path)], log, "creating the virtualenv")
                pip = [str(path / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
                       *manifest.pip_args]
                direct = [f"{name} @ {url}@{commit}" for name, (url, commit) in vcs_pins(manifest.lock).items()]
                with tempfile.TemporaryDirectory(prefix="runner-lock-") as scratch:
                    hashed = Path(scratch) / "hashed.lock"  # pip's hash-checking mode takes no git pins
                    hashed.write_text("".join(line + "\n" for line in manifest.lock.read_text().splitlines()
                                              if not VCS_PIN.match(line)))
                    _run_logged([*pip, "--require-hashes", "-r", str(hashed)], log,
                                f"installing the {manifest.name} lock")
                if direct:  # each pinned to a commit, the repository's content address
                    _run_logged([*pip, *direct], log, f"installing the {manifest.name} lock's git pins")
                marker = {"lock_sha256": manifest.lock_sha256, "python": python_version, "built_at": time.time()}
                (path / ENV_MARKER).write_text(json.dumps(marker))
            else:
                self.log(f"reusing {manifest.name} environment {path}")
            sources = [*local_packages().values(), manifest.adapter_package]
            source_hash = tree_hash(sources)
            marker_path = path / LOCAL_MARKER
            if not marker_path.is_file() or json.loads(marker_path.read_text()).get("sha256") != source_hash:
                self.log(f"installing contracts, tasks and the {manifest.name} adapter into {path.name}")
                # Build from clean copies: setuptools leaves build/ in the source tree, and a stale
                # build/lib would ship modules that no longer exist.
                with tempfile.TemporaryDirectory(prefix="runner-src-") as scratch:
                    copies = [shutil.copytree(src, Path(scratch) / src.name,
                                              ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
                              for src in sources]
                    _run_logged([str(path / "bin" / "python"), "-m", "pip", "install", "--no-deps",
                                 "--no-build-isolation", "--force-reinstall", "--disable-pip-version-check",
                                 "--no-cache-dir", *manifest.pip_args, *map(str, copies)], log,
                                "installing local packages")
                marker_path.write_text(json.dumps({"sha256": source_hash}))
        return StackEnvironment(manifest=manifest, path=path, python_version=python_version,
                                lock_sha256=manifest.lock_sha256)

    @property
    def sandbox(self) -> Sandbox:
        return local_sandbox()

    def run(self, env: StackEnvironment, request: StageRequest, *, timeout_s: float,
            kill_when: Callable[[], bool] | None = None, peer: ServiceHandle | None = None) -> RunOutcome:
        """Runs the adapter on `request` in its output folder, in the sandbox; kills the group on timeout or
        `kill_when()`. With `peer` (the arm's rollout service) the job joins its network namespace."""
        out_dir, request_path = write_request(request)
        environment = scrubbed_env(env.path / "bin", out_dir / ".home", request.plan, env.manifest.name)
        cmd = self._sandboxed(env, request, out_dir, request_path, environment, peer)
        return run_process(cmd, out_dir, environment, timeout_s=timeout_s, kill_when=kill_when,
                           preexec=self.sandbox.preexec)

    def start_service(self, env: StackEnvironment, request: StageRequest, *, ready_timeout_s: float = 300.0,
                      ) -> ServiceHandle:
        """Starts the adapter's long-running `serve` job in the sandbox and waits for its service.json."""
        out_dir, request_path = write_request(request)
        environment = scrubbed_env(env.path / "bin", out_dir / ".home", request.plan, env.manifest.name)
        return start_process_service(self._sandboxed(env, request, out_dir, request_path, environment), out_dir,
                                     environment,
                                     what=f"{env.manifest.name} rollout service", ready_timeout_s=ready_timeout_s,
                                     preexec=self.sandbox.preexec)

    def _sandboxed(self, env: StackEnvironment, request: StageRequest, out_dir: Path, request_path: Path,
                   environment: dict[str, str], peer: ServiceHandle | None = None) -> list[str]:
        run_dir = run_dir_of(out_dir)
        # the hashed CA directory is in the sandbox's view of / unless it lies under /tmp, which the job's own replaces
        certificates = Path(environment.get("SSL_CERT_DIR", "/"))
        certificates = [certificates] if certificates.is_relative_to("/tmp") and certificates.is_dir() else []
        return self.sandbox.command(
            [str(env.python), "-m", "runner_contracts.launch", env.manifest.adapter, str(request_path)],
            run_dir=run_dir, cwd=out_dir, tmp=out_dir / ".home" / "tmp",
            read_only=[env.path, *certificates, *read_only_inputs(request, env.manifest.name, outside=run_dir)],
            peer_pid=peer.process.pid if peer is not None else None, host_network=self.host_network)
