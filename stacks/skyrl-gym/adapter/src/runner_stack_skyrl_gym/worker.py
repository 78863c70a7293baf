"""The env worker: SkyRL Gym envs by episode id behind HTTP, so the environment is a process that can crash.

    python -m runner_stack_skyrl_gym.worker --fd N    (N: a listening socket on 127.0.0.1 from the parent)

POST /make {episode_id, extras, prompt[, env_id, env_config]} -> init's (prompt, info); POST /step
{episode_id, action} -> step's output; POST /close {episode_id}; GET /health. `--import MODULE` imports a
team's module first (a native asset registers its env id on import, as SkyRL users do).
"""

from __future__ import annotations

import argparse
import importlib
import socket
import threading

import skyrl_gym

from runner_kit.http import Call, HttpError, JsonServer, Reply

from .environment import ENV_ID


class Envs:
    def __init__(self) -> None:
        self.live: dict[str, object] = {}
        self.lock = threading.Lock()

    def make(self, call: Call) -> Reply:
        env = skyrl_gym.make(call.body.get("env_id", ENV_ID), env_config=call.body.get("env_config") or {},
                             extras=call.body["extras"])
        prompt, info = env.init(call.body["prompt"])
        with self.lock:
            self.live[call.body["episode_id"]] = env
        return Reply(body={"prompt": prompt, "info": info})

    def step(self, call: Call) -> Reply:
        with self.lock:
            env = self.live.get(call.body["episode_id"])
        if env is None:  # a restarted worker has lost the episode
            raise HttpError(404, f"unknown episode {call.body['episode_id']!r}")
        return Reply(body={**_plain(env.step(call.body["action"])), "turns": env.turns})

    def close(self, call: Call) -> Reply:
        with self.lock:
            env = self.live.pop(call.body["episode_id"], None)
        if env is not None:
            env.close()
        return Reply(body={})


def _plain(output) -> dict:
    """A step's output as JSON: BaseTextEnvStepOutput is a TypedDict; a team's env may add its own values."""
    return {key: value for key, value in dict(output).items() if key in ("observations", "reward", "done", "metadata")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="an inherited socket bound to 127.0.0.1")
    parser.add_argument("--import", dest="modules", action="append", default=[], help="a module to import first")
    args = parser.parse_args(argv)
    for module in args.modules:
        importlib.import_module(module)
    envs = Envs()
    server = JsonServer([("GET", "/health", lambda call: Reply(body={"status": "ok"})),
                         ("POST", "/make", envs.make), ("POST", "/step", envs.step), ("POST", "/close", envs.close)],
                        sock=socket.socket(fileno=args.fd))
    server.start()
    threading.Event().wait()


if __name__ == "__main__":
    main()
