import msgspec
import pytest
from conftest import make_episode
from qualification.gates import TraceAudit, lock_gate, resume_gates


def audit(trajectories, rows, *, group_size=2, tolerance=1e-3):
    a = TraceAudit(vocab_size=100, group_size=group_size, tolerance=tolerance)
    a.add(lambda: trajectories, rows)
    return {g.name: g for g in a.gates() + a.degeneracy_gates(0.5)}, a


def test_clean_trace_passes(episodes):
    gates, a = audit(*episodes)
    assert all(g.passed for g in gates.values()), [g for g in gates.values() if not g.passed]
    assert a.counts["trained_tokens"] == 16


def test_trained_token_that_was_not_sampled_fails(episodes):
    trajectories, rows = episodes
    ids = list(rows[0].input_ids)
    ids[4] = 99  # a policy position the optimizer saw but the policy never sampled
    rows[0] = msgspec.structs.replace(rows[0], input_ids=ids)
    gates, _ = audit(trajectories, rows)
    assert not gates["trace:mask-provenance"].passed


def test_tool_tokens_in_the_loss_fail(episodes):
    trajectories, rows = episodes
    mask = list(rows[1].loss_mask)
    mask[5] = 1  # first tool token masked in
    rows[1] = msgspec.structs.replace(rows[1], loss_mask=mask)
    gates, _ = audit(trajectories, rows)
    assert not gates["trace:mask-provenance"].passed
    assert not gates["trace:trained-equals-sampled"].passed


def test_logprob_gap_over_tolerance_fails(episodes):
    trajectories, rows = episodes
    old = list(rows[2].old_logprobs)
    old[3] -= 0.01
    rows[2] = msgspec.structs.replace(rows[2], old_logprobs=old)
    gates, a = audit(trajectories, rows)
    assert not gates["trace:logprob-agreement"].passed
    assert abs(a.max_logprob_gap - 0.01) < 1e-9
    # The detail says where: the row, and the trained token's index among the row's trained tokens.
    trained = [lp for lp, m in zip(old, rows[2].loss_mask, strict=True) if m]
    index = [i for i, m in enumerate(rows[2].loss_mask) if m].index(3)
    assert (f"the largest in training row {rows[2].row_id}, at its trained token {index} (from 0): "
            f"trainer {trained[index]:.7g}") in gates["trace:logprob-agreement"].detail


def test_a_logprob_that_is_not_finite_fails_agreement_and_is_left_out_of_the_mismatch_panel(episodes):
    """JSON cannot carry one (msgspec refuses 1e999), but records built in memory can."""
    trajectories, rows = episodes
    old = list(rows[2].old_logprobs)
    old[3] = float("-inf")
    rows[2] = msgspec.structs.replace(rows[2], old_logprobs=old)
    gates, a = audit(trajectories, rows)
    assert not gates["trace:logprob-agreement"].passed and gates["trace:logprob-agreement"].measured == float("inf")
    summary = a.mismatch.summary()
    assert summary["sequences_not_finite"] == 1 and summary["overall"]["sequences"] == len(rows) - 1
    assert gates["trace:mask-provenance"].passed


def test_each_bad_segment_of_a_trajectory_is_named(episodes):
    """Ids over the vocabulary, a policy segment without one logprob a token and an environment segment with
    logprobs: each is named by its episode and segment; the other trajectories' figures are unchanged."""
    trajectories, rows = episodes
    segments = list(trajectories[1].segments)
    segments[1] = msgspec.structs.replace(segments[1], token_ids=[10, 150, 170], logprobs=[-0.5, -0.25])
    segments[2] = msgspec.structs.replace(segments[2], logprobs=[-1.0, -1.0, -1.0])
    trajectories[1] = msgspec.structs.replace(trajectories[1], segments=segments)
    gates, a = audit(trajectories, rows)
    problems = a.problems["lengths-vocab"]
    episode = trajectories[1].episode_id
    assert problems == [f"{episode} segment 1: ids [150, 170] >= vocab 100",
                        f"{episode} segment 1: 3 tokens but 2 logprobs",
                        f"{episode} segment 2: tool segment carries logprobs"]
    assert not gates["trace:lengths-vocab"].passed and gates["trace:lengths-vocab"].measured == 3
    assert a.counts["episodes"] == 4 and a.counts["policy_tokens"] == 17


