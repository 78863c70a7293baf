"""The OpenEnv server process: `create_app(TaskEnvironment, ...)` under uvicorn on a listening socket it inherits.

The parent binds the socket on 127.0.0.1 (never 0.0.0.0, which OpenEnv's server template uses) and passes
its file descriptor, so the child cannot listen anywhere else and the port is known before it starts.

    python -m runner_stack_openenv.server --fd N [--max-sessions 256]
"""

from __future__ import annotations

import argparse
import socket

from openenv.core.env_server.http_server import create_app

from .environment import TaskEnvironment
from .models import TaskAction, TaskObservation, TaskState


def build_app(max_sessions: int = 256):
    """The FastAPI app OpenEnv builds for the task environment (/ws, /reset, /step, /state, /health, /schema)."""
    return create_app(TaskEnvironment, TaskAction, TaskObservation, env_name="runner_tasks",
                      max_concurrent_envs=max_sessions, state_cls=TaskState)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="an inherited socket bound to 127.0.0.1")
    parser.add_argument("--max-sessions", type=int, default=256)
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    host = sock.getsockname()[0]
    if host != "127.0.0.1":
        raise SystemExit(f"refusing to serve on {host}: the socket must be bound to 127.0.0.1")
    config = uvicorn.Config(build_app(args.max_sessions), log_level="warning", access_log=False,
                            ws_ping_interval=None, ws_ping_timeout=None)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
