"""A scripted policy behind the policy server's protocol: the service stage drives every environment stack
with known-good and known-bad episodes through it, so each stack's native scoring is checked against the
reference scorer without a model.

Each episode's script is a list of assistant turns: {"tool_call": {"name", "arguments"}}, {"text": ...}
or {"raw_tool_call": ...} (a malformed call, returned as plain content). The turn answered is the
number of assistant messages already in the request.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from runner_contracts import PolicyCall

from .http import Call, HttpError, Reply
from .policy import (
    CHAT_PATH,
    chat_completion,
    episode_of,
    policy_endpoints,
    require_episode,
    split_attempt,
    stream_chunks,
)
from .tool_formats import malformed_call


class ScriptedPolicyServer:
    """Serves scripts[episode_id] on 127.0.0.1; `calls` lists every request with its attribution."""

    model = "scripted-policy"

    def __init__(self, scripts: dict[str, list[dict[str, Any]]], tool_format: str = "hermes"):
        self.scripts = scripts
        self.tool_format = tool_format  # how a malformed call is written (the plan's policy.tool_format)
        self.calls: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._server = policy_endpoints(self.model, self._chat, self._generate)

    @property
    def base_url(self) -> str:
        return self._server.url + "/v1"

    def __enter__(self) -> ScriptedPolicyServer:
        self._server.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.stop()

    def call_records(self) -> list[PolicyCall]:
        """`calls` as policy-call records (no token ids: the script answers in text), for the host's audit."""
        records, index = [], {}
        with self._lock:
            calls = list(self.calls)
        for number, call in enumerate(calls):
            key = (call["episode_id"], call["attempt"])
            index[key] = index.get(key, -1) + 1
            records.append(PolicyCall(call_id=f"scripted-{number}", episode_id=call["episode_id"],
                                      channel=call["channel"], endpoint=CHAT_PATH, attempt=call["attempt"],
                                      index_in_episode=index[key], policy_revision="scripted", prompt_ids=[],
                                      completion_ids=[], logprobs=[], finish_reason=""))
        return records

    def _chat(self, call: Call) -> Reply:
        wire_id, channel = episode_of(call)
        episode, attempt = split_attempt(wire_id) if wire_id is not None else (None, 1)
        body = call.body or {}
        with self._lock:
            self.calls.append({"episode_id": episode, "wire_id": wire_id, "attempt": attempt, "channel": channel,
                               "body": body})
        require_episode(call)
        if episode not in self.scripts:
            raise HttpError(404, f"no script for episode {episode!r}")
        turn_index = sum(1 for message in body.get("messages", []) if message.get("role") == "assistant")
        turns = self.scripts[episode]
        if turn_index >= len(turns):
            turn = {"text": ""}  # the script has ended: an empty final answer
        else:
            turn = turns[turn_index]
        content: str | None
        if "tool_call" in turn:
            call_spec = turn["tool_call"]
            content, finish = None, "tool_calls"
            tool_calls = [{"id": f"call_{turn_index}", "type": "function",
                           "function": {"name": call_spec["name"],
                                        "arguments": json.dumps(call_spec["arguments"], ensure_ascii=False)}}]
        elif "raw_tool_call" in turn:
            content, finish, tool_calls = malformed_call(turn["raw_tool_call"], self.tool_format), "stop", []
        else:
            content, finish, tool_calls = turn["text"], "stop", []
        completion = chat_completion(model=body.get("model") or self.model, content=content,
                                     tool_calls=tool_calls, finish_reason=finish)
        if body.get("stream"):
            return Reply(stream=stream_chunks(completion))
        return Reply(body=completion)

    def _generate(self, call: Call) -> Reply:
        raise HttpError(501, "the scripted policy has no tokenizer: token-in/token-out clients must use "
                             "/v1/chat/completions for scripted episodes")
