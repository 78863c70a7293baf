import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from runner_contracts import (
    JsonlWriter,
    Plan,
    RecordError,
    Trajectory,
    encode,
    freeze_plan,
    iter_jsonl,
    plan_id,
    read_jsonl,
    write_atomic,
)
from runner_contracts.schema import schemas

from runner.api import load_plan

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "qualification" / "plans" / "calc-tool-cpu.yaml"


def test_jsonl_round_trip_and_atomic_finalisation(tmp_path, episodes):
    trajectories, _ = episodes
    path = tmp_path / "trajectories.jsonl"
    with JsonlWriter(path) as writer:
        for t in trajectories:
            writer.write(t)
        assert not path.exists(), "the final name must not exist before close"
        assert writer.partial_path.exists()
    assert not writer.partial_path.exists()
    assert read_jsonl(path, Trajectory) == trajectories


def test_failed_writer_keeps_partial_file_marked(tmp_path, episodes):
    trajectories, _ = episodes
    path = tmp_path / "trajectories.jsonl"
    with pytest.raises(RuntimeError):
        with JsonlWriter(path) as writer:
            writer.write(trajectories[0])
            writer.flush()
            raise RuntimeError("adapter crashed")
    assert not path.exists()
    kept = read_jsonl(tmp_path / "trajectories.jsonl.partial", Trajectory)
    assert kept == trajectories[:1]


def test_reader_refuses_newer_version(tmp_path, episodes):
    data = msgspec.to_builtins(episodes[0][0])
    data["version"] = 2
    data["new_field"] = "from the future"
    path = tmp_path / "trajectories.jsonl"
    path.write_text(json.dumps(data) + "\n")
    with pytest.raises(RecordError) as error:
        read_jsonl(path, Trajectory)
    assert error.value.line == 1 and error.value.field == "version"
    assert "newer" in error.value.message


def test_reader_names_line_and_field(tmp_path, episodes):
    good = encode(episodes[0][0]).decode()
    bad = json.loads(good)
    bad["segments"][1]["token_ids"][0] = -4
    path = tmp_path / "t.jsonl"
    path.write_text(good + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(RecordError) as error:
        list(iter_jsonl(path, Trajectory))
    assert (error.value.line, error.value.field) == (2, "segments[1].token_ids[0]")


def test_reader_yields_every_line_and_stops_at_the_bad_one(tmp_path, episodes):
    """Line numbers, start_line, a bad record and a blank line (the records before them are read), and an
    unterminated last line (skipped only when allowed)."""
    trajectories, _ = episodes
    lines = [encode(t).decode() for t in trajectories]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    assert [n for n, _ in iter_jsonl(path, Trajectory)] == list(range(1, len(lines) + 1))
    assert [r for _, r in iter_jsonl(path, Trajectory, start_line=3)] == trajectories[2:]
    bad = json.loads(lines[0])
    bad["reward"] = "high"
    for broken, (line, field) in [([*lines[:3], json.dumps(bad), *lines[3:]], (4, "reward")),
                                  ([*lines[:2], "  ", *lines[2:]], (3, "(line)"))]:
        path.write_text("".join(line + "\n" for line in broken))
        read = []
        with pytest.raises(RecordError) as error:
            read.extend(r for _, r in iter_jsonl(path, Trajectory))
        assert (error.value.line, error.value.field) == (line, field) and read == trajectories[:line - 1]
    path.write_text("".join(line + "\n" for line in lines) + lines[0][:40])
    assert [r for _, r in iter_jsonl(path, Trajectory, allow_truncated_tail=True)] == trajectories
    with pytest.raises(RecordError, match="truncated line") as error:
        list(iter_jsonl(path, Trajectory))
    assert error.value.line == len(lines) + 1


def test_write_atomic_replaces_whole_file(tmp_path):
    target = tmp_path / "x.json"
    write_atomic(target, b"one")
    write_atomic(target, b"two")
    assert target.read_bytes() == b"two"
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_plan_id_is_canonical_and_sensitive():
    plan = load_plan(PLAN)
    frozen = freeze_plan(plan)
    assert frozen.plan_id == plan_id(plan) == plan_id(frozen)
    reordered = msgspec.convert(json.loads(json.dumps(msgspec.to_builtins(plan), sort_keys=False)), Plan)
    assert plan_id(reordered) == frozen.plan_id
    changed = msgspec.structs.replace(plan, budget=msgspec.structs.replace(plan.budget, steps=plan.budget.steps + 1))
    assert plan_id(changed) != frozen.plan_id


def test_schemas_match_generated_files():
    """Fails when contracts/schema/ drifts from the record types: run `make schema`."""
    directory = ROOT / "contracts" / "schema"
    generated = schemas()
    assert sorted(p.name for p in directory.glob("*.json")) == sorted(generated)
    for name, data in generated.items():
        assert (directory / name).read_bytes() == data, f"{name} is stale; run `make schema`"


def test_contracts_import_only_their_own_dependencies():
    code = ("import sys, runner_contracts, runner_contracts.launch, runner_contracts.schema; "
            "heavy = {'typer', 'rich', 'yaml', 'torch', 'transformers', 'trl', 'qualification', 'runner'}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_reader_names_a_record_of_the_wrong_kind(tmp_path, episodes):
    path = tmp_path / "trajectories.jsonl"
    path.write_bytes(encode(episodes[1][0]) + b"\n")
    with pytest.raises(RecordError, match="contract: expected 'trajectory' record, got 'training-row'"):
        read_jsonl(path, Trajectory)