def test_the_trainer_logprobs_paired_with_the_sampler_are_those_of_the_policy_positions():
    from qualification.gates.trace import _policy_values

    values = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    for provenance, expected in [(b"\x00" * 6, []), (b"\x00\x00\x01\x01\x01\x01", [0.2, 0.3, 0.4, 0.5]),
                                 (b"\x00\x01\x01\x00\x00\x00", [0.1, 0.2]),
                                 (b"\x01\x00\x01\x01\x00\x01", [0.0, 0.2, 0.3, 0.5]), (b"\x01" * 6, values)]:
        assert _policy_values(values, provenance) == expected, provenance


def test_incomplete_group_and_untrained_episode_fail(episodes):
    trajectories, rows = episodes
    gates, _ = audit(trajectories[:3], rows[:3])
    assert not gates["trace:groups-complete"].passed
    gates, _ = audit(trajectories, rows[:3])
    assert not gates["trace:every-episode-trained"].passed


def test_degenerate_rewards_fail_the_signal_gates():
    pairs = [make_episode(group=g, sample=s, reward=0.0) for g in range(2) for s in range(2)]
    trajectories = [p[0] for p in pairs]
    rows = [msgspec.structs.replace(p[1], advantage=0.0) for p in pairs]
    gates, _ = audit(trajectories, rows)
    assert not gates["signal:reward-variance"].passed
    assert not gates["signal:advantages"].passed
    assert gates["signal:tool-calls"].passed


def test_revision_chain():
    t1, _ = make_episode(step=1, revision="a" * 64)
    t2, _ = make_episode(step=2, revision="b" * 64)
    a = TraceAudit(vocab_size=100, group_size=1, tolerance=1e-3)
    a.add(lambda: [t1, t2], [])
    assert a.revision_gate("a" * 64, {1: "b" * 64}).passed
    assert not a.revision_gate("a" * 64, {1: "c" * 64}).passed


def test_lock_gate_names_the_drifted_package():
    gate = lock_gate({"trl": "1.15.0", "torch": "2.13.0+cpu", "extra": "1"}, {"trl": "1.16.0", "torch": "2.13.0"})
    assert not gate.passed
    assert "trl: locked 1.16.0, installed 1.15.0" in gate.detail and "extra" in gate.detail
    assert "torch" not in gate.detail
    assert lock_gate({"trl": "1.16.0"}, {"trl": "1.16.0"}).passed


def test_resume_gates_detect_a_different_token():
    plain = [make_episode(step=s, group=0, sample=0, stage="train")[0] for s in (1, 2)]
    rows = [make_episode(step=s, group=0, sample=0, stage="train")[1] for s in (1, 2)]
    ok = resume_gates(plain, plain[:1], plain[1:], rows, rows[:1], rows[1:], 1, "f" * 64, "f" * 64, [])
    assert all(g.passed for g in ok)
    changed = msgspec.structs.replace(plain[1], segments=[*plain[1].segments[:-1], msgspec.structs.replace(
        plain[1].segments[-1], token_ids=[12, 14])])
    bad = {g.name: g for g in resume_gates(plain, plain[:1], [changed], rows, rows[:1], rows[1:], 1,
                                           "f" * 64, "e" * 64, [])}
    assert not bad["resume:same-tokens"].passed and not bad["resume:same-final-weights"].passed
    reordered = {g.name: g for g in resume_gates(plain, plain[:1], plain[1:], rows, rows[:1], rows[:1], 1,
                                                 "f" * 64, "f" * 64, [])}
    assert not reordered["resume:same-order"].passed


