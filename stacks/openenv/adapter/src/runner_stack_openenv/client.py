"""The EnvClient of the task environment (OpenEnv's WebSocket session client, one session per episode)."""

from __future__ import annotations

from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from websockets.protocol import State as SocketState

from .models import TaskAction, TaskObservation, TaskState


class OneSessionClient(EnvClient):
    """One client is one episode: once its socket has dropped it refuses to reconnect. Upstream's EnvClient
    reconnects a closed socket on the next call, which opens a fresh server session (a new Environment
    instance without the episode's item, state or tool calls) and carries on as if nothing happened."""

    _opened = False

    async def _ensure_connected(self) -> None:
        if self._opened and (self._ws is None or self._ws.state in (SocketState.CLOSING, SocketState.CLOSED)):
            raise ConnectionError(f"the WebSocket session to {self._ws_url} dropped; its episode state is gone")
        await super()._ensure_connected()
        self._opened = True


class TaskEnvClient(OneSessionClient, EnvClient[TaskAction, TaskObservation, TaskState]):
    """Speaks the task environment's wire format: actions are their model dump, observations come back whole."""

    def _step_payload(self, action: TaskAction) -> dict[str, Any]:
        return action.model_dump()

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[TaskObservation]:
        fields = dict(payload.get("observation") or {})
        fields["done"] = payload.get("done", False)
        fields["reward"] = payload.get("reward")
        fields["metadata"] = payload.get("metadata") or fields.get("metadata") or {}
        observation = TaskObservation.model_validate(fields)
        return StepResult(observation=observation, reward=payload.get("reward"), done=bool(payload.get("done")),
                          metadata=payload.get("metadata"))

    def _parse_state(self, payload: dict[str, Any]) -> TaskState:
        return TaskState.model_validate(payload)


class NativeEnvClient(OneSessionClient, EnvClient[dict, dict, dict]):
    """A team's MCP environment over the same WebSocket session: actions are the wire dicts of OpenEnv's
    ListToolsAction and CallToolAction, observations come back as the server sent them."""

    def _step_payload(self, action: dict[str, Any]) -> dict[str, Any]:
        return action

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[dict]:
        return StepResult(observation=dict(payload.get("observation") or {}), reward=payload.get("reward"),
                          done=bool(payload.get("done")), metadata=payload.get("metadata"))

    def _parse_state(self, payload: dict[str, Any]) -> dict:
        return dict(payload)
