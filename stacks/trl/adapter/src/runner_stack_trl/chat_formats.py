"""Chat templates of the tiny policies, and the response templates TRL parses completions with.

The tiny Qwen2 and Llama use TRL's copies of Qwen2.5's and Llama 3.1's templates (Llama's with its fixed
date, so the same conversation always renders the same). Mistral's official v3 template puts the tool
schemas before the *last* user message and drops the system prompt when tools are given, so an earlier
turn renders differently once the conversation grows: multi-turn RL needs every turn's prompt to extend
the last. The tiny Mistral's template keeps Mistral v3's control tokens and call syntax
(`[TOOL_CALLS][{"name": ..., "arguments": ...}]</s>`) with the schemas before the first user message.
"""

from __future__ import annotations

from typing import Any

MISTRAL_TEMPLATE = """{{- bos_token }}
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if tools %}
    {{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}
        {{- '[INST]' }}
        {%- if loop.first and system_message %}
            {{- system_message + '\\n\\n' }}
        {%- endif %}
        {{- message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- message['content'] or '' }}
        {%- if message.tool_calls %}
            {{- '[TOOL_CALLS][' }}
            {%- for tool_call in message.tool_calls %}
                {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
                {{- '{"name": ' + (call.name | tojson) + ', "arguments": ' + (call.arguments | tojson) + '}' }}
                {%- if not loop.last %}
                    {{- ', ' }}
                {%- endif %}
            {%- endfor %}
            {{- ']' }}
        {%- endif %}
        {{- eos_token }}
    {%- elif message['role'] == 'tool' %}
        {{- '[TOOL_RESULTS]' + message['content'] + '[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}"""


def _trl_template(name: str):
    def template() -> str:
        from trl import chat_template_utils

        return getattr(chat_template_utils, name)
    return template


TEMPLATES = {"qwen2": _trl_template("qwen2_5_chat_template"), "llama": _trl_template("llama3_1_chat_template"),
             "mistral": lambda: MISTRAL_TEMPLATE}

# transformers' response_template for `[TOOL_CALLS][...]` completions (TRL ships none for Mistral).
MISTRAL_RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": ["[/INST]", "[/TOOL_RESULTS]"],
    "fields": {
        "content": {"close_pattern": r"</s>\s*", "content": "text"},
        "tool_calls": {"open": "[TOOL_CALLS]", "close_pattern": r"</s>\s*", "content": "json", "transform_each": True,
                       "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}}},
    },
}


def with_response_parser(tokenizer, tool_format: str):
    """The tokenizer, able to parse its completions as TRL's multi-turn loop does (TRL's own response
    template for the chat templates it knows; Mistral's call syntax otherwise, for the mistral format)."""
    from trl.chat_template_utils import add_response_schema

    if getattr(tokenizer, "response_template", None) is not None:
        return tokenizer
    try:
        return add_response_schema(tokenizer)
    except ValueError:
        if tool_format != "mistral":
            raise ValueError(f"TRL cannot parse this checkpoint's {tool_format} tool calls: its chat template is "
                             "none TRL knows (trl.chat_template_utils.add_response_schema) and the checkpoint sets no "
                             "response_template") from None
    tokenizer.response_template = MISTRAL_RESPONSE_TEMPLATE
    return tokenizer