def test_sft_gates():
    from qualification.gates import sft_gates
    from runner_contracts import Demonstration, TrainingRow

    demos = [Demonstration(task_id="a", input_ids=[1, 2, 3, 4], target_mask=[0, 0, 1, 1])]
    row = TrainingRow(step=1, row_id="r0", episode_ids=["a"], input_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1],
                      advantage=1.0)
    gates, metrics = sft_gates(demos, [row], 1)
    assert all(g.passed for g in gates) and metrics["trained_tokens"] == 2
    leaky = msgspec.structs.replace(row, loss_mask=[0, 1, 1, 1])
    gates = {g.name: g for g in sft_gates(demos, [leaky], 2)[0]}
    assert not gates["sft:mask-equals-targets"].passed and not gates["sft:every-step-recorded"].passed


def test_the_service_gate_expects_every_scripted_case_of_the_plan():
    """The host derives the scripted cases from the plan itself: a case left out, run twice, failed, or a
    policy call naming no case fails the gate, whatever the adapter reports."""
    from conftest import CALC_PLAN
    from qualification.tasks import get_family
    from runner_contracts import ErrorInfo, PolicyCall, ServiceCase

    from runner._stages.service import SERVICE_ITEMS_PER_FAMILY, scripted_episodes_gate
    from runner.api import load_plan

    plan = load_plan(CALC_PLAN)
    splits = [(plan.task.family, plan.task.train), (plan.task.retention.family, plan.task.retention)]
    cases = [ServiceCase(task_id=item.task_id, item=item.to_json(), case=case["case"],
                         expected_success=case["expected_success"], final_text="", tool_calls=[], stack_reward=0.0,
                         episode_id=f"service/{item.task_id}/{case['case']}")
             for name, split in splits
             for item in get_family(name).generate(split.split, SERVICE_ITEMS_PER_FAMILY, split.seed)
             for case in get_family(name).scripted_cases(item)]

    def call(episode_id):
        return PolicyCall(call_id="c", episode_id=episode_id, channel="header", endpoint="/v1/chat/completions",
                          index_in_episode=0, policy_revision="scripted", prompt_ids=[], completion_ids=[],
                          logprobs=[], finish_reason="")

    calls = [call(case.episode_id) for case in cases]
    assert scripted_episodes_gate(plan, cases, calls)[0].passed
    failed = msgspec.structs.replace(cases[0], status="failed", error=ErrorInfo(kind="environment-down", message="gone"))
    for lie, (their_cases, their_calls) in {
            "missing": (cases[1:], calls),
            "ran twice": (cases + cases[:1], calls),
            "gone": ([failed, *cases[1:]], calls),
            "name no scripted episode": (cases, [*calls, call(None)]),
            "recorded no policy call": (cases, [])}.items():
        gate, _ = scripted_episodes_gate(plan, their_cases, their_calls)
        assert not gate.passed and lie in gate.detail, (lie, gate)


def test_an_audit_that_spills_and_reads_twice_gives_the_audit_of_one_in_memory(episodes, monkeypatch):
    """Episodes beyond the window wait on disk, and a row naming an episode trained and dropped before it is
    checked in a second read: with a window of one episode, rows out of order, a duplicate episode, a row
    that trains an episode a second time and a row naming an unknown episode are found as with all in memory."""
    from qualification.gates import trace

    trajectories, rows = episodes
    trajectories = [*trajectories, trajectories[0]]
    rows = [rows[1], rows[0], rows[3], rows[2], msgspec.structs.replace(rows[1], row_id="again"),
            msgspec.structs.replace(rows[0], row_id="stray", episode_ids=["no-such-episode"])]
    whole, whole_audit = audit(trajectories, rows)
    assert whole_audit._spilled is None
    monkeypatch.setattr(trace, "WINDOW_TOKENS", 1)
    spilled, spilled_audit = audit(trajectories, rows)
    assert spilled_audit._spilled.episodes > 0 and spilled_audit._spilled.deferred == 1
    assert {name: (g.passed, g.measured, g.detail) for name, g in spilled.items()} == {
        name: (g.passed, g.measured, g.detail) for name, g in whole.items()}
    assert f"episode {trajectories[0].episode_id} appears twice" in spilled["trace:unique-episodes"].detail
    assert "no-such-episode" in spilled["trace:every-episode-trained"].detail
    assert spilled["trace:mask-provenance"].passed and spilled["trace:trained-equals-sampled"].passed
    assert spilled_audit.counts == whole_audit.counts and spilled_audit.rows == len(rows)
    assert spilled_audit.mismatch.summary() == whole_audit.mismatch.summary()
    assert spilled_audit.mismatch.summary()["overall"]["tokens"] == 16 + 4


