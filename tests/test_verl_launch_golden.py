"""Golden test of the lightning-verl arm's GPU launch: the verl GRPO command rendered from the calc-tool
plan and a one-GPU vLLM profile. The renderer is stdlib-only, so this runs anywhere; composing the
rendered overrides against verl's real config needs the stack environment (slow test below).
Regenerate the golden file after a reviewed change with UPDATE_GOLDEN=1."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from conftest import matches_golden
from runner_contracts import freeze_plan

from runner.api import load_plan

ROOT = Path(__file__).resolve().parents[1]
MODULE_PATH = ROOT / "stacks/lightning-verl/adapter/src/runner_stack_lightning_verl/verl_launch.py"


def _module():
    spec = importlib.util.spec_from_file_location("verl_launch", MODULE_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["verl_launch"] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


def _launch(module):
    plan = msgspec.to_builtins(freeze_plan(load_plan(ROOT / "qualification/plans/calc-tool-cpu.yaml")))
    profile = module.GpuProfile(gpus_per_node=1, nnodes=1, rollout_engine="vllm", tensor_parallel=1,
                                gpu_memory_utilization=0.5)
    evidence = module.Evidence(out_dir="/run/stages/train", run_id="20261130T120000Z-lightning-verl-calc-tool",
                               stack="lightning-verl", stage="train", initial_revision="ab" * 32)
    return module.VerlLaunch.from_plan(plan, model_path="/ckpt/qwen2.5-0.5b-instruct",
                                       agl_base_url="http://127.0.0.1:45123", checkpoint_dir="/run/stages/train/verl",
                                       profile=profile, evidence=evidence)


def test_golden_verl_launch_command_for_one_gpu():
    module = _module()
    command = _launch(module).command(python="python3", plan_path="/run/plan.json")
    rendered = " \\\n  ".join([" ".join(command[:5]), *command[5:]]) + "\n"  # the program, then one override a line
    matches_golden("verl_launch_calc_tool_gpu.txt", rendered)


@pytest.mark.slow
def test_golden_overrides_compose_against_verl_config():
    """Every rendered override names a key of verl 0.9.1's config (Hydra refuses unknown keys) and lands."""
    from runner.api import LocalEngine, get_stack

    env = LocalEngine().prepare(get_stack("lightning-verl"))
    overrides = _launch(_module()).overrides()
    script = ("import json, sys; from omegaconf import OmegaConf; "
              "from runner_stack_lightning_verl.verl_launch import compose; "
              "c = compose(json.loads(sys.argv[1])); "
              "print(json.dumps(OmegaConf.to_container(c.actor_rollout_ref.rollout, resolve=False) | "
              "{'adv': c.algorithm.adv_estimator, 'batch': c.data.train_batch_size, "
              "'steps': c.trainer.total_training_steps, 'agl': c.agentlightning.agl_base_url, "
              "'key': OmegaConf.to_container(c.agentlightning, resolve=False)['agl_key'], "
              "'save': list(c.actor_rollout_ref.actor.checkpoint.save_contents), "
              "'runner': OmegaConf.to_container(c.runner)}))")
    out = subprocess.run([str(env.python), "-c", script, json.dumps(overrides)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    composed = json.loads(out.stdout.splitlines()[-1])
    assert (composed["adv"], composed["batch"], composed["steps"]) == ("grpo", 8, 8)
    assert (composed["name"], composed["n"], composed["top_k"]) == ("vllm", 4, -1)
    assert composed["temperature"] == 1.3 and composed["agl"] == "http://127.0.0.1:45123"
    assert composed["key"] == "${oc.env:RUNNER_AGL_KEY}"  # resolved inside the launch, never on the command line
    assert "hf_model" in composed["save"]  # the contract checkpoints are made from verl's HF save
    assert composed["runner"] == {"out_dir": "/run/stages/train", "run_id": "20261130T120000Z-lightning-verl-calc-tool",
                                  "stack": "lightning-verl", "stage": "train", "initial_revision": "ab" * 32}


def test_resumed_launch_hands_verl_its_own_checkpoint_folder():
    module = _module()
    launch = _launch(module)
    fresh = launch.overrides()
    resumed = module.VerlLaunch(**{**launch.__dict__, "resume_from": "/run/stages/resume/interrupted/checkpoints/"
                                                                     "checkpoint-1/global_step_1"}).overrides()
    assert "trainer.resume_mode=disable" in fresh and not any("resume_from_path" in o for o in fresh)
    assert [o for o in resumed if o.startswith("trainer.resume")] == [
        "trainer.resume_mode=resume_path",
        "trainer.resume_from_path=/run/stages/resume/interrupted/checkpoints/checkpoint-1/global_step_1"]
    assert [o for o in resumed if "resume" not in o] == [o for o in fresh if "resume" not in o]


def test_hydra_string_keeps_quotes_and_backslashes_in_one_value():
    module = _module()
    assert module.hydra_string("a'b\\c") == "'a\\'b\\\\c'"
