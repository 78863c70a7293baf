"""The rollout-service scaffold, the policy protocol and the host-side call audits, in the host venv.

Real HTTP servers on 127.0.0.1 with free ports: the scripted policy server, the reference backend's
task server and the rollout service. No upstream stack is involved (those have their own tests)."""

from __future__ import annotations

import json
import re
import socketserver
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from qualification.gates import call_gates
from qualification.tasks import get_family
from runner_contracts import (
    EpisodeSpec,
    PolicyCall,
    RolloutPrepare,
    RolloutRequest,
    RolloutResponse,
    SamplingSpec,
    Segment,
    Trajectory,
)
from runner_kit.continuity import chain_calls
from runner_kit.http import Call, HttpError, get_json, post_json
from runner_kit.policy import GENERATE_PATH, episode_base_url, episode_of, openai_tools
from runner_kit.tool_formats import parse_tool_calls
from runner_kit.reference_backend import ReferenceBackend
from runner_kit.rollout import (
    BatchRunner,
    EnvironmentDown,
    PolicyEndpoint,
    RolloutService,
    announce_policy,
    post_to_environment,
)
from runner_kit.scripted_policy import ScriptedPolicyServer

ROOT = Path(__file__).resolve().parents[1]


def _scripted_batch(family_name: str, n: int = 2, max_turns: int = 6):
    family = get_family(family_name)
    episodes, scripts, expected = [], {}, {}
    for item in family.generate("train", n, 1):
        for case in family.scripted_cases(item):
            episode_id = f"{item.task_id}/{case['case']}"
            episodes.append(EpisodeSpec(episode_id=episode_id, task_id=item.task_id, family=family_name,
                                        item=item.to_json(), seed=0, max_turns=max_turns))
            scripts[episode_id] = case["turns"]
            expected[episode_id] = case["expected_success"]
    return episodes, scripts, expected


@pytest.mark.parametrize("family_name", ["calc-tool", "german-arith", "german-rag-cited", "business-comm"])
def test_reference_backend_scores_scripted_cases_like_the_reference_scorer(family_name):
    episodes, scripts, expected = _scripted_batch(family_name)
    backend = ReferenceBackend()
    backend.start()
    try:
        with ScriptedPolicyServer(scripts) as policy:
            response = BatchRunner(backend).run(RolloutRequest(
                episodes=episodes, policy_base_url=policy.base_url, sampling=SamplingSpec(), concurrency=3))
            channels = {call["channel"] for call in policy.calls}
    finally:
        backend.stop()
    assert [r.episode_id for r in response.results] == [e.episode_id for e in episodes]
    assert all(r.status == "completed" for r in response.results)
    assert {r.episode_id: r.success for r in response.results} == expected
    assert channels == {"header"}


def test_environment_crash_mid_batch_loses_no_episode():
    episodes, scripts, expected = _scripted_batch("business-comm", n=3)
    backend = ReferenceBackend()
    backend.start()
    try:
        with ScriptedPolicyServer(scripts) as policy:
            responses: list = []
            batch = threading.Thread(target=lambda: responses.append(BatchRunner(backend).run(RolloutRequest(
                episodes=episodes, policy_base_url=policy.base_url, sampling=SamplingSpec(), concurrency=3,
                max_attempts=3))))
            batch.start()
            while len({c["episode_id"] for c in policy.calls}) < len(episodes) // 2 and batch.is_alive():
                time.sleep(0.001)
            backend.kill_environment()  # the crash, from outside the batch (the host's, in a real arm)
            batch.join(120)
            response = responses[0]
            retry_ids = {c["episode_id"] for c in policy.calls if c["wire_id"].endswith("~attempt-2")}
    finally:
        backend.stop()
    assert response.environment_restarts >= 1
    assert sorted(r.episode_id for r in response.results) == sorted(e.episode_id for e in episodes)
    retried = [r for r in response.results if r.attempts > 1]
    assert retried, "the crash hit no episode in flight"
    assert all(r.status == "completed" and r.success == expected[r.episode_id] for r in retried), retried
    assert {r.episode_id for r in retried} <= retry_ids  # retries call the policy under their own attempt id