def test_any_order_of_rows_gives_the_same_audit_whatever_the_window(monkeypatch):
    """Rows in any order, one naming two episodes and one training an episode again: a window of one token
    (spills, second reads) and one that holds everything give the same gates and counts."""
    import random

    from qualification.gates import trace

    pairs = [make_episode(group=g, sample=s, reward=float(s)) for g in range(3) for s in range(2)]
    trajectories, rows = [p[0] for p in pairs], [p[1] for p in pairs]
    both = msgspec.structs.replace(rows[2], row_id="both", episode_ids=[trajectories[2].episode_id,
                                                                        trajectories[3].episode_id],
                                   input_ids=rows[2].input_ids + rows[3].input_ids,
                                   loss_mask=rows[2].loss_mask + rows[3].loss_mask,
                                   old_logprobs=rows[2].old_logprobs + rows[3].old_logprobs)
    rows = [rows[0], rows[1], both, rows[4], rows[5], msgspec.structs.replace(rows[0], row_id="again")]
    second_reads = 0
    for seed in range(40):
        shuffled = random.Random(seed).sample(rows, len(rows))
        monkeypatch.setattr(trace, "WINDOW_TOKENS", 1 << 18)
        whole, whole_audit = audit(trajectories, shuffled)
        monkeypatch.setattr(trace, "WINDOW_TOKENS", 1)
        small, small_audit = audit(trajectories, shuffled)
        assert all(g.passed for g in whole.values() if g.name.startswith("trace:")), seed
        assert {n: (g.passed, g.measured, g.detail) for n, g in small.items()} == {
            n: (g.passed, g.measured, g.detail) for n, g in whole.items()}, seed
        assert (small_audit.counts, small_audit.trained, small_audit.rows) == (
            whole_audit.counts, whole_audit.trained, whole_audit.rows) == (whole_audit.counts, 6, 6), seed
        second_reads += small_audit._spilled.deferred > 0
    assert second_reads > 0


