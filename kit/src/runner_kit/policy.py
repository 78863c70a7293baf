"""The policy server's wire protocol, shared by the real policy server (trainer environment) and the
scripted one (service stage): OpenAI-compatible chat completions with vLLM-style token extras, the
token-in/token-out /inference/v1/generate, and how a call is attributed to an episode.

Attribution channels, in order: URL prefix /episodes/<id>/..., header X-Episode-ID, body
metadata.episode_id (on /inference/v1/generate also sampling_params.metadata.episode_id). A call none of
them names cannot be attributed and is refused (HTTP 400).
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

from .http import Call, HttpError, JsonServer, Reply
from .tool_formats import reply_id

EPISODE_PREFIX = r"(?:/episodes/(?P<episode>[^/]+))?"
CHAT_PATH = EPISODE_PREFIX + r"/v1/chat/completions"
MODELS_PATH = EPISODE_PREFIX + r"/v1/models"
GENERATE_PATH = EPISODE_PREFIX + r"/inference/v1/generate"
EPISODE_HEADER = "X-Episode-ID"
ATTEMPT_MARK = "~attempt-"  # a retried episode's id: "<episode id>~attempt-<n>", n >= 2
UNATTRIBUTED = ("policy call cannot be attributed to an episode: send header X-Episode-ID, body metadata.episode_id "
                "(token-in/token-out: sampling_params.metadata.episode_id), or call through /episodes/<id>/v1")


def episode_of(call: Call) -> tuple[str | None, str]:
    """(episode id, channel) of a policy call; (None, "none") when nothing names the episode."""
    if call.match.groupdict().get("episode"):
        return urllib.parse.unquote(call.match.group("episode")), "path"
    if call.headers.get(EPISODE_HEADER.lower()):
        return call.headers[EPISODE_HEADER.lower()], "header"
    body = call.body if isinstance(call.body, dict) else {}
    # A token-in/token-out client (verifiers' TrainClient) forwards its sampling config, extras included, as
    # sampling_params, and nothing else of a rollout's own: that is where its episode id can travel.
    params = body.get("sampling_params")
    for metadata in (body.get("metadata"), params.get("metadata") if isinstance(params, dict) else None):
        if isinstance(metadata, dict) and metadata.get("episode_id"):
            return str(metadata["episode_id"]), "metadata"
    return None, "none"


def episode_base_url(base_url: str, episode_id: str) -> str:
    """`base_url` (http://HOST:PORT/v1) as a base URL that names the episode in its path, for clients that can
    add neither a header nor a body field."""
    root = base_url.removesuffix("/").removesuffix("/v1")
    return f"{root}/episodes/{urllib.parse.quote(episode_id, safe='')}/v1"


def attempt_id(episode_id: str, attempt: int) -> str:
    """The id a retried attempt uses on the wire, so its calls are told apart from the abandoned ones."""
    return episode_id if attempt == 1 else f"{episode_id}{ATTEMPT_MARK}{attempt}"


def split_attempt(wire_id: str) -> tuple[str, int]:
    """(episode id, attempt) of an id as it arrived."""
    base, mark, number = wire_id.rpartition(ATTEMPT_MARK)
    if mark and number.isdigit():
        return base, int(number)
    return wire_id, 1


def require_episode(call: Call) -> tuple[str, str]:
    episode, channel = episode_of(call)
    if episode is None:
        raise HttpError(400, UNATTRIBUTED)
    return episode, channel


def chat_completion(*, model: str, content: str | None, tool_calls: list[dict[str, Any]], finish_reason: str,
                    prompt_ids: list[int] | None = None, completion_ids: list[int] | None = None,
                    logprobs: list[float] | None = None, want_logprobs: bool = False,
                    want_token_ids: bool = False) -> dict[str, Any]:
    """An OpenAI chat.completion object; vLLM-style `prompt_token_ids` / `token_ids` / logprobs when asked."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
    if want_logprobs and completion_ids is not None and logprobs is not None:
        choice["logprobs"] = {"content": token_logprobs(completion_ids, logprobs)}
    body: dict[str, Any] = {
        "id": f"chatcmpl-{reply_id(64)}", "object": "chat.completion", "created": int(time.time()),
        "model": model, "choices": [choice],
        "usage": {"prompt_tokens": len(prompt_ids or []), "completion_tokens": len(completion_ids or []),
                  "total_tokens": len(prompt_ids or []) + len(completion_ids or [])},
    }
    if want_token_ids and completion_ids is not None:
        choice["token_ids"] = completion_ids
        body["prompt_token_ids"] = prompt_ids
    return body


def tool_call_arguments(call: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of an OpenAI tool call. Arguments that are not a JSON object reach the tool as {},
    so the environment answers with the tool's own error and the call stays on record for the scorer."""
    function = call.get("function") or {}
    raw = function.get("arguments")
    if isinstance(raw, dict):
        return function.get("name", ""), raw
    try:
        parsed = json.loads(raw or "{}")
    except (TypeError, ValueError):
        parsed = None
    return function.get("name", ""), parsed if isinstance(parsed, dict) else {}


def token_logprobs(ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    """vLLM's `return_tokens_as_token_ids` form: one {token: "token_id:<id>", logprob} per sampled token."""
    return [{"token": f"token_id:{token}", "logprob": lp, "bytes": None, "top_logprobs": []}
            for token, lp in zip(ids, logprobs, strict=True)]


def stream_chunks(body: dict[str, Any]) -> Iterator[bytes]:
    """A finished chat.completion replayed as server-sent events (role, content, tool calls, finish, [DONE])."""
    choice = body["choices"][0]
    message = choice["message"]
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}

    def event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()

    yield event({"role": "assistant", "content": ""})
    if message.get("content"):
        yield event({"content": message["content"]}, logprobs=choice.get("logprobs"))
    for index, tool_call in enumerate(message.get("tool_calls") or []):
        yield event({"tool_calls": [{"index": index, **tool_call}]})
    yield event({}, choice["finish_reason"])
    yield b"data: [DONE]\n\n"


def models_body(model: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "runner"}]}


