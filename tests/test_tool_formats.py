"""Tool-call formats (runner_kit.tool_formats): each format's completions parse the way vLLM's parser of
the same name reads them, what the scripted policy renders parses back to the same calls, and a
malformed call stays content."""

from __future__ import annotations

import json

import pytest
from runner_kit.tool_formats import TOOL_FORMATS, malformed_call, parse_tool_calls, render_tool_calls


def calls_of(text: str, tool_format: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(text, tool_format)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(("tool_format", "text", "content", "calls"), [
    ("hermes", 'Let me add.\n<tool_call>\n{"name": "rechner", "arguments": {"ausdruck": "2 + 3"}}\n</tool_call>',
     "Let me add.", [("rechner", {"ausdruck": "2 + 3"})]),
    ("hermes", "Antwort: 5", "Antwort: 5", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "arguments": {}}; {"name": "b", "parameters": {"x": 1}}', "",
     [("a", {}), ("b", {"x": 1})]),
    ("llama3_json", 'The answer is {"name": "a"}', 'The answer is {"name": "a"}', []),  # not at the start: content
    ("llama3_json", '{"name": "a", "parameters": {}} and more', '{"name": "a", "parameters": {}} and more', []),
    ("llama3_json", '{"answer": 5}', '{"answer": 5}', []),  # JSON, but not a call
    ("mistral", 'Checking.[TOOL_CALLS][{"name": "lookup", "arguments": {"id": "A-1"}, "id": "abc123def"}]',
     "Checking.", [("lookup", {"id": "A-1"})]),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    ("mistral", "Answer: 5", "Answer: 5", []),
])
def test_each_format_reads_completions_as_vllms_parser_of_that_name(tool_format, text, content, calls):
    assert calls_of(text, tool_format) == (content, calls)


@pytest.mark.parametrize("tool_format", TOOL_FORMATS)
def test_rendered_calls_parse_back_and_a_malformed_call_is_content(tool_format):
    calls = [("rechner", {"ausdruck": "12 * 7"}), ("suche", {"frage": "Öffnungszeiten"})]
    text = render_tool_calls(calls, tool_format)
    assert calls_of(text, tool_format)[1] == calls
    broken = malformed_call('{"name": "rechner", "arguments": ', tool_format)
    assert calls_of(broken, tool_format) == (broken, [])
    assert render_tool_calls([], tool_format, "Antwort: 84") == "Antwort: 84"


def test_an_unknown_format_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'; formats are hermes, llama3_json, mistral"):
        parse_tool_calls("x", "xml")


def test_reply_ids_differ_between_a_process_and_its_forks():
    """Chat-completion and tool-call ids come from the kit's own generator, seeded again in every fork: forks of a
    fork server must not hand out the same ids."""
    import os

    from runner_kit.tool_formats import reply_id

    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(write, reply_id(64).encode())
        os._exit(0)
    os.close(write)
    forked = os.read(read, 64).decode()
    os.waitpid(child, 0)
    mine = reply_id(64)
    assert len(mine) == len(forked) == 16 and int(forked, 16) >= 0
    assert forked != mine