def test_an_audit_in_parts_on_worker_processes_gives_the_audit_of_the_whole_files(tmp_path, monkeypatch):
    """Large files are audited in parts (the k-th byte range of each file) on worker processes and merged:
    rows in any order across parts, one naming two episodes, one training an episode again, one naming an
    unknown episode, one training a tool token, one with a token the policy never sampled, one whose lists are
    written with spaces (a part compares them as text with the tokens' JSON, so it must decode this one), an
    episode id repeated in a later part and trainer logprobs that differ from the sampler's give the gates, counts
    and figures of the audit of the whole files, with one worker or two."""
    import random

    from qualification.gates import trace
    from runner_contracts import JsonlWriter

    pairs = [make_episode(group=g, sample=s, reward=float(s)) for g in range(12) for s in range(2)]
    trajectories = [p[0] for p in pairs] + [pairs[1][0]]
    rows = [msgspec.structs.replace(row, old_logprobs=[lp + 1e-4 * index * mask for lp, mask in
                                                       zip(row.old_logprobs, row.loss_mask, strict=True)])
            for index, (_, row) in enumerate(pairs)]
    both = msgspec.structs.replace(rows[4], row_id="both", episode_ids=[*rows[4].episode_ids, *rows[5].episode_ids],
                                   input_ids=rows[4].input_ids + rows[5].input_ids,
                                   loss_mask=rows[4].loss_mask + rows[5].loss_mask,
                                   old_logprobs=rows[4].old_logprobs + rows[5].old_logprobs)
    tool_in_loss = [1 if index == 5 else mask for index, mask in enumerate(rows[7].loss_mask)]
    unsampled = [99 if index == 4 else token for index, token in enumerate(rows[8].input_ids)]
    rows = [*rows[:4], both, *rows[6:], msgspec.structs.replace(rows[0], row_id="again"),
            msgspec.structs.replace(rows[3], row_id="stray", episode_ids=["no-such-episode"]),
            msgspec.structs.replace(rows[7], row_id="tool-in-loss", loss_mask=tool_in_loss),
            msgspec.structs.replace(rows[8], row_id="unsampled", input_ids=unsampled),
            msgspec.structs.replace(rows[9], row_id="spaced")]

    def audit_files(rows, workers):
        with JsonlWriter(tmp_path / "trajectories.jsonl") as writer:
            for trajectory in trajectories:
                writer.write(trajectory)
        (tmp_path / "training.jsonl").write_bytes(b"".join(
            msgspec.json.encode(row).replace(b",", b", " if row.row_id == "spaced" else b",") + b"\n" for row in rows))
        audit = TraceAudit(vocab_size=100, group_size=2, tolerance=1e-3)
        audit.add_files(tmp_path / "trajectories.jsonl", tmp_path / "training.jsonl", workers=workers)
        return {g.name: g for g in audit.gates() + audit.degeneracy_gates(0.5)}, audit

    for order in ("file order", "reversed", "shuffled"):
        ordered = {"file order": rows, "reversed": rows[::-1],
                   "shuffled": random.Random(7).sample(rows, len(rows))}[order]
        whole, whole_audit = audit_files(ordered, workers=2)
        assert whole_audit._spilled is None or not whole_audit._spilled.left  # audited whole, in this process
        with monkeypatch.context() as patch:
            patch.setattr(trace, "PARALLEL_FROM_BYTES", 0)
            patch.setattr(trace, "PART_BYTES", 3000)  # two to three trajectories a part
            patch.setattr(trace._Groups, "SPILL_AT", 5)  # the merged groups move to disk
            for workers in (1, 2):
                parts, parts_audit = audit_files(ordered, workers=workers)
                assert {n: (g.passed, pytest.approx(g.measured)) for n, g in parts.items()} == {
                    n: (g.passed, g.measured) for n, g in whole.items()}, (order, workers)
                assert parts_audit._spilled.left > 0  # rows whose episodes were in another part
                assert (parts_audit.counts, parts_audit.trained, parts_audit.rows, parts_audit._revisions) == (
                    whole_audit.counts, whole_audit.trained, whole_audit.rows, whole_audit._revisions), (order, workers)
                assert parts_audit.reward_per_step() == pytest.approx(whole_audit.reward_per_step())
                mismatch, whole_mismatch = parts_audit.mismatch.summary(), whole_audit.mismatch.summary()
                assert mismatch["overall"] == pytest.approx(whole_mismatch["overall"], rel=1e-12)
                assert mismatch["per_step"][1] == pytest.approx(whole_mismatch["per_step"][1], rel=1e-12)
                assert parts_audit.groups_with_variance() == whole_audit.groups_with_variance() == (12, 12)
        assert not whole["trace:unique-episodes"].passed and "rollout/s1/g0/1 appears twice" in (
            parts["trace:unique-episodes"].detail)
        assert whole["trace:every-episode-trained"].measured == 1 and "no-such-episode" in (
            parts["trace:every-episode-trained"].detail)
        assert not whole["trace:logprob-agreement"].passed and not whole["trace:trained-equals-sampled"].passed
        assert whole_audit.counts["problem:mask-provenance"] == 2 and "tool-in-loss" in parts["trace:mask-provenance"].detail
        assert "unsampled" in parts["trace:mask-provenance"].detail and "spaced" not in parts["trace:mask-provenance"].detail
        assert whole_audit.mismatch.summary()["overall"]["tokens"] == 4 * 26  # 24 episodes, two trained again


