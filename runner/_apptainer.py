"""Apptainer (Singularity) command lines and definition files, rendered with spython.

Clusters run Apptainer, not Docker. A stack's SIF is built from its docker-archive (the same bytes
the docker engine ran) or from the .def generated here; a job runs with --containall --cleanenv, the
run directory bound read-write, inputs bound read-only, an environment allow-list, --nv for GPUs.
No Apptainer binary exists on the machines this project is developed on, so these lines are tested
against golden files (tests/golden/apptainer_*)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from runner_contracts import StageRequest

from ._engine import FIXED_ENV, read_only_inputs
from ._errors import EngineError
from ._stacks import StackManifest

STACK_PYTHON = "/opt/stack/bin/python"


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
    home = out_dir / ".home"
    environment = {**FIXED_ENV, "LANG": "C.UTF-8", "HOME": str(home), "HF_HOME": str(home / "hf"),
                   "XDG_CACHE_HOME": str(home / "cache"), "TMPDIR": str(home / "tmp"),
                   "PATH": f"{Path(STACK_PYTHON).parent}:/usr/local/bin:/usr/bin:/bin"}
    inputs = tuple(p for p in read_only_inputs(request) if not str(p).startswith(str(run_dir) + os.sep))
    return ApptainerJob(sif=sif, adapter=manifest.adapter, request=out_dir / "request.json", workdir=out_dir,
                        writable=(run_dir,), read_only=inputs, environment=environment,
                        gpus=request.plan.budget.gpus, binary=binary)


def _client():
    from spython.main import Client

    client = Client
    client.quiet = False
    client.debug = False
    return client


def exec_command(job: ApptainerJob) -> list[str]:
    """`apptainer exec --containall --cleanenv [--nv] --bind ... --env ... SIF python -m runner_contracts.launch`."""
    options = ["--containall", "--cleanenv", "--no-home", "--pwd", str(job.workdir)]
    if job.gpus:
        options.append("--nv")
    for path in job.writable:
        options += ["--bind", f"{path}:{path}:rw"]
    for path in job.read_only:
        options += ["--bind", f"{path}:{path}:ro"]
    for key, value in sorted(job.environment.items()):
        options += ["--env", f"{key}={value}"]
    command = _client()._init_command("exec")
    command[0] = job.binary  # spython always says `singularity`; clusters name either
    return [*command, *options, str(job.sif), STACK_PYTHON, "-m", "runner_contracts.launch", job.adapter, str(job.request)]


def build_from_archive_command(sif: Path, archive: Path, binary: str = "apptainer") -> list[str]:
    """SIF from a `docker save` archive: the image the docker engine qualified, byte for byte."""
    command = _client()._init_command("build")
    command[0] = binary
    return [*command, "--force", str(sif), f"docker-archive://{archive}"]


def build_from_definition_command(sif: Path, definition: Path, binary: str = "apptainer") -> list[str]:
    command = _client()._init_command("build")
    command[0] = binary
    return [*command, "--force", "--fakeroot", str(sif), str(definition)]


def definition(manifest: StackManifest, containerfile: Path, buildargs: dict[str, str]) -> str:
    """The stack's Containerfile as an Apptainer definition (spython's converter), build arguments
    substituted, for clusters that build images from definitions rather than archives."""
    from spython.main.parse.parsers import DockerParser
    from spython.main.parse.writers import SingularityWriter

    text = containerfile.read_text()
    for key, value in sorted(buildargs.items(), key=lambda item: -len(item[0])):
        text = text.replace("${" + key + "}", value).replace("$" + key, value)
    # ARGs are substituted above; Apptainer runs jobs as the calling user, so USER has no counterpart.
    lines = [line for line in text.splitlines() if not line.startswith(("ARG ", "USER ", "#"))]
    with tempfile.TemporaryDirectory(prefix="runner-def-") as scratch:
        rendered = Path(scratch) / "Containerfile"
        rendered.write_text("\n".join(lines) + "\n")
        recipe = DockerParser(str(rendered)).recipe  # the constructor parses
    header = (f"# Apptainer definition of the {manifest.name} stack image, generated by `runner images export`\n"
              f"# from {containerfile.name}; %files paths are relative to the build context it writes.\n")
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
