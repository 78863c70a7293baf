"""`runner validate` accepts good files and rejects each kind of corruption with file:line:field, exit 1."""

import json
import subprocess
import sys

import msgspec
import pytest
from runner_contracts import JsonlWriter
from typer.testing import CliRunner

from runner.cli import app

runner = CliRunner()


@pytest.fixture
def good_file(tmp_path, episodes):
    path = tmp_path / "trajectories.jsonl"
    with JsonlWriter(path) as writer:
        for t in episodes[0]:
            writer.write(t)
    return path


def corrupt(path, line: int, edit) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    lines[line - 1] = edit(lines[line - 1])
    path.write_bytes(b"".join(lines))


def json_edit(change):
    def edit(raw: bytes) -> bytes:
        data = json.loads(raw)
        change(data)
        return json.dumps(data).encode() + b"\n"
    return edit


def run(*args):
    result = runner.invoke(app, ["validate", *map(str, args)], env={"COLUMNS": "400"})
    return result.exit_code, result.output


def test_accepts_good_file(good_file):
    code, output = run(good_file)
    assert code == 0 and "4 Trajectory record(s)" in output


CASES = {
    "negative id": (json_edit(lambda d: d["segments"][1]["token_ids"].__setitem__(0, -1)), "segments[1].token_ids[0]"),
    "missing logprob": (json_edit(lambda d: d["segments"][1]["logprobs"].pop()), "segments[1].logprobs"),
    "extra logprob": (json_edit(lambda d: d["segments"][3]["logprobs"].append(-0.1)), "segments[3].logprobs"),
    "positive logprob": (json_edit(lambda d: d["segments"][1]["logprobs"].__setitem__(0, 0.5)), "segments[1].logprobs[0]"),
    "unknown source": (json_edit(lambda d: d["segments"][2].__setitem__("source", "oracle")), "segments[2].source"),
    "future version": (json_edit(lambda d: d.__setitem__("version", 3)), "version"),
    "missing field": (json_edit(lambda d: d.pop("episode_id")), "episode_id"),
    "string reward": (json_edit(lambda d: d.__setitem__("reward", "high")), "reward"),
    "nan reward": (lambda raw: raw.replace(b'"reward":1.0', b'"reward":NaN').replace(b'"reward":0.0', b'"reward":NaN'),
                   "(record)"),
    "invalid utf-8": (lambda raw: raw.replace(b'"text":"p"', b'"text":"\xff\xfe"'), "(record)"),
    "tool logprobs": (json_edit(lambda d: d["segments"][2].__setitem__("logprobs", [-1.0, -1.0, -1.0])), "segments[2].logprobs"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rejects_corruption_with_location(good_file, name):
    edit, field = CASES[name]
    corrupt(good_file, 2, edit)
    code, output = run(good_file)
    assert code == 1
    assert f"{good_file}:2: {field}" in output.replace("\n", ""), output


def test_rejects_truncated_last_line(good_file):
    data = good_file.read_bytes()
    good_file.write_bytes(data[: len(data) - 40])
    code, output = run(good_file)
    assert code == 1 and f"{good_file}:4: (line): truncated line" in output.replace("\n", "")


def test_rejects_duplicate_episode_ids(good_file, episodes):
    first = msgspec.json.encode(episodes[0][0]) + b"\n"
    good_file.write_bytes(good_file.read_bytes() + first)
    code, output = run(good_file)
    assert code == 1 and f"{good_file}:5: episode_id: duplicate episode id" in output.replace("\n", "")


def test_duplicates_are_still_found_once_the_seen_ids_move_to_disk():
    """validate keeps the episode ids it met in a set until there are many, then in SQLite (bounded memory)."""
    from qualification.gates import SeenIds

    seen = SeenIds(spill_at=3)
    assert [seen.add(key) for key in ("a", "b", "c", "d")] == [True] * 4  # moved to disk at the third
    assert (seen.add("a"), seen.add("d"), seen.add("e"), seen.add("e")) == (False, False, True, False)


def test_reports_every_bad_line(good_file):
    for line in (1, 3):
        corrupt(good_file, line, json_edit(lambda d: d.__setitem__("step", -1)))
    code, output = run(good_file)
    flat = output.replace("\n", "")
    assert code == 1 and f"{good_file}:1: step" in flat and f"{good_file}:3: step" in flat


def test_training_rows(tmp_path, episodes):
    path = tmp_path / "training.jsonl"
    with JsonlWriter(path) as writer:
        for row in episodes[1]:
            writer.write(row)
    assert run(path)[0] == 0
    corrupt(path, 1, json_edit(lambda d: d["loss_mask"].append(1)))
    code, output = run(path)
    assert code == 1 and f"{path}:1: loss_mask" in output.replace("\n", "")


def test_cli_never_prints_a_traceback(tmp_path):
    path = tmp_path / "trajectories.jsonl"
    path.write_bytes(b"\x00\xff not json\n")
    result = subprocess.run([sys.executable, "-m", "runner.cli", "validate", str(path)], capture_output=True, text=True)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr + result.stdout
    assert f"{path}:1" in result.stderr.replace("\n", "")


@pytest.mark.parametrize("range_bytes", [1, 1000], ids=["a range per line", "ranges of lines"])
def test_a_file_checked_in_ranges_on_worker_processes_gives_the_same_report(tmp_path, episodes, monkeypatch,
                                                                            range_bytes):
    """Large files are validated in byte ranges on several processes: errors keep their file line numbers and
    order (a bad line that ends its range too), and a duplicate episode id is found across ranges."""
    from runner import _validate

    path = tmp_path / "trajectories.jsonl"
    lines = [msgspec.json.encode(t) + b"\n" for t in episodes[0]]
    body = [raw.replace(b'"episode_id":"', b'"episode_id":"c%d/' % copy) for copy in range(30) for raw in lines]
    body[7] = json_edit(lambda d: d.__setitem__("step", -1))(body[7])
    body[50] = body[3]  # a duplicate of line 4, far from it
    body[90] = b"not json\n"
    path.write_bytes(b"".join(body))
    sequential = _validate.validate_file(path, workers=1)
    monkeypatch.setattr(_validate, "PARALLEL_FROM_BYTES", 0)
    monkeypatch.setattr(_validate, "MIN_CHUNK_BYTES", range_bytes)
    monkeypatch.setattr(_validate, "CHUNK_BYTES", range_bytes)
    assert len(_validate._ranges(path, path.stat().st_size, range_bytes)) > 10
    parallel = _validate.validate_file(path, workers=2)
    found = [(e.line, e.field) for e in parallel.errors]
    assert found == [(e.line, e.field) for e in sequential.errors] == [(8, "step"), (51, "episode_id"), (91, "(record)")]
    assert parallel.records == sequential.records == 118  # two lines are not records
