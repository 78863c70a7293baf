"""Tool-call formats: how a checkpoint writes a tool call in its completion text, and how the policy
server, the scripted policy and every arm that reads raw text parse it back into OpenAI tool_calls. One
choice per plan (`policy.tool_format`), the names vLLM's `--tool-call-parser` uses:

- hermes (Qwen2/2.5, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks;
- llama3_json (Llama 3.1-3.3): the whole completion is `{"name": ..., "parameters": {...}}` (optionally
  after `<|python_tag|>`, several joined by "; "; "arguments" is read too), content otherwise;
- mistral: content, then `[TOOL_CALLS]` and a JSON list `[{"name": ..., "arguments": {...}}]`.

As in vLLM, text that does not parse completely stays the message's content with no tool call, so a
malformed call reaches the environment as an answer and the scorer judges it."""

from __future__ import annotations

import json
import os
import random
import re
from typing import Any, get_args

from runner_contracts import ToolFormat

TOOL_FORMATS: tuple[str, ...] = get_args(ToolFormat)

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL = "[TOOL_CALLS]"
_MARKER_TOKENS = {"hermes": "<tool_call>", "llama3_json": _PYTHON_TAG, "mistral": _MISTRAL}


# Reply and tool-call ids are random, as OpenAI's are, from a generator of their own: uuid4 reads os.urandom,
# which lets go of the GIL (a wait to get it back in the policy server's busy process), and the random
# module's shared generator is the trainer's.
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)  # forks of a fork server draw their own ids


def reply_id(bits: int) -> str:
    """A random hex id of `bits` bits (a multiple of 4), for chat completions and tool calls."""
    return f"{_ids.getrandbits(bits):0{bits // 4}x}"


def openai_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{reply_id(48)}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _named(parsed: Any, key: str) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of one decoded call object; TypeError when it is not one."""
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        raise TypeError
    arguments = parsed.get(key, parsed.get("arguments", {}))
    if not isinstance(arguments, dict):
        raise TypeError
    return parsed["name"], arguments


def _hermes(text: str) -> tuple[str, list[dict[str, Any]]]:
    calls = []
    for block in _HERMES.findall(text):
        try:
            calls.append(openai_call(*_named(json.loads(block), "arguments")))
        except (ValueError, TypeError):
            return text, []
    return (_HERMES.sub("", text).strip(), calls) if calls else (text, [])


def _llama3_json(text: str) -> tuple[str, list[dict[str, Any]]]:
    body = text.strip()
    body = body[len(_PYTHON_TAG):].lstrip() if body.startswith(_PYTHON_TAG) else body
    if not body.startswith("{"):
        return text, []
    calls, decoder, position = [], json.JSONDecoder(), 0
    try:
        while True:
            parsed, end = decoder.raw_decode(body, position)
            calls.append(openai_call(*_named(parsed, "parameters")))
            rest = body[end:].lstrip()
            if not rest:
                return "", calls
            after = rest[1:].lstrip() if rest.startswith(";") else ""
            if not after:  # anything but "; {next call}" after a call: not a call at all
                return text, []
            position = len(body) - len(after)
    except (ValueError, TypeError):
        return text, []


def _mistral(text: str) -> tuple[str, list[dict[str, Any]]]:
    if _MISTRAL not in text:
        return text, []
    content, _, payload = text.partition(_MISTRAL)
    try:
        parsed = json.loads(payload.strip())
        calls = [openai_call(*_named(call, "arguments")) for call in (parsed if isinstance(parsed, list) else [parsed])]
    except (ValueError, TypeError):
        return text, []
    return (content.strip(), calls) if calls else (text, [])


_PARSERS = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral}


def parse_tool_calls(text: str, tool_format: str = "hermes") -> tuple[str, list[dict[str, Any]]]:
    """(remaining content, OpenAI tool_calls) of a completion in `tool_format`."""
    return _PARSERS[check_format(tool_format)](text)


def render_tool_calls(calls: list[tuple[str, dict[str, Any]]], tool_format: str = "hermes",
                      content: str = "") -> str:
    """The completion text a model of `tool_format` writes for `content` followed by these calls."""
    if not calls:
        return content
    if check_format(tool_format) == "hermes":
        blocks = [f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
                  for n, a in calls]
        return "\n".join(([content] if content else []) + blocks)
    if tool_format == "llama3_json":  # as Llama 3.1's template renders calls: instead of content, no python tag
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)
    payload = json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)
    return f"{content}{_MISTRAL}{payload}"


def malformed_call(raw: str, tool_format: str = "hermes") -> str:
    """A cut-off call in `tool_format` (the scripted policy's malformed-call turn): it parses as no call."""
    return {"hermes": f"<tool_call>\n{raw}\n</tool_call>", "llama3_json": f"{_PYTHON_TAG}{raw}",
            "mistral": f"{_MISTRAL}[{raw}"}[check_format(tool_format)]


def completion_text(tokenizer, ids: list[int], tool_format: str = "hermes") -> str:
    """The text the format's parser reads from sampled ids: special tokens (end of turn, padding) dropped,
    except the format's own call marker, which Mistral and Llama tokenizers hold as a special token
    (vLLM's mistral parser decodes with special tokens kept for the same reason)."""
    marker = _MARKER_TOKENS[check_format(tool_format)]
    marker_id = tokenizer.convert_tokens_to_ids(marker)
    if not isinstance(marker_id, int) or marker_id == tokenizer.unk_token_id or marker_id not in ids:
        return tokenizer.decode(ids, skip_special_tokens=True)
    pieces, current = [], []
    for token in ids:
        if token == marker_id:
            pieces.append(current)
            current = []
        else:
            current.append(token)
    return marker.join(tokenizer.decode(piece, skip_special_tokens=True) for piece in [*pieces, current])


def check_format(tool_format: str) -> str:
    if tool_format not in _PARSERS:
        raise ValueError(f"unknown tool-call format {tool_format!r}; formats are {', '.join(TOOL_FORMATS)}")
    return tool_format
