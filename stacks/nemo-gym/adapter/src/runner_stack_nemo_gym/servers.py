"""The NeMo Gym servers this stack runs: a resources server per task family and a vllm_model server that
names the episode on every upstream call. Each runs as its own process (`python -m
runner_stack_nemo_gym.servers <kind>`, or `main(kind)` in a fork of a process that imported this module)
through NeMo Gym's own `run_webserver()`, which reads the injected global config (NEMO_GYM_CONFIG_DICT) and its
instance name (NEMO_GYM_CONFIG_PATH).

Resources server: /seed_session builds the episode's world (family.initial_state) under the session
cookie; every family tool is a POST route answering family.call_tool's text as text/plain (a JSON body
would reach the model as a quoted string); /verify rebuilds the transcript from the agent's Responses
output and scores it with the family's reference scorer.
"""

from __future__ import annotations

import contextvars
import json
import sys
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from nemo_gym.base_resources_server import (
    BaseMultiRewardVerifyResponse,
    BaseResourcesServerConfig,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    SimpleResourcesServer,
)
from nemo_gym.server_utils import SESSION_ID_KEY
from qualification.tasks import TaskItem, ToolCall, Transcript, get_family
from responses_api_models.vllm_model.app import VLLMModel
from runner_kit.processes import freeze_heap

EPISODE_HEADER = "X-Episode-ID"


class FamilyResourcesServerConfig(BaseResourcesServerConfig):
    family: str


class EpisodeSeedRequest(BaseModel):
    """The agent's /run body, forwarded to /seed_session; the extra fields name the episode and its item."""

    model_config = ConfigDict(extra="allow")

    episode_id: str
    task_item: str


class EpisodeVerifyRequest(BaseVerifyRequest):
    model_config = ConfigDict(extra="allow")

    episode_id: str
    task_item: str


class EpisodeVerifyResponse(BaseMultiRewardVerifyResponse):
    model_config = ConfigDict(extra="allow")

    success: bool
    outcome: str
    finish_reason: str
    turns: int
    final_text: str
    tool_calls: list[dict[str, Any]]


