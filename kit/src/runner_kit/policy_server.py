"""The policy server environment stacks call: OpenAI-compatible chat completions (streaming or not, tool
calls, vLLM-style token ids and logprobs), /v1/models, and the token-in/token-out /inference/v1/generate,
backed by the trainer's current weights (the same model object GRPO updates).

Token truth: every call is logged (PolicyCall) with the exact prompt ids it sampled from, the sampled ids
and their logprobs under the processed sampling distribution. A chat request that repeats an episode's
conversation plus new messages is tokenised as the episode's previous ids + the ids of the new text, so
the assistant turns the server sampled are never re-tokenised; when the history differs from what the
server returned (an edited turn), the conversation is rendered afresh and the trainer counts the break.

Sampling is seeded per call from (plan seed, episode id, call index), so an episode's tokens do not
depend on how concurrent episodes interleave, and a resumed run samples what the uninterrupted one did.
Concurrent calls share decode steps (batching.py), bit-identical to sampling each call alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner_contracts import JsonlWriter, PolicyCall, SamplingSpec

from .batching import MAX_ROWS, BatchingSampler
from .http import Call, HttpError, Reply
from .policy import (
    UNATTRIBUTED,
    canonical_messages,
    canonical_tools,
    chat_completion,
    encode_text,
    episode_of,
    policy_endpoints,
    split_attempt,
    stream_chunks,
    token_logprobs,
)
from .tool_formats import completion_text, parse_tool_calls


class CallHold:
    """The host's fault injection made independent of sampling speed: once `after_episodes` episodes have
    called, every call of any other episode waits until the host creates `release_file` (it does so right after
    it has SIGKILLed the environment), so those episodes meet the dead environment however fast the batch runs.
    Waits at most `timeout_s`, then lets the calls through and says so in the evidence."""

    def __init__(self, after_episodes: int, release_file: Path, timeout_s: float = 120.0):
        self.after, self.release_file, self.timeout_s = after_episodes, release_file, timeout_s
        self._admitted: set[str] = set()
        self._lock = threading.Lock()
        self.held_calls = 0
        self.released: str | None = None  # "by the host" or "timeout"
        self.waited_s = 0.0

    def wait(self, episode: str) -> None:
        with self._lock:
            if self.released or episode in self._admitted or len(self._admitted) < self.after:
                self._admitted.add(episode)
                return
            self.held_calls += 1
        started = time.monotonic()
        while not self.release_file.exists() and time.monotonic() - started < self.timeout_s:
            time.sleep(0.02)
        with self._lock:
            if self.released is None:
                self.released = "by the host" if self.release_file.exists() else "timeout"
                self.waited_s = round(time.monotonic() - started, 3)

    def evidence(self) -> dict[str, Any]:
        return {"after_episodes": self.after, "held_calls": self.held_calls, "released": self.released,
                "waited_s": self.waited_s}


class _CallLog:
    """Writes policy calls to their JSONL file from a thread of its own, each batch of waiting records written,
    flushed and fsynced at once: a call's reply does not wait for the disk. (Written by the handler under the
    server's lock, every call's fsync, and the GIL taken back after it, held up the other calls: 5.5 s of lock
    waits over 400 calls of a train stage whose rollouts took ~3 s in all, on 2 cores.)"""

    def __init__(self, path: Path):
        self._writer = JsonlWriter(path)
        self._queue: queue.SimpleQueue[PolicyCall | None] = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="policy-call-log", daemon=True)
        self._thread.start()

    def write(self, record: PolicyCall) -> None:
        """Queues `record` (in call order: the caller holds the server's lock); raises if writing has failed."""
        self._raise_if_failed()
        self._queue.put(record)

    def close(self, ok: bool = True) -> None:
        """Writes what is queued, then finalises the file (ok) or leaves it marked partial."""
        self._queue.put(None)
        self._thread.join()
        if self._failed is None:
            self._writer.close() if ok else self._writer.abandon()
            return
        with contextlib.suppress(OSError):  # what did reach the file stays, marked partial
            self._writer.abandon()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"the policy call log cannot be written: {self._failed}") from self._failed

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(self._queue.get_nowait())
            try:
                for record in batch:
                    if record is not None:
                        self._writer.write(record)
                self._writer.flush()
            except OSError as error:  # a full or failing disk: the next call and close() say so
                self._failed = error
                return
            if None in batch:
                return


