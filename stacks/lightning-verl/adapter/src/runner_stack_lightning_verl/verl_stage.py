"""The update and train stages on GPU plans: verl's GRPO trainer through Agent Lightning, in this stack's GPU
environment (requirements-gpu.lock: torch, vLLM).

One stage job runs three things on the node, all bound to 127.0.0.1:
1. agl-server (gateway + store; the same Gateway as on CPU), configured with the policy path as its model
   name (verl registers its vLLM servers under actor_rollout_ref.model.path);
2. the StoreWorker, which runs each rollout verl enqueues with the unmodified team harness and posts the
   reference scorer's reward;
3. `python -m runner_stack_lightning_verl.verl_launch` (VerlLaunch.command(): the rendered, golden-tested
   config), whose trainer writes trajectories.jsonl, training.jsonl, steps.json and
   checkpoints/checkpoint-N/ as it goes (verl_evidence).

The result names the trainer (verl), each step's policy loss and the store worker's rollout ledger; the
host audits the files as for every arm and checks the ledger against them. A resumed stage (`resume_from`
= a published checkpoint) hands verl its own global_step folder inside that checkpoint.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import msgspec

from runner_contracts import RolloutLedger, StageRequest, StageResult, sha256_file

from .backend import LightningBackend
from .store_worker import StoreWorker
from .verl_evidence import read_steps, verl_folder_of
from .verl_launch import KEY_VARIABLE, Evidence, GpuProfile, VerlLaunch

class GpuUnavailable(RuntimeError):
    """verl's trainer cannot run in this environment or on this machine."""


def check_gpu_environment() -> list[str]:
    """The GPUs verl would use; raises GpuUnavailable naming what is missing."""
    missing = [name for name in ("torch", "vllm", "ray") if importlib.util.find_spec(name) is None]
    if missing:
        raise GpuUnavailable(
            f"verl's GRPO trainer needs torch, vLLM and Ray; this environment lacks {', '.join(missing)}. It is "
            "built from the CPU lock (requirements.lock); GPU plans (budget.gpus > 0) run this arm's training "
            "stages in the GPU environment built from requirements-gpu.lock")
    import torch

    if not torch.cuda.is_available():
        raise GpuUnavailable("the plan asks for GPUs (budget.gpus > 0) but torch sees no CUDA device here")
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def run_verl_stage(request: StageRequest) -> StageResult:
    plan, out = request.plan, Path(request.out_dir)
    gpus = check_gpu_environment()
    if len(gpus) < plan.budget.gpus:
        raise GpuUnavailable(f"the plan asks for {plan.budget.gpus} GPU(s), this node has {len(gpus)}: {gpus}")
    assert request.policy_dir, "the host always sends the policy"
    resume = Path(request.resume_from) if request.resume_from else None
    plan_path = out / "plan.json"
    plan_path.write_bytes(msgspec.json.encode(plan))
    backend = LightningBackend()
    backend.gateway.model = request.policy_dir
    backend.gateway.temperature = float(plan.sampling.temperature)
    backend.start()
    worker = StoreWorker(backend, model=request.policy_dir, max_turns=plan.budget.max_turns).start()
    launch = VerlLaunch.from_plan(
        msgspec.to_builtins(plan), model_path=request.policy_dir, agl_base_url=backend.gateway.url,
        checkpoint_dir=str(out / "verl"), profile=GpuProfile(gpus_per_node=plan.budget.gpus), steps=request.steps,
        resume_from=str(verl_folder_of(resume)) if resume else None,
        evidence=Evidence(out_dir=str(out), run_id=request.run_id, stack=request.stack, stage=request.stage,
                          initial_revision=sha256_file((resume or Path(request.policy_dir)) / "model.safetensors")))
    log = out / "verl.log"
    try:
        with open(log, "wb") as handle:
            process = subprocess.run(launch.command(sys.executable, str(plan_path)), cwd=out, stdout=handle,
                                     stderr=subprocess.STDOUT, env={**os.environ, KEY_VARIABLE: backend.gateway.key})
    finally:
        worker.stop()
        backend.stop()
    steps = read_steps(out)
    if process.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"verl's trainer exited with {process.returncode} after {len(steps)} step(s) "
                           f"(log: {log}):\n{tail}")
    return StageResult(stage=request.stage, metrics={
        "trainer": "verl", "gpus": gpus, "loss": [step["loss"] for step in steps], "steps": steps,
        "launch": launch.command("python", "plan.json"),
    }, files={"trajectories": "trajectories.jsonl", "training": "training.jsonl", "log": "verl.log",
              "steps": "steps.json"},
        rollout_ledger=RolloutLedger(**dataclasses.asdict(worker.counts),
                                     worker_error=None if worker.error is None else repr(worker.error)))