def test_rollout_service_over_http_and_its_errors():
    episodes, scripts, _ = _scripted_batch("calc-tool", n=1)
    with RolloutService(ReferenceBackend()) as service, ScriptedPolicyServer(scripts) as policy:
        assert get_json(service.url + "/health") == {"status": "ok"}
        assert get_json(service.url + "/info")["episode_id_channel"] == "header X-Episode-ID"
        request = RolloutRequest(episodes=episodes, policy_base_url=policy.base_url, sampling=SamplingSpec())
        response = msgspec.convert(post_json(service.url + "/rollouts", msgspec.to_builtins(request)), RolloutResponse)
        assert len(response.results) == len(episodes)
        with pytest.raises(HttpError) as bad:
            post_json(service.url + "/rollouts", {"episodes": "nope"})
        assert bad.value.status == 422 and "rollout-request" in str(bad.value)


class _WarmingBackend(ReferenceBackend):
    """The reference backend with a warm-up that takes a while (or fails), as a heavy import would."""

    def __init__(self, fail: bool):
        super().__init__()
        self.fail, self.began, self.finished = fail, threading.Event(), threading.Event()

    def warm_up(self) -> None:
        self.began.set()
        time.sleep(0.3)
        if self.fail:
            raise ImportError("no module named heavy_upstream")
        self.finished.set()


@pytest.mark.parametrize("fail", [False, True], ids=["warms-up", "warm-up-fails"])
def test_the_service_warms_its_backend_up_in_the_background_and_serves_meanwhile(fail, capfd):
    backend = _WarmingBackend(fail)
    episodes, scripts, _ = _scripted_batch("calc-tool", n=1)
    with RolloutService(backend) as service, ScriptedPolicyServer(scripts) as policy:
        assert backend.began.wait(5)
        assert not backend.finished.is_set()  # the service is up before the warm-up ends
        request = RolloutRequest(episodes=episodes, policy_base_url=policy.base_url, sampling=SamplingSpec())
        response = msgspec.convert(post_json(service.url + "/rollouts", msgspec.to_builtins(request)), RolloutResponse)
        assert [r.status for r in response.results] == ["completed"] * len(episodes)
    assert backend.finished.is_set() is not fail
    stderr = capfd.readouterr().err
    if fail:
        assert "warm-up failed: ImportError: no module named heavy_upstream" in stderr
    else:
        assert re.search(r"warmed up in \d+\.\d s", stderr)


class _PreparingBackend(ReferenceBackend):
    """The reference backend recording what POST /prepare asked for, as a backend that starts servers would."""

    def __init__(self):
        super().__init__()
        self.prepared: list[tuple] = []
        self.done = threading.Event()

    def prepare(self, policy, families, max_turns):
        self.prepared.append((policy, families, max_turns))
        self.done.set()


def test_the_service_prepares_for_an_announced_policy_in_the_background_and_refuses_a_bad_announcement():
    backend = _PreparingBackend()
    sampling = SamplingSpec(temperature=0.7)
    with RolloutService(backend) as service:
        assert announce_policy(service.url, RolloutPrepare(
            policy_base_url="http://127.0.0.1:9/v1", tokenizer_dir="/ckpt", sampling=sampling,
            families=["calc-tool"], max_turns=3)) is None
        assert backend.done.wait(5)
        with pytest.raises(HttpError) as bad:
            post_json(service.url + "/prepare", {"policy_base_url": "http://127.0.0.1:9/v1", "families": "calc-tool"})
        assert bad.value.status == 422 and "rollout-prepare" in str(bad.value)
    assert backend.prepared == [(PolicyEndpoint(base_url="http://127.0.0.1:9/v1", model="policy", sampling=sampling,
                                                tokenizer_dir="/ckpt"), ["calc-tool"], 3)]
    # Advisory: a service that is gone (or predates /prepare) is a reason, not an exception.
    assert "Connection refused" in announce_policy(service.url, RolloutPrepare(
        policy_base_url="http://127.0.0.1:9/v1", sampling=sampling, families=["calc-tool"], max_turns=3))


