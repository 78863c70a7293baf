"""Apptainer (Singularity) command lines, and definition files converted from the Containerfiles by spython.

Clusters run Apptainer, not Docker. A stack's SIF is built from its docker-archive (the same bytes
the docker engine ran) or from the .def generated here; a job runs with --containall --cleanenv, the
run directory bound read-write, inputs bound read-only, an environment allow-list, --nv for GPUs.
The rendered lines are tested against golden files (tests/golden/apptainer_*) and run for real by the
slow suite under a sid Apptainer (tests/apptainer_host.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from runner_contracts import StageRequest

from .jobs import (
    STACK_PREFIX,
    RunOutcome,
    ServiceHandle,
    StackEnvironment,
    job_env,
    read_only_inputs,
    run_dir_of,
    run_process,
    start_process_service,
    write_request,
)
from .._errors import EngineError
from .._file_hashes import cached_sha256
from .certificates import IMAGE_CERTIFICATES
from .images import LABEL_LOCK, LABEL_STACK
from .._paths import cache_dir
from .._stacks import StackManifest


@dataclass(frozen=True)
class ApptainerJob:
    """One adapter job under Apptainer: what the Slurm executor puts on its run line."""

    sif: Path
    adapter: str
    request: Path
    workdir: Path
    writable: tuple[Path, ...]
    read_only: tuple[Path, ...] = ()
    environment: dict[str, str] = field(default_factory=dict)
    gpus: int = 0
    binary: str = "apptainer"


def job_for_request(manifest: StackManifest, request: StageRequest, sif: Path, run_dir: Path, *,
                    binary: str = "apptainer") -> ApptainerJob:
    """The Apptainer job for one stage request: the same policy as the container engine (run directory
    writable, inputs read-only at their host paths, the allow-listed environment, GPUs from the plan)."""
    out_dir = Path(request.out_dir)
    environment = {**job_env(STACK_PREFIX / "bin", out_dir / ".home", request.plan, manifest.name), **IMAGE_CERTIFICATES}
    return ApptainerJob(sif=sif, adapter=manifest.adapter, request=out_dir / "request.json", workdir=out_dir,
                        writable=(run_dir,), read_only=tuple(read_only_inputs(request, manifest.name, outside=run_dir)),
                        environment=environment,
                        gpus=request.plan.budget.gpus, binary=binary)


class ApptainerEngine:
    """Stack SIFs run with `apptainer exec` on this node (a cluster's compute node under the Slurm executor).

    The SIF of stack S is <sif dir>/S.sif (`runner images export --stack S --to sif`); the binary, SIF
    folder and extra read-only binds come from RUNNER_APPTAINER, RUNNER_SIF_DIR and
    RUNNER_APPTAINER_BINDS, which the Slurm executor exports from the cluster profile. Network
    isolation under Apptainer is the site's (`--net --network none` needs privileges); the probe
    measures and records what a job could reach."""

    name = "apptainer"

    def __init__(self, *, log: Callable[[str], None] = lambda message: None):
        self.binary = os.environ.get("RUNNER_APPTAINER", "apptainer")
        self.sif_dir = Path(os.environ.get("RUNNER_SIF_DIR") or cache_dir() / "sif")
        self.binds = tuple(Path(p) for p in os.environ.get("RUNNER_APPTAINER_BINDS", "").split(":") if p)
        self.log = log

    def prepare(self, manifest: StackManifest) -> StackEnvironment:
        sif = self.sif_dir / f"{manifest.image_name}.sif"
        if shutil.which(self.binary) is None:
            raise EngineError(f"{self.binary} is not installed on this node (RUNNER_APPTAINER names the binary)")
        if not sif.is_file():
            raise EngineError(f"no SIF for {manifest.image_name} at {sif}; make it with `runner images export --stack "
                              f"{manifest.name} --to {'def' if manifest.variant == 'gpu' else 'sif'} --out "
                              f"{self.sif_dir}` (a .def is built into the SIF on the cluster)")
        labels = sif_labels(self.binary, sif)
        if labels.get(LABEL_STACK) != manifest.name:
            raise EngineError(f"{sif} is not a runner image of the {manifest.name} stack (its {LABEL_STACK} label is "
                              f"{labels.get(LABEL_STACK)!r}); make it with `runner images export --stack {manifest.name} "
                              f"--to sif --out {self.sif_dir}`")
        # The lock the SIF was built from, from its image's label: the probe's pins gate compares it with the stack's.
        return StackEnvironment(manifest=manifest, path=STACK_PREFIX, python_version=manifest.python,
                                lock_sha256=labels.get(LABEL_LOCK, ""), image=str(sif),
                                image_digest="sha256:" + cached_sha256(sif))

    def _command(self, env: StackEnvironment, request: StageRequest) -> tuple[list[str], Path]:
        out_dir, _ = write_request(request)
        (out_dir / ".home" / "tmp").mkdir(parents=True, exist_ok=True)  # the job's TMPDIR must exist
        job = job_for_request(env.manifest, request, Path(env.image or ""), run_dir_of(out_dir), binary=self.binary)
        job = replace(job, read_only=job.read_only + self.binds)
        return exec_command(job), out_dir

    def run(self, env: StackEnvironment, request: StageRequest, *, timeout_s: float,
            kill_when: Callable[[], bool] | None = None, peer: Any = None) -> RunOutcome:
        cmd, out_dir = self._command(env, request)
        return run_process(cmd, out_dir, {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, timeout_s=timeout_s,
                           kill_when=kill_when)

    def start_service(self, env: StackEnvironment, request: StageRequest, *, ready_timeout_s: float = 300.0,
                      ) -> ServiceHandle:
        cmd, out_dir = self._command(env, request)
        return start_process_service(cmd, out_dir, {"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                                     what=f"{env.manifest.name} rollout service", ready_timeout_s=ready_timeout_s)


def sif_labels(binary: str, sif: Path) -> dict[str, str]:
    """The SIF's labels (those of the image it was built from, plus Apptainer's own)."""
    result = subprocess.run([binary, "inspect", "--labels", "--json", str(sif)], capture_output=True, text=True,
                            check=False)
    try:
        return dict(json.loads(result.stdout)["data"]["attributes"]["labels"] or {})
    except (ValueError, KeyError, TypeError):
        raise EngineError(f"{binary} inspect --labels {sif} failed (exit {result.returncode}): "
                          + " | ".join(result.stderr.strip().splitlines()[-3:])) from None


def exec_command(job: ApptainerJob) -> list[str]:
    """`apptainer exec --containall --cleanenv [--nv] --bind ... --env ... SIF python -m runner_contracts.launch`."""
    # Apptainer sets HOME itself (an --env HOME is ignored): --home gives the job's private one, in its stage folder.
    home = job.environment.get("HOME")
    options = ["--containall", "--cleanenv", *(["--home", home] if home else ["--no-home"]), "--pwd", str(job.workdir)]
    if job.gpus:
        options.append("--nv")
    for path in job.writable:
        options += ["--bind", f"{path}:{path}:rw"]
    for path in job.read_only:
        options += ["--bind", f"{path}:{path}:ro"]
    for key, value in sorted(job.environment.items()):
        if key != "HOME":
            options += ["--env", f"{key}={value}"]
    return [job.binary, "exec", *options, str(job.sif), str(STACK_PREFIX / "bin" / "python"), "-m",
            "runner_contracts.launch", job.adapter, str(job.request)]


def build_from_archive_command(sif: Path, archive: Path, binary: str = "apptainer",
                               mksquashfs_args: str | None = None) -> list[str]:
    """SIF from a `docker save` archive: the image the docker engine qualified, byte for byte
    (`mksquashfs_args`, e.g. "-comp lz4", trade the SIF's size for its build time)."""
    extra = ["--mksquashfs-args", mksquashfs_args] if mksquashfs_args else []
    return [binary, "build", "--force", *extra, str(sif), f"docker-archive://{archive}"]


def build_from_definition_command(sif: Path, definition: Path, binary: str = "apptainer") -> list[str]:
    return [binary, "build", "--force", "--fakeroot", str(sif), str(definition)]


def definition(manifest: StackManifest, containerfile: Path, buildargs: dict[str, str], *,
               base_containerfile: Path | None = None, base_args: dict[str, str] | None = None,
               context: Path | None = None) -> str:
    """The stack's Containerfile as an Apptainer definition (spython's converter), build arguments
    substituted, for clusters that build images from definitions rather than archives. With a base
    definition (the GPU base), its steps come first, so the .def bootstraps from the pinned CUDA image
    itself rather than from a local base tag a cluster cannot pull."""
    from spython.main.parse.parsers import DockerParser
    from spython.main.parse.writers import SingularityWriter

    def rendered(path: Path, args: dict[str, str]) -> list[str]:
        text = path.read_text()
        for key, value in sorted(args.items(), key=lambda item: -len(item[0])):
            text = text.replace("${" + key + "}", value).replace("$" + key, value)
        # ARGs are substituted; Apptainer runs jobs as the calling user, so USER has no counterpart.
        return [line for line in text.splitlines() if not line.startswith(("ARG ", "USER ", "#"))]

    lines = rendered(containerfile, buildargs)
    if base_containerfile is not None:
        lines = rendered(base_containerfile, base_args or {}) + [line for line in lines if not line.startswith("FROM ")]
    with tempfile.TemporaryDirectory(prefix="runner-def-") as scratch:
        path = Path(scratch) / "Containerfile"
        path.write_text("\n".join(lines) + "\n")
        # spython checks %files sources relative to the working directory: the build context.
        with contextlib.chdir(context or scratch):
            recipe = DockerParser(str(path)).recipe  # the constructor parses
    sources = " + ".join(p.name for p in (base_containerfile, containerfile) if p is not None)
    header = (f"# Apptainer definition of the {manifest.name} stack image, generated by `runner images export`\n"
              f"# from {sources}; %files paths are relative to the build context written beside it.\n")
    return header + SingularityWriter(recipe).convert() + "\n"


def run_build(command: list[str]) -> None:
    """Runs an apptainer build line; refuses clearly when the binary is not installed."""
    if shutil.which(command[0]) is None:
        raise EngineError(f"{command[0]} is not installed here; on a machine that has it, run:\n  "
                          + shlex.join(command))
    result = subprocess.run(command, capture_output=True, text=True, check=False, env={**os.environ})
    if result.returncode != 0:
        raise EngineError(f"{shlex.join(command)} failed (exit {result.returncode}): "
                          + " | ".join(result.stderr.strip().splitlines()[-5:]))
