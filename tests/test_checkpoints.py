"""A checkpoint given by path is checked before any stage: one line per problem, naming the file."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from conftest import stand_in_checkpoint

from runner_contracts import sha256_file

from runner._policy import checkpoint_problems
from runner.api import UserError, load_plan, resolve_policy

PLAN = Path(__file__).resolve().parents[1] / "qualification" / "plans" / "calc-tool-cpu.yaml"


def checkpoint(folder: Path, **override: str | None) -> Path:
    """The suite's stand-in checkpoint with some files replaced (text) or removed (None)."""
    stand_in_checkpoint(folder)
    for name, text in override.items():
        if text is None:
            (folder / name).unlink()
        else:
            (folder / name).write_text(text)
    return folder


def test_a_complete_checkpoint_has_no_problem(tmp_path):
    assert checkpoint_problems(checkpoint(tmp_path / "ok")) == []


@pytest.mark.parametrize(("override", "problem"), [
    ({"config.json": None}, "config.json: missing"),
    ({"config.json": "{"}, "config.json: not valid JSON"),
    ({"config.json": "{}"}, "config.json: no vocab_size"),
    ({"model.safetensors": None}, "model.safetensors: missing"),
    ({"tokenizer.json": None}, "tokenizer.json: missing (nor a tokenizer.model)"),
    ({"tokenizer_config.json": "{}"}, "tokenizer_config.json: no chat_template (nor a chat_template.jinja)"),
    ({"tokenizer_config.json": json.dumps({"chat_template": "{{ messages }}[TOOL_CALLS]"})},
     "the chat template does not render hermes tool calls (no <tool_call> in it); it looks like mistral: set "
     "policy.tool_format"),
])
def test_each_problem_is_named(tmp_path, override, problem):
    found = checkpoint_problems(checkpoint(tmp_path / "ckpt", **override))
    assert len(found) == 1 and problem in found[0] and str(tmp_path / "ckpt") in found[0], found


def test_a_plan_with_a_broken_checkpoint_stops_before_any_stage(tmp_path):
    import msgspec

    folder = checkpoint(tmp_path / "ckpt", **{"model.safetensors": None, "tokenizer.json": None})
    plan = load_plan(PLAN)
    plan = msgspec.structs.replace(plan, policy=msgspec.structs.replace(plan.policy, kind="path", path=str(folder)))
    with pytest.raises(UserError) as raised:
        resolve_policy(plan, engine=None)
    lines = str(raised.value).splitlines()
    assert lines[0] == "plan field policy.path: the checkpoint cannot be used:" and len(lines) == 3


LLAMA_TEMPLATE = ("{%- for message in messages %}{%- if message.tool_calls %}{{- '{\"name\": \"' + "
                  "message.tool_calls[0].function.name + '\", ' }}{{- '\"parameters\": ' }}"
                  "{{- message.tool_calls[0].function.arguments | tojson }}{%- endif %}{%- endfor %}")


@pytest.mark.parametrize(("tool_format", "template", "problem"), [
    ("llama3_json", LLAMA_TEMPLATE, None),
    ("mistral", "{{ bos_token }}[TOOL_CALLS]{{ tool_calls | tojson }}", None),
    ("mistral", LLAMA_TEMPLATE, 'does not render mistral tool calls (no [TOOL_CALLS] in it); it looks like llama3_json'),
    ("llama3_json", "{{ messages }}", 'does not render llama3_json tool calls (no "parameters" in it)'),
])
def test_the_template_must_render_the_plans_tool_call_format(tmp_path, tool_format, template, problem):
    folder = checkpoint(tmp_path / "ckpt", **{"tokenizer_config.json": json.dumps({"chat_template": template})})
    found = checkpoint_problems(folder, tool_format)
    assert (found == []) if problem is None else (len(found) == 1 and problem in found[0]), found


def test_a_tiny_policys_tool_format_is_its_model_familys(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.read_text().replace("  tiny: {seed: 0}", "  tiny: {seed: 0}\n  tool_format: mistral"))
    with pytest.raises(UserError, match=r"plan.yaml:\d+: field policy.tool_format: 'mistral', but the tiny qwen2 policy "
                                        r"writes hermes tool calls: set tool_format: hermes"):
        load_plan(plan)
    plan.write_text(PLAN.read_text().replace("  tiny: {seed: 0}", "  tiny: {seed: 0, model_family: llama}"))
    with pytest.raises(UserError, match=r"'hermes', but the tiny llama policy writes llama3_json tool calls"):
        load_plan(plan)
    plan.write_text(PLAN.read_text().replace("  tiny: {seed: 0}", "  tiny: {seed: 0, model_family: mistral}\n"
                                                                  "  tool_format: mistral"))
    assert load_plan(plan).policy.tiny == {"seed": 0, "model_family": "mistral"}
    plan.write_text(PLAN.read_text().replace("  tiny: {seed: 0}", "  tiny: {seed: 0, model_family: gemma}"))
    with pytest.raises(UserError, match=r"field policy.tiny.model_family: Invalid enum value 'gemma'; expected one of "
                                        r"llama, mistral, qwen2"):
        load_plan(plan)
    plan.write_text(PLAN.read_text().replace("  tiny: {seed: 0}", "  tiny: {seed: 0}\n  tool_format: xml"))
    with pytest.raises(UserError, match=r"field policy.tool_format: Invalid enum value 'xml'; expected one of hermes, "
                                        r"llama3_json, mistral"):
        load_plan(plan)


def test_a_checkpoints_sha256_is_read_once_and_again_when_it_changes(tmp_path, monkeypatch):
    """Freezing a plan names its checkpoint by sha256; a later command that finds the same file (same inode,
    size, times) does not read it again, and a rewrite of the same size is hashed anew."""
    from runner import _file_hashes

    monkeypatch.setenv("RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    reads = []
    monkeypatch.setattr(_file_hashes, "sha256_file", lambda path: reads.append(path) or sha256_file(path))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"a" * 4096)
    assert _file_hashes.cached_sha256(weights) == sha256_file(weights) and len(reads) == 1
    assert _file_hashes.cached_sha256(weights) == sha256_file(weights) and len(reads) == 2  # changed just now

    settled = time.time() - 60
    os.utime(weights, (settled, settled))
    first = _file_hashes.cached_sha256(weights)
    assert _file_hashes.cached_sha256(weights) == first and len(reads) == 3  # remembered

    weights.write_bytes(b"b" * 4096)  # same size; the times put back as they were
    os.utime(weights, (settled, settled))
    assert _file_hashes.cached_sha256(weights) == sha256_file(weights) != first and len(reads) == 4