def test_policy_calls_need_an_episode_and_every_channel_works():
    scripts = {"ep/1": [{"text": "Antwort: 3"}]}
    with ScriptedPolicyServer(scripts) as policy:
        body = {"messages": [{"role": "user", "content": "1+2"}]}
        with pytest.raises(HttpError) as refused:
            post_json(policy.base_url + "/chat/completions", body)
        assert refused.value.status == 400 and "attributed" in str(refused.value)
        endpoint = PolicyEndpoint(base_url=policy.base_url, model="m", sampling=SamplingSpec())
        post_json(policy.base_url + "/chat/completions", body, headers=endpoint.headers("ep/1"))
        post_json(episode_base_url(policy.base_url, "ep/1") + "/chat/completions", body)
        post_json(policy.base_url + "/chat/completions", {**body, "metadata": {"episode_id": "ep/1"}})
        # the refused call is kept too: the service stage's audit counts it as unattributed
        assert [c["channel"] for c in policy.calls] == ["none", "header", "path", "metadata"]
        assert [c["episode_id"] for c in policy.calls] == [None, "ep/1", "ep/1", "ep/1"]
        assert [(r.episode_id, r.index_in_episode) for r in policy.call_records()] == [
            (None, 0), ("ep/1", 0), ("ep/1", 1), ("ep/1", 2)]


def test_a_token_in_token_out_call_names_its_episode_in_its_sampling_params():
    """verifiers' TrainClient sends nothing of a rollout's own but its sampling config, as sampling_params: the
    episode id travels there (one shared client for every rollout), and the body's own metadata comes first."""
    def call(body):
        return Call("POST", "/inference/v1/generate", re.fullmatch(GENERATE_PATH, "/inference/v1/generate"), {}, body)

    params = {"temperature": 1.0, "metadata": {"episode_id": "ep/2~attempt-2"}}
    assert episode_of(call({"token_ids": [1], "sampling_params": params})) == ("ep/2~attempt-2", "metadata")
    assert episode_of(call({"metadata": {"episode_id": "ep/1"}, "sampling_params": params})) == ("ep/1", "metadata")
    for unnamed in ({"token_ids": [1], "sampling_params": {"metadata": {}}}, {"sampling_params": [1]},
                    {"sampling_params": {"metadata": "ep/2"}}, [1, 2]):
        assert episode_of(call(unnamed)) == (None, "none")


def _policy_call(index: int) -> PolicyCall:
    return PolicyCall(call_id=f"ep/1#{index}", episode_id="ep/1", channel="header", endpoint="chat",
                      index_in_episode=index, policy_revision="r", prompt_ids=[1, 2], completion_ids=[3],
                      logprobs=[-0.5], finish_reason="stop")


def test_the_policy_call_log_writes_in_call_order_without_holding_a_reply_on_the_disk(tmp_path, monkeypatch):
    """The policy server's call log: a call is queued at once while an earlier batch is still being written
    (its flush held here on an event, as a slow disk would hold it), the file keeps call order, close()
    finalises it or, for a failed stage, leaves it marked partial."""
    from runner_kit.policy_server import _CallLog

    log = _CallLog(tmp_path / "calls.jsonl")
    writer, flushing, release = log._writer, threading.Event(), threading.Event()
    real_flush = writer.flush

    def slow_flush() -> None:
        flushing.set()
        assert release.wait(30)
        real_flush()

    monkeypatch.setattr(writer, "flush", slow_flush)
    log.write(_policy_call(0))
    assert flushing.wait(30)  # the writer thread is inside a flush that cannot finish yet
    for index in range(1, 5):
        log.write(_policy_call(index))  # returns although the disk holds the writer
    release.set()
    log.close()
    lines = (tmp_path / "calls.jsonl").read_text().splitlines()
    assert [json.loads(line)["index_in_episode"] for line in lines] == [0, 1, 2, 3, 4]
    assert not (tmp_path / "calls.jsonl.partial").exists()

    failed = _CallLog(tmp_path / "failed.jsonl")
    failed.write(_policy_call(0))
    failed.close(ok=False)
    kept = (tmp_path / "failed.jsonl.partial").read_text().splitlines()
    assert [json.loads(line)["index_in_episode"] for line in kept] == [0]
    assert not (tmp_path / "failed.jsonl").exists()