def test_a_part_that_compares_rows_as_json_text_finds_what_the_whole_audit_finds(tmp_path):
    """A part reads a row's input_ids and loss_mask as JSON text and compares them with the encoding of the
    episode's tokens and provenance; a row that differs (a tool token trained, a token never sampled, lists of
    other lengths, a trainer logprob short, the same lists written with spaces) is decoded and checked as the whole audit checks it."""
    from qualification.gates import trace

    pairs = [make_episode(group=g, sample=s, reward=float(s)) for g in range(4) for s in range(2)]
    rows = [row for _, row in pairs]
    rows[1] = msgspec.structs.replace(rows[1], loss_mask=[1 if i == 5 else m for i, m in enumerate(rows[1].loss_mask)])
    rows[2] = msgspec.structs.replace(rows[2], input_ids=[99 if i == 4 else t for i, t in enumerate(rows[2].input_ids)])
    rows[3] = msgspec.structs.replace(rows[3], loss_mask=rows[3].loss_mask[:-1])
    rows[5] = msgspec.structs.replace(rows[5], old_logprobs=[lp - 0.5 for lp in rows[5].old_logprobs])
    rows[6] = msgspec.structs.replace(rows[6], old_logprobs=rows[6].old_logprobs[:-1])
    lines = [msgspec.json.encode(row) for row in rows]
    lines[4] = lines[4].replace(b",", b", ")
    trajectories, training = tmp_path / "trajectories.jsonl", tmp_path / "training.jsonl"
    trajectories.write_bytes(b"".join(msgspec.json.encode(t) + b"\n" for t, _ in pairs))
    training.write_bytes(b"".join(line + b"\n" for line in lines))

    whole = TraceAudit(vocab_size=100, group_size=2, tolerance=1e-3)
    whole.add_files(trajectories, training)
    part = trace._audit_part((trajectories, (0, trajectories.stat().st_size), training, (0, training.stat().st_size),
                              100, 2, 1e-3))
    assert whole.counts["problem:mask-provenance"] == 2 and whole.counts["problem:lengths-vocab"] == 2
    assert (part.counts, dict(part.problems), part.rows, part.trained, part.max_logprob_gap) == (
        whole.counts, dict(whole.problems), whole.rows, whole.trained, whole.max_logprob_gap)
    assert part.mismatch.summary() == whole.mismatch.summary()
    assert whole.mismatch.summary()["overall"]["sequences"] == 4  # the 3 good rows (one spaced) and the far one


@pytest.mark.parametrize(("fault", "field"), [
    ((b'"advantage":', b'"advantage":"high","was":'), "advantage"),
    ((b'"input_ids":[1,', b'"input_ids":[-1,'), "input_ids[0]"),  # read as text in a part: decoded as it differs
    ((b'"loss_mask":[0,', b'"loss_mask":[2,'), "loss_mask[0]"),
])
def test_an_unreadable_record_in_an_audit_in_parts_is_named_by_its_line(tmp_path, monkeypatch, fault, field):
    """A part that cannot read a record gives the audit back to one process, whose error names the line."""
    from qualification.gates import trace
    from runner_contracts import RecordError

    pairs = [make_episode(group=g, sample=s) for g in range(6) for s in range(2)]
    (tmp_path / "trajectories.jsonl").write_bytes(b"".join(msgspec.json.encode(t) + b"\n" for t, _ in pairs))
    rows = [msgspec.json.encode(row) + b"\n" for _, row in pairs]
    assert fault[0] in rows[9]
    rows[9] = rows[9].replace(*fault)
    (tmp_path / "training.jsonl").write_bytes(b"".join(rows))
    monkeypatch.setattr(trace, "PARALLEL_FROM_BYTES", 0)
    monkeypatch.setattr(trace, "PART_BYTES", 3000)
    with pytest.raises(RecordError) as raised:
        TraceAudit(vocab_size=100, group_size=2, tolerance=1e-3).add_files(
            tmp_path / "trajectories.jsonl", tmp_path / "training.jsonl", workers=2)
    assert (raised.value.line, raised.value.field) == (10, field)
