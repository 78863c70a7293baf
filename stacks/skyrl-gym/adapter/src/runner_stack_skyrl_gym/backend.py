"""The skyrl-gym rollout backend: SkyRLGymGenerator's agent loop over our SkyRL Gym env, the policy over HTTP.

Per episode, in the generator's order (skyrl/train/generators/skyrl_gym_generator.py, skyrl 0.3.0): one env
from `skyrl_gym.make(ENV_ID, env_config=..., extras=...)`, `init(prompt)`, then per turn a model call to the
policy's /v1/chat/completions with header X-Episode-ID and `env.step(<the turn as text>)` until the env says
done; the step's observations follow the assistant turn in the conversation, as the generator appends them.

Deviations (stack.toml): the envs live in a worker process (worker.py) so that a crash is real; the policy
server answers OpenAI messages, so the env steps on the turn rebuilt as Hermes text, and the conversation
keeps the assistant message as the server returned it (the server's prefix continuity needs that).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from qualification.tasks import NativeFamily, TaskItem, get_family, opening_messages
from runner_contracts import EpisodeResult, EpisodeSpec, NativeAsset, ToolCallRecord
from runner_kit.native import import_asset_module
from runner_kit.policy import tool_call_arguments
from runner_kit.processes import SocketServer
from runner_kit.rollout import EnvironmentDown, PolicyEndpoint, ServerBackend, post_to_environment
from runner_kit.tool_formats import render_tool_calls


class EnvWorker(SocketServer):
    """worker.py as a subprocess, on a socket bound here to 127.0.0.1; `modules` are imported there first."""

    name = "skyrl-gym env worker"

    def __init__(self, modules: tuple[str, ...] = ()):
        super().__init__()
        self.modules = modules

    def command(self) -> list[str]:
        return [sys.executable, "-m", "runner_stack_skyrl_gym.worker", *(f"--import={m}" for m in self.modules)]


class SkyRLGymBackend(ServerBackend):
    stack = "skyrl-gym"
    upstream_name = "skyrl-gym"
    capabilities = ["multi-turn-tools", "stateful-tools", "concurrent-episodes", "environment-restart", "cpu",
                    "token-capture:policy-server", "episode-id:header", "native-assets"]
    episode_id_channel = "header X-Episode-ID"  # our loop makes every model call; the env never sees the id

    def __init__(self, policy_timeout_s: float = 300.0, native: NativeAsset | None = None):
        super().__init__()
        self.native = native
        self.server = EnvWorker((native.module,) if native is not None and native.module else ())
        self.policy_timeout_s = policy_timeout_s

    def start(self) -> None:
        if self.native is not None:
            check_native_env(self.native)
        super().start()

    def run_episode(self, episode: EpisodeSpec, policy: PolicyEndpoint) -> EpisodeResult:
        started = time.monotonic()
        item, family = TaskItem.from_json(episode.item), get_family(episode.family)
        if isinstance(family, NativeFamily):
            return self._native_episode(episode, item, family, policy, started)
        url = self.running_url()

        def env(path: str, **body: Any) -> Any:
            return post_to_environment(url + path, {"episode_id": episode.episode_id, **body})

        made = env("/make", extras={"item": episode.item, "max_turns": episode.max_turns,
                                    "tool_format": policy.tool_format},
                   prompt=opening_messages(family, item))
        messages, tools = made["prompt"], made["info"]["tools"]
        try:
            while True:  # the env ends the episode: a final answer, or its turn limit
                message, finish = policy.chat(episode.episode_id, messages, tools, timeout_s=self.policy_timeout_s)
                text, calls = message.get("content") or "", message.get("tool_calls") or []
                out = env("/step", action=action_text(text, calls, policy.tool_format))
                if out["done"]:
                    break
                messages.append({"role": "assistant", "content": text, "tool_calls": calls})
                messages += [{**observation, "tool_call_id": call.get("id", "")}
                             for call, observation in zip(calls, out["observations"], strict=True)]
        finally:
            try:
                env("/close")
            except EnvironmentDown:
                pass
        meta = out["metadata"]
        finish = "max_turns" if meta["truncated"] else finish
        truncated = finish in ("length", "max_turns") and not meta["success"]
        return EpisodeResult(
            episode_id=episode.episode_id, task_id=episode.task_id, status="completed", reward=float(out["reward"]),
            reward_components=dict(meta["components"]), success=meta["success"],
            outcome="truncated" if truncated else meta["outcome"], finish_reason=finish, turns=out["turns"],
            final_text=meta["final_text"], tool_calls=[ToolCallRecord(**c) for c in meta["tool_calls"]],
            seconds=round(time.monotonic() - started, 3))


    def _native_episode(self, episode: EpisodeSpec, item: TaskItem, family: NativeFamily, policy: PolicyEndpoint,
                        started: float) -> EpisodeResult:
        """A team's own SkyRL env on one dataset row, as SkyRLGymGenerator runs it: the row's env_class (else the
        plan's env id) made with the plan's env_config and, as extras, the row's other fields with max_turns
        set to the plan's (the generator sets it the same way); init(prompt), then the policy's turns stepped
        as text, each step's observations appended, until done (the env owns the turn limit; the plan's
        max_turns also caps our loop). The reward is the sum of the steps' rewards; numbers in the last step's
        metadata are reported as components, never interpreted."""
        url = self.running_url()
        row = dict(item.reference["row"])
        prompt, env_id = row.pop("prompt"), row.pop("env_class", None) or family.native.env

        def env(path: str, **body: Any) -> Any:
            return post_to_environment(url + path, {"episode_id": episode.episode_id, **body})

        made = env("/make", env_id=env_id, env_config=family.native.kwargs, extras={**row, "max_turns": episode.max_turns},
                   prompt=prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])
        messages, reward, turns, finish, text, out = list(made["prompt"]), 0.0, 0, "", "", {"metadata": {}}
        try:
            while turns < episode.max_turns:
                message, finish = policy.chat(episode.episode_id, messages, None, timeout_s=self.policy_timeout_s)
                turns += 1
                text = action_text(message.get("content") or "", message.get("tool_calls") or [], policy.tool_format)
                out = env("/step", action=text)
                reward += float(out["reward"] or 0.0)
                if out["done"]:
                    break
                messages.append({"role": "assistant", "content": message.get("content") or "",
                                 **({"tool_calls": message["tool_calls"]} if message.get("tool_calls") else {})})
                messages += [dict(observation) for observation in out["observations"]]
            else:
                finish = "max_turns"
        finally:
            try:
                env("/close")
            except EnvironmentDown:
                pass
        success = family.solved(reward)
        truncated = finish in ("length", "max_turns") and not success
        components = {key: float(value) for key, value in (out.get("metadata") or {}).items()
                      if isinstance(value, (int, float)) and not isinstance(value, bool)}
        return EpisodeResult(
            episode_id=episode.episode_id, task_id=episode.task_id, status="completed", reward=reward,
            reward_components=components, success=success,
            outcome="truncated" if truncated else ("success" if success else "failure"), finish_reason=finish,
            turns=turns, final_text=text, tool_calls=[], seconds=round(time.monotonic() - started, 3))


def check_native_env(native: NativeAsset) -> None:
    """The asset's module imports and registers its env id, or the stage fails here with the cause in one line."""
    import skyrl_gym

    if native.module:
        import_asset_module(native.module)
    if native.env not in skyrl_gym.registry:
        raise RuntimeError(f"native asset: skyrl-gym has no env {native.env!r} registered"
                           + (f" after importing {native.module}" if native.module else
                              " (name the module that registers it: task.native.module)"))


def action_text(content: str, calls: list[dict[str, Any]], tool_format: str) -> str:
    """The assistant turn as the text a SkyRL env steps on: the content and the tool calls the policy server
    parsed out of it, written back in the policy's tool-call format."""
    return render_tool_calls([tool_call_arguments(call) for call in calls], tool_format, content)