def test_a_policy_call_log_that_cannot_be_written_fails_the_next_call_and_the_close(tmp_path, monkeypatch):
    """A full disk under the call log: the calls after it are refused with the cause, close() says so too, and
    the file stays marked partial."""
    from runner_kit.policy_server import _CallLog

    log = _CallLog(tmp_path / "calls.jsonl")

    def full_disk() -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(log._writer, "flush", full_disk)
    log.write(_policy_call(0))
    log._thread.join(30)  # the writer thread ends on the error
    assert not log._thread.is_alive()
    with pytest.raises(RuntimeError, match="No space left on device"):
        log.write(_policy_call(1))
    with pytest.raises(RuntimeError, match="policy call log cannot be written"):
        log.close()
    assert (tmp_path / "calls.jsonl.partial").exists() and not (tmp_path / "calls.jsonl").exists()


def test_tool_call_parsing_keeps_malformed_calls_as_text():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "rechner", "arguments": {"ausdruck": "1 + 2"}}\n</tool_call>')
    assert content == "" and calls[0]["function"]["name"] == "rechner"
    assert calls[0]["function"]["arguments"] == '{"ausdruck": "1 + 2"}'
    text = '<tool_call>\n{"name": "rechner", "arguments": {"ausdruck": \n</tool_call>'
    assert parse_tool_calls(text) == (text, [])
    assert [t["function"]["name"] for t in openai_tools(get_family("business-comm"))] == sorted(
        spec.name for spec in get_family("business-comm").tools)


@dataclass
class _Call:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]


def test_rows_chain_calls_by_exact_prefix_and_count_breaks():
    first = _Call([1, 2], [3, 4], [-0.1, -0.2])
    second = _Call([1, 2, 3, 4, 9, 9], [5], [-0.3])
    row = chain_calls([first, second])
    assert row.prompt_ids == [1, 2] and row.completion_ids == [3, 4, 9, 9, 5]
    assert row.mask == [1, 1, 0, 0, 1] and row.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert (row.breaks, row.untrained_calls, row.calls_used) == (0, 0, 2)
    retokenised = _Call([1, 2, 7, 9], [5], [-0.3])  # the history came back with different ids
    broken = chain_calls([first, retokenised, second])
    assert broken.completion_ids == [3, 4] and (broken.breaks, broken.untrained_calls) == (1, 2)
    assert chain_calls([]) is None


def _trajectory(episode_id: str, policy_ids: list[int]) -> Trajectory:
    return Trajectory(run_id="r", stack="s", stage="rollout", step=1, episode_id=episode_id, task_id="t",
                      group_id="g", sample_index=0, policy_revision="x", reward=0.0, outcome="failure",
                      finish_reason="stop", turns=1,
                      segments=[Segment(source="prompt", token_ids=[1]),
                                Segment(source="policy", token_ids=policy_ids, logprobs=[0.0] * len(policy_ids))])


def _call(episode_id: str | None, index: int, ids: list[int]) -> PolicyCall:
    return PolicyCall(call_id=f"{episode_id}#{index}", episode_id=episode_id, channel="header", endpoint="chat",
                      index_in_episode=index, policy_revision="x", prompt_ids=[1], completion_ids=ids,
                      logprobs=[0.0] * len(ids), finish_reason="stop")


def test_call_audit_fails_on_unattributed_foreign_or_altered_tokens():
    trajectories = [_trajectory("e1", [5, 6, 7])]
    good = [_call("e1", 0, [5, 6]), _call("e1", 1, [7])]
    gates, metrics = call_gates(good, trajectories)
    assert all(g.passed for g in gates) and metrics["policy_calls"] == 2
    gates, _ = call_gates(good + [_call(None, 0, [])], trajectories)
    assert not gates[0].passed
    gates, _ = call_gates(good + [_call("other", 0, [1])], trajectories)
    assert not gates[0].passed and "other" in gates[0].detail
    gates, _ = call_gates([_call("e1", 0, [5, 6]), _call("e1", 1, [8])], trajectories)
    assert gates[0].passed and not gates[1].passed


