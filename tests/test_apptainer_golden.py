"""Golden tests of the Apptainer engine's rendered lines and definition file. There is no Apptainer
binary on these machines (none in Debian or on PyPI), so what a cluster would run is compared with
reviewed expected files under tests/golden/. Regenerate after a reviewed change with UPDATE_GOLDEN=1."""

from __future__ import annotations

import shlex
from pathlib import Path

import msgspec
import pytest
from conftest import matches_golden
from runner_contracts import StageRequest, freeze_plan

from runner._engines.apptainer import (
    build_from_archive_command,
    build_from_definition_command,
    definition,
    exec_command,
    job_for_request,
    run_build,
)
from runner._engines.images import STACK_DEFINITION, base_for, context_inputs
from runner.api import EngineError, get_stack, load_plan

ROOT = Path(__file__).resolve().parents[1]


def request(stage: str, gpus: int, **fields) -> StageRequest:
    plan = freeze_plan(load_plan(ROOT / "qualification" / "plans" / "calc-tool-cpu.yaml"))
    plan = msgspec.structs.replace(plan, budget=msgspec.structs.replace(plan.budget, gpus=gpus))
    return StageRequest(run_id="r1", stack="trl", stage=stage, plan=plan, out_dir=f"/scratch/runs/r1/stages/{stage}",
                        policy_dir="/shared/ckpt/qwen2.5-0.5b", **fields)


def rendered(stage: str, gpus: int, binary: str = "apptainer", **fields) -> str:
    """The exec line, one option (with its value) per line, as a reviewer reads it."""
    job = job_for_request(get_stack("trl"), request(stage, gpus, **fields), Path("/shared/sif/trl-abc.sif"),
                          Path("/scratch/runs/r1"), binary=binary)
    parts, lines = exec_command(job), []
    while parts:
        take = 2 if parts[0] in ("--bind", "--env", "--home", "--pwd") or len(lines) == 0 else 1
        lines.append(" ".join(shlex.quote(p) for p in parts[:take]))
        parts = parts[take:]
    return " \\\n  ".join(lines) + "\n"


def test_golden_exec_line_gpu_update():
    """GPU job: --nv, --containall, --cleanenv, run dir rw, policy ro, allow-listed environment."""
    line = rendered("update", gpus=1)
    for flag in ("--containall", "--cleanenv", "--nv", "--bind /scratch/runs/r1:/scratch/runs/r1:rw",
                 "--bind /shared/ckpt/qwen2.5-0.5b:/shared/ckpt/qwen2.5-0.5b:ro"):
        assert flag in line
    matches_golden("apptainer_exec_gpu_update.txt", line)


def test_golden_exec_line_cpu_resume_with_singularity_binary():
    """CPU job (no --nv), the binary named `singularity`; a checkpoint inside the run dir needs no extra bind."""
    line = rendered("train", gpus=0, binary="singularity",
                    resume_from="/scratch/runs/r1/stages/resume/interrupted/checkpoints/checkpoint-1")
    assert line.startswith("singularity exec \\\n") and "--nv" not in line
    matches_golden("apptainer_exec_cpu_resume.txt", line)


def test_a_job_in_a_stack_image_gets_the_images_certificates_not_the_hosts_bundle(tmp_path, monkeypatch):
    """Apptainer, Docker and Podman jobs: the image's hashed CA directory (read lazily: an HTTP client's SSL
    context costs no bundle parse), never the host's SSL_CERT_FILE, a host path the image may not have."""
    from runner._engines.jobs import scrubbed_env

    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "host-only-bundle.pem"))
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    apptainer = job_for_request(get_stack("trl"), request("train", 0), Path("/shared/sif/trl-abc.sif"),
                                Path("/scratch/runs/r1")).environment
    container = scrubbed_env(Path("/opt/stack/bin"), tmp_path / "home", host_paths=False)
    for environment in (apptainer, container):
        assert environment["SSL_CERT_DIR"] == "/etc/ssl/certs" and "SSL_CERT_FILE" not in environment


def test_golden_build_lines():
    archive = build_from_archive_command(Path("/shared/sif/trl-abc.sif"), Path("/shared/images/runner-trl-abc.tar"))
    from_def = build_from_definition_command(Path("trl.sif"), Path("trl.def"), binary="singularity")
    lz4 = build_from_archive_command(Path("trl.sif"), Path("trl.tar"), mksquashfs_args="-comp lz4")
    matches_golden("apptainer_build.txt", "".join(shlex.join(line) + "\n" for line in (archive, from_def, lz4)))


