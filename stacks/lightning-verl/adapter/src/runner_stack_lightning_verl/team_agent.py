"""An example team harness: a plain agent program with its own tool loop and OpenAI SDK calls, no training code.

It knows an OpenAI-compatible base URL (OPENAI_BASE_URL, OPENAI_API_KEY; the standard `openai` client
environment) and nothing else about the model: no sampling settings, no episode ids, no token data. Its
task arrives as JSON on stdin: {"family": name, "item": TaskItem JSON, "max_turns": n}; its tools are the
task family's own implementations, run in this process. It prints one JSON transcript on stdout:
{"final_text", "tool_calls": [{name, arguments, result}], "turns", "finish_reason"}.

    echo '{...}' | OPENAI_BASE_URL=http://127.0.0.1:PORT/v1 OPENAI_API_KEY=k \
        python -m runner_stack_lightning_verl.team_agent
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from openai import OpenAI
from qualification.tasks import TaskItem, get_family, opening_messages
from runner_kit.policy import openai_tools


def _arguments(raw: str | None) -> dict[str, Any]:
    """Arguments that are not a JSON object reach the tool as {} (the tool answers with its own error)."""
    try:
        parsed = json.loads(raw or "{}")
    except (TypeError, ValueError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def run(task: dict[str, Any], client: OpenAI, model: str) -> dict[str, Any]:
    family = get_family(task["family"])
    item = TaskItem.from_json(task["item"])
    tools = openai_tools(family)
    state = family.initial_state(item)
    messages = opening_messages(family, item)
    record: list[dict[str, Any]] = []
    final_text, finish, turns = "", "max_turns", 0
    while turns < int(task["max_turns"]):
        extra = {"tools": tools} if tools else {}
        completion = client.chat.completions.create(model=model, messages=messages, **extra)
        turns += 1
        choice = completion.choices[0]
        message, finish = choice.message, choice.finish_reason or ""
        calls = [call for call in (message.tool_calls or []) if getattr(call, "function", None) is not None]
        if not calls:
            final_text = message.content or ""
            break
        messages.append({"role": "assistant", "content": message.content or "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}
            for call in calls]})
        for call in calls:
            arguments = _arguments(call.function.arguments)
            result = family.call_tool(item, state, call.function.name, arguments)
            record.append({"name": call.function.name, "arguments": arguments, "result": result})
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": result})
    else:
        finish = "max_turns"
    return {"final_text": final_text, "tool_calls": record, "turns": turns, "finish_reason": finish}


def main() -> None:
    task = json.loads(sys.stdin.read())
    # The SDK's own retries would re-send a call the gateway already forwarded; a failure ends the program.
    client = OpenAI(max_retries=0, timeout=float(os.environ.get("TEAM_AGENT_TIMEOUT_S", "300")))
    transcript = run(task, client, os.environ.get("OPENAI_MODEL", "policy"))
    sys.stdout.write(json.dumps(transcript) + "\n")


if __name__ == "__main__":
    main()