def test_comparison_refuses_arms_of_different_plans(tmp_path):
    from runner_contracts import freeze_plan, write_record

    from runner.api import UserError, load_plan, write_comparison

    plan = freeze_plan(load_plan(ROOT / "qualification" / "plans" / "calc-tool-cpu.yaml"))
    other = freeze_plan(msgspec.structs.replace(plan, name="other", plan_id=None))
    for arm, arm_plan in (("a", plan), ("b", other)):
        write_record(tmp_path / "arms" / arm / "plan.json", arm_plan)
    with pytest.raises(UserError, match="different plans"):
        write_comparison(tmp_path, ["a", "b"])


class _MisbehavingFront(socketserver.ThreadingTCPServer):
    """A stand-in for a broken upstream environment server, on 127.0.0.1 in front of the reference task
    server: `silent` accepts, reads and never answers; `partial` sends the headers and a few bytes of a
    reply, then stalls (a half-open connection); `close` drops the connection unanswered; `slow` answers
    through the task server after a delay."""

    daemon_threads = True

    def __init__(self, mode: str, upstream: str):
        self.mode, self.upstream, self.released = mode, upstream, threading.Event()
        super().__init__(("127.0.0.1", 0), _FrontHandler)
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.released.set()  # stalled handlers return and their connections close
        self.shutdown()
        self.server_close()


class _FrontHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        front: _MisbehavingFront = self.server  # type: ignore[assignment]
        head = b"".join(iter(self.rfile.readline, b"\r\n"))
        length = re.search(rb"content-length: *(\d+)", head, re.I)
        body = self.rfile.read(int(length.group(1)) if length else 0)
        if front.mode == "close":
            return
        if front.mode == "silent":
            front.released.wait()
        elif front.mode == "partial":
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 900\r\n\r\n{\"re")
            self.wfile.flush()
            front.released.wait()
        else:
            time.sleep(0.2)
            path = head.split(b" ")[1].decode()
            reply = json.dumps(post_json(front.upstream + path, json.loads(body))).encode()
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                             b"Connection: close\r\n\r\n%s" % (len(reply), reply))


class _MisbehavingEnvironment(ReferenceBackend):
    """The reference backend whose environment calls go through a _MisbehavingFront for its first
    `bad_starts` starts (then straight to the task server)."""

    def __init__(self, mode: str, bad_starts: int):
        super().__init__()
        self.mode, self.bad_starts, self.starts = mode, bad_starts, 0
        self.front: _MisbehavingFront | None = None

    def start(self) -> None:
        super().start()
        self._started()

    def restart_environment(self) -> None:
        """As ServerBackend does it: a no-op while the environment answers, else stop and start."""
        if self.task_server is not None and self._answers():
            return
        self.stop()
        self.start()

    def _answers(self) -> bool:
        url = self.front.url if self.front is not None else self.task_server.server.url
        try:
            urllib.request.urlopen(url + "/health", timeout=1).close()
        except urllib.error.HTTPError:
            return True  # it answered (404: the task server has no /health)
        except OSError:
            return False
        return True

    def _started(self) -> None:
        self.starts += 1
        if self.starts <= self.bad_starts:
            self.front = _MisbehavingFront(self.mode, self.task_server.server.url)

    def stop(self) -> None:
        front, self.front = self.front, None
        if front is not None:
            front.stop()
        super().stop()

    def _env(self, path: str, body: dict) -> dict:
        if self.starts > self.bad_starts:
            return super()._env(path, body)
        front = self.front
        if front is None:
            raise EnvironmentDown("the environment is not running")
        return post_to_environment(front.url + path, body)


def _run_against(backend: ReferenceBackend, **request) -> tuple[RolloutResponse, dict[str, bool]]:
    episodes, scripts, expected = _scripted_batch("calc-tool", n=1)
    backend.start()
    try:
        with ScriptedPolicyServer(scripts) as policy:
            return BatchRunner(backend).run(RolloutRequest(
                episodes=episodes, policy_base_url=policy.base_url, sampling=SamplingSpec(), concurrency=2,
                **request)), expected
    finally:
        backend.stop()