def test_golden_definition_file_of_the_trl_gpu_image():
    """Bootstraps from the pinned CUDA image (the GPU base's steps, then the stack's), not a local tag."""
    base = base_for(get_stack("trl"), "gpu")
    buildargs = context_inputs(get_stack("trl"), base.tag, [], "gpu")["buildargs"]  # as `images export --to def`
    text = definition(get_stack("trl"), STACK_DEFINITION, buildargs, base_containerfile=base.definition,
                      base_args={"CUDA_IMAGE": base.image, "PYTHON": "3.11"})
    assert f"From: {base.image}" in text and "runner-base" not in text
    assert "%post" in text and "%labels" in text and "python3.11-venv" in text
    matches_golden("apptainer_trl_gpu.def", text)


def test_sif_build_without_apptainer_says_what_to_run():
    with pytest.raises(EngineError, match="not installed here; on a machine that has it, run:"):
        run_build(["apptainer-not-installed", "build", "x.sif", "docker-archive:///x.tar"])


def test_an_apptainer_job_gets_its_private_tmpdir_created(tmp_path, monkeypatch):
    """--containall gives the job no /tmp of the host: TMPDIR points into the stage folder and must exist."""
    from runner._engines.apptainer import ApptainerEngine
    from runner._engines.jobs import STACK_PREFIX, StackEnvironment

    monkeypatch.setenv("RUNNER_SIF_DIR", str(tmp_path / "sif"))
    stage = tmp_path / "run" / "stages" / "probe"
    env = StackEnvironment(manifest=get_stack("trl"), path=STACK_PREFIX, python_version="3.11", lock_sha256="0" * 64,
                           image=str(tmp_path / "sif" / "trl.sif"))
    job = msgspec.structs.replace(request("probe", 0), out_dir=str(stage))
    command, out_dir = ApptainerEngine()._command(env, job)
    assert out_dir == stage and (stage / ".home" / "tmp").is_dir()
    assert f"TMPDIR={stage / '.home' / 'tmp'}" in command and (stage / "request.json").is_file()


def test_inputs_reached_through_a_symlink_are_mounted_at_the_name_the_job_uses(tmp_path):
    """A cache linked elsewhere (~/.cache -> /scratch/...): the job opens the policy by the linked name, so
    that is where containers and SIFs must see it (found when a linked cache failed inside docker)."""
    from conftest import CALC_PLAN

    from runner._engines.jobs import read_only_inputs
    from runner.api import load_plan

    real = tmp_path / "scratch" / "policies" / "tiny"
    real.mkdir(parents=True)
    (tmp_path / "cache").symlink_to(tmp_path / "scratch")
    linked = tmp_path / "cache" / "policies" / "tiny"
    run_dir = tmp_path / "run"
    request = StageRequest(run_id="r", stack="trl", stage="rollout", plan=load_plan(CALC_PLAN),
                           out_dir=str(run_dir / "s"), policy_dir=str(linked),
                           options={"trained_policy": str(run_dir / "stages" / "train" / "c")})
    # the linked name, not the resolved one; the run directory's own input is mounted with the run directory
    assert read_only_inputs(request, request.stack, outside=run_dir) == [linked]


def test_a_distillation_teachers_policy_is_an_input_every_job_can_read(tmp_path):
    """The distill stage's teacher lives in the policy cache like the student; a sandbox or container that
    mounts only the student's path fails to load it (found with a cache under /tmp, which the sandbox hides)."""
    from runner._engines.jobs import read_only_inputs
    from runner.api import load_plan

    plan = load_plan(Path(__file__).resolve().parents[1] / "qualification" / "plans" / "calc-tool-distill-cpu.yaml")
    teacher = tmp_path / "cache" / "policies" / "teacher"
    plan = msgspec.structs.replace(plan, distill=msgspec.structs.replace(
        plan.distill, teacher=msgspec.structs.replace(plan.distill.teacher, path=str(teacher))))
    request = StageRequest(run_id="r", stack="trl", stage="distill", plan=plan, out_dir=str(tmp_path / "run" / "s"),
                           policy_dir=str(tmp_path / "cache" / "policies" / "student"))
    assert read_only_inputs(request, request.stack, outside=tmp_path / "run") == [
        tmp_path / "cache" / "policies" / "student", teacher]
