"""Tiny checkpoints of three model families (Qwen2 with hermes calls, Llama 3.1 with llama3_json calls,
Mistral with [TOOL_CALLS]), checked inside the trl stack's environment with its pinned transformers and
TRL: each family's template renders a call exactly as its format writes it, the SFT mask covers the
assistant's turns and nothing else, TRL's multi-turn parser and the policy server's parser read the call
back from the sampled ids, and a built tokenizer reloads with the same ids. With RUNNER_TEST_ALL_FAMILIES=1
(`make test-families`), the tiny Llama and Mistral each pass every gate of four arms' service, rollout and
update (the Qwen2 is the session comparison's).

Slow: needs the trl environment (built once, cached under RUNNER_CACHE_DIR).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CALC_PLAN, stage_evidence
from runner_contracts import TOOL_CALL_MARKERS

from runner.api import LocalEngine, get_stack

pytestmark = pytest.mark.slow

CHECK = r'''
import json, sys, tempfile
from runner_contracts import TinyRecipe
from runner_kit.tool_formats import completion_text, parse_tool_calls, render_tool_calls
from runner_stack_trl.chat_formats import with_response_parser
from runner_stack_trl.policy import build_tokenizer, demonstration_ids, _check_reload, training_chat_template
from qualification.tasks import get_family
from trl.chat_template_utils import parse_response
from transformers import AutoTokenizer

family, tool_format = sys.argv[1], sys.argv[2]
recipe = TinyRecipe(model_family=family, demos_per_family=30)
tokenizer = build_tokenizer(recipe)
calc = get_family("calc-tool")
item = calc.generate("train", 1, 0)[0]
ids, mask = demonstration_ids(tokenizer, "calc-tool", item, training_chat_template(tokenizer))
call = [("rechner", {"ausdruck": item.reference["expression"]})]
answer = f"Antwort: {item.reference['answer']}"
written = render_tool_calls(call, tool_format)
tools = [{"type": "function", "function": {"name": "rechner", "description": "d", "parameters": {
    "type": "object", "properties": {"ausdruck": {"type": "string"}}, "required": ["ausdruck"]}}}]
messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
prefix = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True,
                                       return_dict=False)
sampled = tokenizer.encode(written, add_special_tokens=False) + [tokenizer.eos_token_id]
with_call = messages + [{"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "rechner", "arguments": call[0][1]}}]}]
rendered = tokenizer.apply_chat_template(with_call, tools=tools, tokenize=True, return_dict=False)
trl_parsed = parse_response(with_response_parser(tokenizer, tool_format), sampled, prefix=prefix, tools=tools)
with tempfile.TemporaryDirectory() as folder:
    tokenizer.save_pretrained(folder)
    _check_reload(folder, tokenizer, ids)
    reloaded_template = AutoTokenizer.from_pretrained(folder).chat_template
print(json.dumps({
    "masked": tokenizer.decode([t for t, m in zip(ids, mask) if m]),
    "eos": tokenizer.eos_token, "written": written, "answer": answer, "arguments": call[0][1],
    "template_writes_the_format": rendered[: len(prefix) + len(sampled)] == prefix + sampled,
    "server_parse": parse_tool_calls(completion_text(tokenizer, sampled, tool_format), tool_format)[1],
    "trl_parse": trl_parsed.get("tool_calls"),
    "same_template": reloaded_template == tokenizer.chat_template,
    "first": tokenizer.convert_ids_to_tokens(ids[0]),
}))
'''


@pytest.fixture(scope="module")
def trl_env():
    return LocalEngine().prepare(get_stack("trl"))


@pytest.mark.parametrize("family,tool_format,first", [
    ("qwen2", "hermes", "<|im_start|>"), ("llama", "llama3_json", "<|begin_of_text|>"), ("mistral", "mistral", "<s>")])
def test_each_family_renders_masks_and_parses_its_own_tool_calls(trl_env, family, tool_format, first):
    run = subprocess.run([str(trl_env.python), "-c", CHECK, family, tool_format], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    # SFT trains on the call as the format writes it, the end of turn, and the answer: nothing of the prompt
    # or the tool's result.
    assert found["masked"] == found["written"] + found["eos"] + found["answer"] + found["eos"]
    assert found["template_writes_the_format"]  # re-rendering the episode keeps the sampled ids
    for parsed in (found["server_parse"], found["trl_parse"]):
        assert len(parsed) == 1 and parsed[0]["function"]["name"] == "rechner", parsed
        arguments = parsed[0]["function"]["arguments"]
        assert (json.loads(arguments) if isinstance(arguments, str) else arguments) == found["arguments"]
    assert found["same_template"]
    assert found["first"] == first  # the family's own special tokens, whole


# Every parser a call goes through: TRL's own multi-turn loop (trl), the policy server's chat endpoint
# (openenv; nemo-gym and lightning-verl read the same replies), the verifiers renderer's token-in/token-out
# parse, and the skyrl-gym environment's parse of the action text.
FAMILY_ARMS = ["trl", "openenv", "verifiers", "skyrl-gym"]
ALL_FAMILIES = "RUNNER_TEST_ALL_FAMILIES"


@pytest.mark.skipif(not os.environ.get(ALL_FAMILIES), reason=(
    f"{ALL_FAMILIES}=1 (`make test-families`) builds the tiny Llama and Mistral policies (the default warm start, "
    "~6 min each on 2 cores; a third of it left every rollout unrewarded) and compares four arms on each: ~20 min "
    "more than CI's 60-minute budget holds; the suite checks each family's template, masks and parsers in the trl "
    "environment"))
@pytest.mark.parametrize("family,tool_format", [("llama", "llama3_json"), ("mistral", "mistral")])
def test_a_tiny_checkpoint_of_the_family_passes_every_gate_in_every_parser(tmp_path, family, tool_format):
    plan = tmp_path / "plan.yaml"
    # Eight groups, as the demo plan: the warm-started tiny Llama is right on most items three times in four, so
    # four groups of the suite plan were once all without reward variance in the environment arms (which
    # share one policy server's samples), and the variance gate rightly failed.
    plan.write_text(CALC_PLAN.read_text().replace(
        "  tiny: {seed: 0}", f"  tiny: {{seed: 0, model_family: {family}}}\n  tool_format: {tool_format}").replace(
        "prompts_per_step: 4", "prompts_per_step: 8"))
    run_dir = tmp_path / "compare"
    result = subprocess.run([str(Path(sys.executable).parent / "runner"), "compare", "--stacks", ",".join(FAMILY_ARMS),
                             "--plan", str(plan), "--stages", "service,rollout,update", "--run-dir", str(run_dir),
                             "--json"], capture_output=True, text=True, timeout=3600)
    assert result.returncode in (0, 1), result.stderr[-3000:]
    data = json.loads(result.stdout)
    failed = {arm["stack"]: arm["failed_gates"] for arm in data["arms"] if not arm["passed"]}
    assert not failed and result.returncode == 0, failed
    policy = Path(json.loads((run_dir / "arms" / "trl" / "plan.json").read_text())["policy"]["path"])
    template = (policy / "chat_template.jinja").read_bytes()
    assert TOOL_CALL_MARKERS[tool_format].encode() in template
    for arm in FAMILY_ARMS:
        evidence = stage_evidence(run_dir / "arms" / arm, "rollout")
        assert evidence["provenance"]["chat_template_sha256"] == hashlib.sha256(template).hexdigest()
        rows = [json.loads(line) for line in
                (run_dir / "arms" / arm / "stages" / "rollout" / "trajectories.jsonl").read_text().splitlines()]
        called = [row for row in rows if any(segment["source"] in ("tool", "env") for segment in row["segments"])]
        assert called, f"{arm}: no rollout episode called the tool in {tool_format}"