@pytest.mark.parametrize("mode", ["silent", "partial", "close"])
def test_a_hung_or_broken_environment_is_restarted_and_no_episode_is_lost(mode):
    response, expected = _run_against(_MisbehavingEnvironment(mode, bad_starts=1), max_attempts=3,
                                      episode_timeout_s=1.0)
    assert [r.episode_id for r in response.results] == list(expected)
    assert all(r.status == "completed" and r.success == expected[r.episode_id] for r in response.results), \
        [r.error for r in response.results]
    assert response.environment_restarts >= 1 and any(r.attempts > 1 for r in response.results)


TIMED_OUT = "no result after 0.5 s (episode_timeout_s)"
# The connection failed (refused, reset, closed, cut off mid-reply), or came while a restart was under way.
DOWN = (" unreachable: ", "the environment is not running")


@pytest.mark.parametrize("mode", ["silent", "partial", "close"])
def test_an_environment_that_never_recovers_fails_every_episode_with_the_cause(mode):
    response, expected = _run_against(_MisbehavingEnvironment(mode, bad_starts=10**6), max_attempts=2,
                                      episode_timeout_s=0.5)
    assert [r.episode_id for r in response.results] == list(expected)
    timeouts = 0
    for result in response.results:
        assert result.status == "failed" and result.attempts == 2, result
        attempts = result.error.message.split("; ")
        assert [a.split(":")[0] for a in attempts] == ["attempt 1", "attempt 2"], result.error.message
        # Every attempt names its cause; a dropped connection is also what an episode sees whose server
        # was killed because another episode timed out.
        assert all(TIMED_OUT in a or any(d in a for d in DOWN) for a in attempts), result.error.message
        timeouts += sum(TIMED_OUT in a for a in attempts)
        assert result.error.kind == ("environment-timeout" if TIMED_OUT in attempts[-1] else "environment-down")
    assert (timeouts > 0) == (mode != "close")


def test_a_slow_environment_within_the_timeout_scores_as_the_reference():
    response, expected = _run_against(_MisbehavingEnvironment("slow", bad_starts=1), episode_timeout_s=60)
    assert {r.episode_id: (r.status, r.success, r.attempts) for r in response.results} == {
        episode_id: ("completed", success, 1) for episode_id, success in expected.items()}
    assert response.environment_restarts == 0


def test_a_client_that_hangs_up_before_its_reply_is_one_line_on_the_servers_stderr(capfd):
    """An environment killed mid-call leaves the policy server writing to a closed socket: that is one line on
    its stderr (no socketserver traceback per call), and the server keeps serving."""
    import socket
    import struct

    from runner_kit.http import JsonServer, Reply

    release = threading.Event()

    def slow(call):
        release.wait(10)
        return Reply(200, {"text": "x" * (4 << 20)})  # larger than the socket buffers: the write must fail

    server = JsonServer([("POST", "/slow", slow), ("GET", "/ok", lambda call: Reply(200, {"ok": True}))]).start()
    try:
        client = socket.create_connection(("127.0.0.1", server.port))
        client.sendall(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        time.sleep(0.2)
        client.close()
        release.set()
        deadline, err = time.monotonic() + 10, ""
        while "closed the connection" not in err and time.monotonic() < deadline:
            time.sleep(0.05)
            err += capfd.readouterr().err
        assert "closed the connection before the reply" in err, err
        assert "Traceback" not in err, err
        assert get_json(f"{server.url}/ok") == {"ok": True}
    finally:
        release.set()
        server.stop()


def test_a_streamed_reply_reaches_the_client_event_by_event():
    """Replies are written through a buffer (one write for headers and body), and a streamed reply's events
    still leave one by one: the stream below sends its second event only once the client has read the first."""
    import http.client

    from runner_kit.http import JsonServer, Reply

    first_read = threading.Event()

    def events(call):
        def chunks():
            yield b"data: one\n\n"
            assert first_read.wait(10), "the client never saw the first event"
            yield b"data: [DONE]\n\n"
        return Reply(stream=chunks())

    server = JsonServer([("POST", "/stream", events)]).start()
    try:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        connection.request("POST", "/stream", body=b"{}", headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
        assert response.readline() == b"data: one\n"  # within the timeout: not held in the buffer
        first_read.set()
        assert response.read() == b"\ndata: [DONE]\n\n"
    finally:
        first_read.set()
        server.stop()
