import msgspec
from conftest import make_episode
from qualification.gates import TraceAudit, lock_gate, resume_gates


def audit(trajectories, rows, *, group_size=2, tolerance=1e-3):
    a = TraceAudit(vocab_size=100, group_size=group_size, tolerance=tolerance)
    a.add_trajectories(trajectories)
    a.add_rows(rows)
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
    a.add_trajectories([t1, t2])
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


def test_records_audited_a_batch_at_a_time_give_the_audit_of_one_batch(episodes, monkeypatch):
    """Episodes are stored, and rows checked, BATCH at a time: a duplicate episode in a later batch, rows whose
    episodes were stored batches before them and a row naming an unknown episode are found as in one batch."""
    from qualification.gates import trace

    trajectories, rows = episodes
    trajectories = [*trajectories, trajectories[0]]
    rows = [*rows[::-1], msgspec.structs.replace(rows[0], row_id="stray", episode_ids=["no-such-episode"])]
    whole, whole_audit = audit(trajectories, rows)
    monkeypatch.setattr(trace, "BATCH", 2)
    batched, batched_audit = audit(trajectories, rows)
    assert {name: (g.passed, g.measured, g.detail) for name, g in batched.items()} == {
        name: (g.passed, g.measured, g.detail) for name, g in whole.items()}
    assert f"episode {trajectories[0].episode_id} appears twice" in batched["trace:unique-episodes"].detail
    assert "no-such-episode" in batched["trace:every-episode-trained"].detail
    assert batched["trace:mask-provenance"].passed and batched["trace:trained-equals-sampled"].passed
    assert batched_audit.counts == whole_audit.counts
    assert batched_audit.mismatch.summary()["overall"]["tokens"] == 16