class _Session(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    episode_id: str
    item: Any
    state: dict[str, Any]
    executed: list[dict[str, Any]] = Field(default_factory=list)


def _text_of(message: dict[str, Any]) -> str:
    parts = message.get("content") or []
    if isinstance(parts, str):
        return parts
    return "".join(part.get("text", "") for part in parts if part.get("type") == "output_text")


def transcript_from_output(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The episode as the scorer sees it, from a simple_agent Responses output (all turns in order).

    A model turn is a `message` item (when it said something) followed by its `function_call` items; the
    agent appends a `function_call_output` per executed call. Calls without an output were never executed
    (the turn hit max_output_tokens, or the arguments were not JSON) and are not part of the transcript.
    """
    turns: list[dict[str, Any]] = []
    previous = None
    for item in output:
        kind = item.get("type")
        if kind == "message" and item.get("role") == "assistant":
            turns.append({"text": _text_of(item), "calls": []})
        elif kind == "function_call":
            if previous not in ("message", "function_call") or not turns:
                turns.append({"text": "", "calls": []})
            turns[-1]["calls"].append(item)
        previous = kind
    outputs = {item.get("call_id"): item.get("output") for item in output if item.get("type") == "function_call_output"}
    calls = []
    for turn in turns:
        for call in turn["calls"]:
            if call.get("call_id") not in outputs:
                continue
            try:
                arguments = json.loads(call.get("arguments") or "{}")
            except (TypeError, ValueError):
                continue
            result = outputs[call["call_id"]]
            if isinstance(result, list):
                result = "".join(part.get("text", "") for part in result)
            calls.append({"name": call.get("name", ""), "arguments": arguments if isinstance(arguments, dict) else {},
                          "result": result})
    last = turns[-1] if turns else {"text": "", "calls": []}
    # The final answer is the last turn's text when that turn called no tool (as in the reference loop).
    return {"turns": len(turns), "final_text": "" if last["calls"] else last["text"], "tool_calls": calls,
            "ended_on_tool_call": bool(last["calls"])}


class FamilyResourcesServer(SimpleResourcesServer):
    """One task family's tools and reference scorer, with per-episode state keyed by the session cookie."""

    ray_enabled = False
    config: FamilyResourcesServerConfig
    sessions: dict[str, _Session] = Field(default_factory=dict)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        family = get_family(self.config.family)
        for spec in family.tools:
            app.post(f"/{spec.name}")(self._tool_route(spec.name))
        # Names the family does not know still reach family.call_tool, so the model sees the reference's
        # error text instead of FastAPI's 404 body.
        app.post("/{tool_name}")(self._unknown_tool)
        return app

    def _session(self, request: Request) -> _Session:
        session = self.sessions.get(request.session.get(SESSION_ID_KEY, ""))
        if session is None:
            # Raised when the server restarted under a running episode: its state is gone.
            raise HTTPException(409, "unknown session: this resources server has no state for the episode")
        return session

    async def seed_session(self, request: Request, body: EpisodeSeedRequest) -> BaseSeedSessionResponse:
        item = TaskItem.from_json(body.task_item)
        if item.family != self.config.family:
            raise HTTPException(400, f"item of family {item.family!r} sent to the {self.config.family!r} server")
        session_id = request.session[SESSION_ID_KEY]
        self.sessions[session_id] = _Session(episode_id=body.episode_id, item=item,
                                             state=get_family(item.family).initial_state(item))
        return BaseSeedSessionResponse()

    def _tool_route(self, name: str):
        async def tool(request: Request) -> PlainTextResponse:
            return await self._call(request, name)

        tool.__name__ = f"tool_{name}"
        return tool

    async def _unknown_tool(self, tool_name: str, request: Request) -> PlainTextResponse:
        return await self._call(request, tool_name)

    async def _call(self, request: Request, name: str) -> PlainTextResponse:
        session = self._session(request)
        try:
            arguments = await request.json()
        except ValueError:
            arguments = {}
        arguments = arguments if isinstance(arguments, dict) else {}
        try:
            result = get_family(self.config.family).call_tool(session.item, session.state, name, arguments)
        except Exception as error:  # a failing tool is a result the policy sees, as in the reference loop
            result = str({"error": str(error)})
        session.executed.append({"name": name, "arguments": arguments, "result": result})
        return PlainTextResponse(result)

    async def verify(self, request: Request, body: EpisodeVerifyRequest) -> EpisodeVerifyResponse:
        session = self._session(request)
        self.sessions.pop(request.session[SESSION_ID_KEY], None)
        item = TaskItem.from_json(body.task_item)
        response = body.response.model_dump(mode="json")
        seen = transcript_from_output(response.get("output") or [])
        transcript = Transcript(final_text=seen["final_text"],
                                tool_calls=[ToolCall(**call) for call in seen["tool_calls"]])
        score = get_family(item.family).score(item, transcript)
        if response.get("incomplete_details"):
            finish = "length"
        elif seen["ended_on_tool_call"]:
            finish = "max_turns"  # simple_agent stops after max_steps model calls, the last one a tool call
        else:
            finish = "stop"
        truncated = finish != "stop"
        outcome = "success" if score.success else ("truncated" if truncated else score.outcome)
        mismatch = session.executed != seen["tool_calls"]
        return EpisodeVerifyResponse(
            **body.model_dump(), reward=score.reward, reward_components=dict(score.components),
            success=score.success, outcome=outcome, finish_reason=finish, turns=seen["turns"],
            final_text=seen["final_text"], tool_calls=seen["tool_calls"],
            mask_sample=mismatch,
            failure_reason="tool calls in the response differ from the ones this server executed" if mismatch else None,
        )


_EPISODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("runner_episode_id", default=None)


class EpisodeVLLMModel(VLLMModel):
    """vllm_model whose upstream /v1/chat/completions call names its episode twice: the request's
    `metadata.episode_id` (forwarded as-is by the stock server) and the header X-Episode-ID. A request
    without an episode id is refused here rather than sent unattributed."""

    def _preprocess_chat_completion_create_params(self, request: Request, body_dict: dict[str, Any]) -> dict[str, Any]:
        body_dict = super()._preprocess_chat_completion_create_params(request, body_dict)
        episode = (body_dict.get("metadata") or {}).get("episode_id")
        if not episode:
            raise ValueError("policy call without metadata.episode_id: it could not be attributed to an episode")
        _EPISODE.set(str(episode))
        return body_dict

    def _resolve_client(self, request: Request):
        client = super()._resolve_client(request)
        episode = _EPISODE.get()
        if episode is None:
            return client
        return client.model_copy(update={"default_headers": {**client.default_headers, EPISODE_HEADER: episode}})


def main(kind: str, server_class: str | None = None) -> None:
    freeze_heap()
    if kind == "resources" and server_class:  # a team's own resources server (module:Class), as it is
        from runner_kit.native import load_asset

        load_asset(server_class, "Class").run_webserver()
    elif kind == "resources":
        FamilyResourcesServer.run_webserver()
    elif kind == "model":
        EpisodeVLLMModel.run_webserver()
    elif kind == "agent":
        from responses_api_agents.simple_agent.app import SimpleAgent

        SimpleAgent.run_webserver()
    else:
        raise SystemExit(f"unknown server kind {kind!r}: resources | model | agent")


if __name__ == "__main__":
    main(*sys.argv[1:3])