def call_seed(base_seed: int, episode_id: str, index: int) -> int:
    digest = hashlib.sha256(f"{base_seed}\0{episode_id}\0{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class _EpisodeHistory:
    messages: list[dict[str, Any]] = field(default_factory=list)  # canonical, ending with the sampled turn
    ids: list[int] = field(default_factory=list)  # prompt + sampled ids of the last call
    calls: int = 0
    reusable: bool = False  # the last turn ended with EOS, so its ids close the assistant message


class PolicyServer:
    """Serves `model` (shared with the trainer) on 127.0.0.1; logs every call to `calls_path`."""

    model_name = "policy"

    def __init__(self, model, tokenizer, *, sampling: SamplingSpec, calls_path: Path, revision: str,
                 tool_format: str = "hermes", max_rows: int = MAX_ROWS, hold: CallHold | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.tool_format = tool_format  # how the checkpoint writes tool calls (plan policy.tool_format)
        self.sampling = sampling
        self.revision = revision
        self.greedy = False  # evaluation decodes greedily whatever the request asks, as the trl arm does
        self.hold = hold
        self.sampler = BatchingSampler(model, {tokenizer.eos_token_id} | ({tokenizer.pad_token_id} - {None}),
                                       max_rows=max_rows)
        self._log_file = _CallLog(calls_path)
        self._log_lock = threading.Lock()
        self._episodes: dict[str, _EpisodeHistory] = {}
        self._calls: dict[tuple[str | None, int], list[PolicyCall]] = {}  # (episode, attempt) -> calls in order
        self._unattributed = 0
        self._server = policy_endpoints(self.model_name, self._chat, self._generate_tokens)

    @property
    def base_url(self) -> str:
        return self._server.url + "/v1"

    def start(self) -> PolicyServer:
        self._server.start()
        return self

    def close(self, ok: bool = True) -> None:
        self._server.stop()
        self.sampler.close()
        self._log_file.close(ok)

    def calls_of(self, episode_id: str, attempt: int = 1) -> list[PolicyCall]:
        """The calls of one attempt at an episode, in order."""
        with self._log_lock:
            return list(self._calls.get((episode_id, attempt), ()))

    # --- sampling ---------------------------------------------------------------------------------------

    def _sample_logged(self, wire_id: str, channel: str, endpoint: str, prompt_ids: list[int],
                       body: dict[str, Any], index: int) -> PolicyCall:
        episode, attempt = split_attempt(wire_id)
        if self.hold is not None:
            self.hold.wait(episode)
        started = time.monotonic()
        revision = self.revision
        ids, logprobs, finish = self.sampler.sample(
            prompt_ids,
            max_new_tokens=int(body.get("max_tokens") or body.get("max_completion_tokens")
                               or self.sampling.max_new_tokens),
            temperature=float(body["temperature"]) if body.get("temperature") is not None else self.sampling.temperature,
            top_p=float(body["top_p"]) if body.get("top_p") is not None else self.sampling.top_p,
            top_k=int(body["top_k"]) if body.get("top_k") is not None else self.sampling.top_k,
            seed=call_seed(self.sampling.seed, episode, index),  # a retry re-samples what attempt 1 would
            greedy=self.greedy)
        record = PolicyCall(call_id=f"{wire_id}#{index}", episode_id=episode, channel=channel, endpoint=endpoint,
                            attempt=attempt, index_in_episode=index, policy_revision=revision, prompt_ids=prompt_ids,
                            completion_ids=ids, logprobs=logprobs, finish_reason=finish,
                            seconds=round(time.monotonic() - started, 4))
        self._log(record)
        return record

    def _log(self, record: PolicyCall) -> None:
        with self._log_lock:
            self._calls.setdefault((record.episode_id, record.attempt), []).append(record)
            self._log_file.write(record)

    def _next_call(self, episode: str) -> tuple[_EpisodeHistory, int]:
        """The episode's history and the index of its call being made (counted now)."""
        with self._log_lock:
            history = self._episodes.setdefault(episode, _EpisodeHistory())
            history.calls += 1
            return history, history.calls - 1

    def _attribute(self, call: Call, endpoint: str) -> tuple[str, str]:
        episode, channel = episode_of(call)
        if episode is None:
            with self._log_lock:
                self._unattributed += 1
                number = self._unattributed
            self._log(PolicyCall(call_id=f"unattributed#{number}", episode_id=None, channel="none",
                                 endpoint=endpoint, index_in_episode=0, policy_revision=self.revision,
                                 prompt_ids=[], completion_ids=[], logprobs=[], finish_reason="refused"))
            raise HttpError(400, UNATTRIBUTED)
        return episode, channel

    # --- endpoints -------------------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, Any]], tools, *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _prompt_ids(self, history: _EpisodeHistory, messages: list[dict[str, Any]], tools) -> list[int]:
        known = len(history.messages)
        if history.reusable and len(messages) > known and messages[:known] == history.messages:
            before = self._render(history.messages, tools, generation_prompt=False)
            after = self._render(messages, tools, generation_prompt=True)
            if after.startswith(before):
                eos_text = self.tokenizer.eos_token
                glue = before[before.rfind(eos_text) + len(eos_text):] if eos_text in before else ""
                return history.ids + encode_text(self.tokenizer, glue + after[len(before):])
        return encode_text(self.tokenizer, self._render(messages, tools, generation_prompt=True))

    def _chat(self, call: Call) -> Reply:
        body = call.body or {}
        episode, channel = self._attribute(call, "chat")
        messages = canonical_messages(body.get("messages") or [])
        if not messages:
            raise HttpError(400, "messages must be a non-empty list")
        tools = canonical_tools(body.get("tools"))
        history, index = self._next_call(episode)
        prompt_ids = self._prompt_ids(history, messages, tools)
        record = self._sample_logged(episode, channel, "chat", prompt_ids, body, index)
        text = completion_text(self.tokenizer, record.completion_ids, self.tool_format)
        content, tool_calls = parse_tool_calls(text, self.tool_format)
        finish = "tool_calls" if tool_calls else record.finish_reason
        reply = {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}
        with self._log_lock:
            self._episodes[episode] = _EpisodeHistory(
                messages=messages + canonical_messages([reply]), ids=prompt_ids + record.completion_ids,
                calls=history.calls, reusable=record.finish_reason == "stop")
        completion = chat_completion(
            model=body.get("model") or self.model_name, content=content or (None if tool_calls else ""),
            tool_calls=tool_calls, finish_reason=finish, prompt_ids=prompt_ids, completion_ids=record.completion_ids,
            logprobs=record.logprobs, want_logprobs=bool(body.get("logprobs")),
            want_token_ids=bool(body.get("return_token_ids") or body.get("return_tokens_as_token_ids")
                                or body.get("logprobs")))
        if body.get("stream"):
            return Reply(stream=stream_chunks(completion))
        return Reply(body=completion)

    def _generate_tokens(self, call: Call) -> Reply:
        """Token-in/token-out: {token_ids, sampling_params} -> choices[0] {token_ids, logprobs, finish_reason}."""
        body = call.body or {}
        episode, channel = self._attribute(call, "generate")
        prompt_ids = body.get("token_ids") or body.get("prompt_token_ids")
        if not isinstance(prompt_ids, list) or not all(isinstance(t, int) and t >= 0 for t in prompt_ids):
            raise HttpError(400, "token_ids must be a list of non-negative integers")
        params = dict(body.get("sampling_params") or {})
        _, index = self._next_call(episode)
        record = self._sample_logged(episode, channel, "generate", prompt_ids, params, index)
        return Reply(body={"choices": [{
            "index": 0, "token_ids": record.completion_ids, "finish_reason": record.finish_reason,
            "text": completion_text(self.tokenizer, record.completion_ids, self.tool_format),
            "logprobs": {"content": token_logprobs(record.completion_ids, record.logprobs)},
        }], "prompt_token_ids": prompt_ids, "model": self.model_name})
