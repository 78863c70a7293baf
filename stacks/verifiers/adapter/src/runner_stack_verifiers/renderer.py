"""The renderer Verifiers' TrainClient uses for our policies (a `renderers` custom renderer).

The tiny policies use TRL's Qwen2.5 chat template with merged added tokens (e.g. one token for
'<tool_call>\\n{"name": "rechner", "arguments": '), so the stock parsers, which look for a '<tool_call>'
token id, never see a tool call, and the stock DefaultRenderer re-renders (re-tokenises) every turn.
This renderer wraps the policy's own chat template and does what the policy server's chat endpoint
does (stacks/trl policy_server): tools rendered as the trainer renders them (transformers' schema of a
str-returning function, sorted by name), message content stripped, Hermes <tool_call> blocks parsed
from the decoded text, and each later turn's prompt built as the previous prompt + the sampled ids +
the ids of the new text only, so sampled tokens are never re-tokenised.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from renderers.base import (
    ParsedResponse,
    ParsedToolCall,
    RenderedTokens,
    ToolCallParseStatus,
    extract_message_tool_names,
)
from jinja2 import TemplateError
from renderers.configs import BaseRendererConfig, DefaultRendererConfig
from renderers.default import DefaultRenderer
from runner_kit.policy import canonical_messages, canonical_tools, encode_text
from runner_kit.tool_formats import completion_text, parse_tool_calls



class PolicyTemplateRendererConfig(BaseRendererConfig):
    name: Literal["policy-template"] = "policy-template"


class PolicyTemplateRenderer(DefaultRenderer):
    config_class = PolicyTemplateRendererConfig
    tool_format = "hermes"  # how the policy writes tool calls; a subclass per format below

    def __init__(self, tokenizer, config: PolicyTemplateRendererConfig | None = None):
        super().__init__(tokenizer, DefaultRendererConfig())
        self.config = config or PolicyTemplateRendererConfig()
        eos = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
        self._turn_close_ids = eos

    @property
    def supports_tools(self) -> bool:
        return True

    def render(self, messages, *, tools=None, add_generation_prompt: bool = False) -> RenderedTokens:
        """DefaultRenderer's per-message attribution, except that a prefix the template cannot render on its own
        is attributed with the message that completes it: Llama 3.1's template puts the tools in the first user
        message and refuses a system-only conversation with tools."""
        token_ids: list[int] = []
        indices: list[int] = []
        for index in range(len(messages)):
            try:
                rendered = self._apply(messages[: index + 1], tools=tools)
            except TemplateError:
                if index == len(messages) - 1:
                    raise
                continue
            indices.extend([index] * (len(rendered) - len(token_ids)))
            token_ids = rendered
        if add_generation_prompt:
            rendered = self._apply(messages, tools=tools, add_generation_prompt=True)
            indices.extend([-1] * (len(rendered) - len(token_ids)))
            token_ids = rendered
        return RenderedTokens(token_ids=token_ids, message_indices=indices,
                              message_roles=[m.get("role") or "" for m in messages],
                              message_tool_names=extract_message_tool_names(messages))

    def _apply(self, messages, *, tools=None, add_generation_prompt=False) -> list[int]:
        return self._encode(self._text(messages, tools, add_generation_prompt))

    def _text(self, messages, tools, add_generation_prompt: bool) -> str:
        return self._tokenizer.apply_chat_template(canonical_messages(_dicts(messages)), tools=canonical_tools(tools),
                                                   tokenize=False, add_generation_prompt=add_generation_prompt)

    def _encode(self, text: str) -> list[int]:
        # on a renderer-pool thread, beside the env server's event loop: the encode that keeps the GIL
        return encode_text(self._tokenizer, text)

    def parse_response(self, token_ids: list[int], *, tools=None, prompt_ids=None) -> ParsedResponse:
        ids = [token for token in token_ids if token not in self._turn_close_ids]
        content, calls = parse_tool_calls(completion_text(self._tokenizer, ids, self.tool_format), self.tool_format)
        # Unique call ids: without one, TrainClient numbers calls per turn ("call_0" in every turn).
        parsed = [ParsedToolCall(raw=json.dumps({"name": call["function"]["name"],
                                                 "arguments": json.loads(call["function"]["arguments"])},
                                                ensure_ascii=False),
                                 name=call["function"]["name"], arguments=json.loads(call["function"]["arguments"]),
                                 status=ToolCallParseStatus.OK, id=call["id"])
                  for call in calls]
        return ParsedResponse(content=content, reasoning_content=None, tool_calls=parsed)

    def bridge_to_next_turn(self, previous_prompt_ids: list[int], previous_completion_ids: list[int],
                            new_messages: list[Any], *, tools=None) -> RenderedTokens | None:
        """previous prompt + sampled ids + ids of the text the template adds for `new_messages` (tool
        results / a user turn) and the generation prompt; None (a full re-render) unless the sampled turn
        ended with the turn-close token."""
        if not previous_completion_ids or previous_completion_ids[-1] not in self._turn_close_ids:
            return None
        messages = canonical_messages(_dicts(new_messages))
        if not messages or any(m["role"] == "assistant" for m in messages):
            return None
        # The template renders a message independently of what precedes it except for the tools header, so
        # the tail is the difference between a stand-in conversation with and without the new messages.
        stand_in = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        render = self._tokenizer.apply_chat_template
        before = render(stand_in, tools=canonical_tools(tools), tokenize=False)
        cuts = [len(before)]
        for k in range(1, len(messages) + 1):
            cuts.append(len(render(stand_in + messages[:k], tools=canonical_tools(tools), tokenize=False)))
        after = render(stand_in + messages, tools=canonical_tools(tools), tokenize=False, add_generation_prompt=True)
        if not after.startswith(before):
            return None
        eos_text = self._tokenizer.eos_token or ""
        glue = before[before.rfind(eos_text) + len(eos_text):] if eos_text and eos_text in before else ""
        tail = glue + after[len(before):]
        encoded = self._tokenizer(tail, add_special_tokens=False, return_offsets_mapping=True)
        ext = list(encoded["input_ids"])
        # Attribute each tail token to the new message whose text it starts in (-1: scaffolding).
        bounds = [(cuts[i] - len(before) + len(glue), cuts[i + 1] - len(before) + len(glue))
                  for i in range(len(messages))]
        indices = []
        for start, _ in encoded["offset_mapping"]:
            owner = next((i for i, (lo, hi) in enumerate(bounds) if lo <= start < hi), -1)
            indices.append(owner)
        previous = list(previous_prompt_ids) + list(previous_completion_ids)
        return RenderedTokens(
            token_ids=previous + ext,
            message_indices=[-1] * len(previous) + indices,
            sampled_mask=[False] * (len(previous) + len(ext)),
            message_roles=[m["role"] for m in messages],
        )


def _dicts(messages: list[Any]) -> list[dict[str, Any]]:
    """verifiers hands messages as pydantic models or dicts."""
    return [message if isinstance(message, dict) else message.model_dump() for message in messages]


# verifiers builds the renderer from its import path alone, in its env server's own process: the path names
# the plan's tool-call format (a module global set by the backend would not reach that process).
HermesRenderer = type("HermesRenderer", (PolicyTemplateRenderer,), {"tool_format": "hermes"})
Llama3JsonRenderer = type("Llama3JsonRenderer", (PolicyTemplateRenderer,), {"tool_format": "llama3_json"})
MistralRenderer = type("MistralRenderer", (PolicyTemplateRenderer,), {"tool_format": "mistral"})
RENDERERS = {"hermes": HermesRenderer, "llama3_json": Llama3JsonRenderer, "mistral": MistralRenderer}


def import_path(tool_format: str) -> str:
    return f"{__name__}.{RENDERERS[tool_format].__name__}"

