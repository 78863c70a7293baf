"""The OpenEnv server process: `create_app(TaskEnvironment, ...)` under uvicorn on a listening socket it inherits.

The parent binds the socket on 127.0.0.1 (never 0.0.0.0, which OpenEnv's server template uses) and passes
its file descriptor, so the child cannot listen anywhere else and the port is known before it starts.

    python -m runner_stack_openenv.server --fd N [--max-sessions 256] [--native-env module:Class --native-kwargs JSON]
"""

from __future__ import annotations

import argparse
import functools
import json
import socket

from openenv.core.env_server.http_server import create_app
from runner_kit.native import load_asset

from .environment import TaskEnvironment
from .models import TaskAction, TaskObservation, TaskState


def build_app(max_sessions: int = 256):
    """The FastAPI app OpenEnv builds for the task environment (/ws, /reset, /step, /state, /health, /schema)."""
    return create_app(TaskEnvironment, TaskAction, TaskObservation, env_name="runner_tasks",
                      max_concurrent_envs=max_sessions, state_cls=TaskState)


def build_native_app(reference: str, kwargs: dict, max_sessions: int = 256):
    """The app OpenEnv builds for a team's MCP environment `module:Class`, constructed with `kwargs` once per
    session (functools.partial, which create_app treats as the class itself)."""
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
    from openenv.core.env_server.types import Observation

    cls = native_environment_class(reference)
    sessions = max_sessions if cls.SUPPORTS_CONCURRENT_SESSIONS else 1
    return create_app(functools.partial(cls, **kwargs), CallToolAction, CallToolObservation, env_name=cls.__name__,
                      max_concurrent_envs=sessions, reset_observation_cls=Observation)


def native_environment_class(reference: str) -> type:
    """The team's environment class, or one line saying why it cannot be served."""
    from openenv.core.env_server.mcp_environment import MCPEnvironment

    cls = load_asset(reference, "Class")
    if not (isinstance(cls, type) and issubclass(cls, MCPEnvironment)):
        raise RuntimeError(f"native asset: {reference} is not an openenv MCPEnvironment subclass; the openenv arm "
                           "drives tool environments (tools declared with FastMCP's @mcp.tool, answers scored in step)")
    return cls


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="an inherited socket bound to 127.0.0.1")
    parser.add_argument("--max-sessions", type=int, default=256)
    parser.add_argument("--native-env", help="serve a team's MCPEnvironment module:Class instead of the task families")
    parser.add_argument("--native-kwargs", default="{}", help="its constructor's keyword arguments, as JSON")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    host = sock.getsockname()[0]
    if host != "127.0.0.1":
        raise SystemExit(f"refusing to serve on {host}: the socket must be bound to 127.0.0.1")
    app = (build_native_app(args.native_env, json.loads(args.native_kwargs), args.max_sessions) if args.native_env
           else build_app(args.max_sessions))
    config = uvicorn.Config(app, log_level="warning", access_log=False,
                            ws_ping_interval=None, ws_ping_timeout=None)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