def policy_endpoints(model: str, chat, generate) -> JsonServer:
    """The server of a policy endpoint (not started): /v1/models naming `model`, chat completions answered by
    `chat` and token-in/token-out generate by `generate` (each takes a Call and returns a Reply)."""
    return JsonServer([
        ("GET", MODELS_PATH, lambda call: Reply(body=models_body(model))),
        ("POST", CHAT_PATH, chat),
        ("POST", GENERATE_PATH, generate),
    ])


def openai_tools(family) -> list[dict[str, Any]]:
    """A task family's tools in OpenAI function-calling form, sorted by name: the schema transformers derives
    for the trainer's tool methods, without its `return` key. Environment stacks declare their tools from it."""
    return [
        {"type": "function", "function": {
            "name": spec.name,
            "description": spec.description,
            "parameters": {
                "type": "object",
                "properties": {p.name: {"type": p.type, "description": p.description} for p in spec.params},
                "required": [p.name for p in spec.params],
            },
        }}
        for spec in sorted(family.tools, key=lambda spec: spec.name)
    ]


def canonical_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Request tools in the form the trainer renders them (transformers' get_json_schema of a str-returning
    function, sorted by name), so a prompt is rendered the same whichever stack sent the schema."""
    if not tools:
        return None
    rendered = []
    for tool in tools:
        function = tool.get("function", tool)
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        properties = {name: {"type": spec.get("type", "string"), "description": spec.get("description", "")}
                      for name, spec in (parameters.get("properties") or {}).items()}
        schema: dict[str, Any] = {"type": "object", "properties": properties}
        if parameters.get("required"):
            schema["required"] = list(parameters["required"])
        rendered.append({"type": "function", "function": {
            "name": function["name"], "description": function.get("description", ""), "parameters": schema,
            "return": {"type": "string"}}})
    return sorted(rendered, key=lambda tool: tool["function"]["name"])


def encode_text(tokenizer, text: str) -> list[int]:
    """The ids of rendered `text` (no special tokens added), as transformers' `tokenizer.encode` gives them.

    transformers' encode() calls the fast tokenizer's encode_batch(), which lets go of the GIL and then waits to
    get it back from whatever thread holds it (the sampler's, in the policy server: ~2 ms a call in a train
    stage, for ~0.2 ms of work); the fast tokenizer's own encode() keeps it. The same ids while the backend is as
    transformers' encode() leaves it: no truncation, no padding, special tokens as the tokenizer says."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and backend.truncation is None and backend.padding is None
            and getattr(backend, "encode_special_tokens", None)
            == bool(getattr(tokenizer, "split_special_tokens", False))):
        return backend.encode(text, add_special_tokens=False).ids
    return list(tokenizer.encode(text, add_special_tokens=False))


def canonical_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages reduced to what the chat template renders (tool-call arguments as dicts)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        entry: dict[str, Any] = {"role": message["role"], "content": (content or "").strip()}
        calls = []
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            arguments = function.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError:
                    arguments = {"_raw": arguments}
            calls.append({"type": "function", "function": {"name": function.get("name", ""), "arguments": arguments}})
        if calls:
            entry["tool_calls"] = calls
        if message["role"] == "tool" and message.get("name"):
            entry["name"] = message["name"]
        out.append(entry)
    return out
