"""The environment server: verifiers' own EnvServer (ZMQ, the process prime-rl's trainer talks to) hosting
a SingleAgentEnv over our taskset, with the built-in `null` harness in the `subprocess` runtime.

Run as `python -m runner_stack_verifiers.envserver READY_FILE [MAX_CONCURRENT] [--native JSON]` (the backend
runs it as a fork of a fork server that imported it): it binds tcp://127.0.0.1 on a free port and writes the
bound address and its pid to READY_FILE; it answers verifiers' health
request once the env serves, and runs until SIGTERM (or its parent's death). Serving starts the taskset's MCP
tool server (runner_stack_verifiers.toolset, shared by all rollouts) and the chat program's fork server
(runner_kit.prefork); each rollout runs the null harness's chat program as its own subprocess.

With `--native {"taskset": {"id": MODULE, ...its config}, "env_id": ID, "max_turns": N}` it serves a team's
own taskset package instead, loaded by verifiers' own `load_environment` (the package's exported Taskset, and
its Env when it exports one), with the same harness and runtime; the agent's turn cap is the plan's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

from runner_kit.prefork import OPENAI_MODULES, start_prefork, warm_up
from runner_kit.processes import die_with_parent, freeze_heap

# What the null harness's chat program imports beyond the OpenAI SDK's: warmed in its fork server.
CHAT_PROGRAM_MODULES = [*OPENAI_MODULES, "argparse", "tenacity", "httpx2", "httpcore2", "truststore", "mcp",
                        "mcp.client.streamable_http"]

# What verifiers' TrainClient imports when it first loads the policy's tokenizer for its renderer pool, which
# it does in front of the first batch's first model call (~0.8 s of CPU, holding the GIL of the process every
# rollout goes through): imported before the env server serves, while the trainer starts.
RENDERER_MODULES = ["transformers", "transformers.models.auto.tokenization_auto", "runner_stack_verifiers.renderer"]

TASKSET_ID = "runner_stack_verifiers"
# The launcher of the backend's fork server for this env's MCP tool server (runner_kit.prefork), set as
# `sys.executable`: verifiers starts the tool server as `sys.executable -m MODULE`, which the launcher forks
# pre-imported; any other command line it runs on the real interpreter.
TOOL_PYTHON_VARIABLE = "RUNNER_VF_TOOL_PYTHON"


def env_config(max_concurrent_agents: int = 1):
    import verifiers.v1 as vf
    from verifiers.v1.interception import InterceptionServerConfig

    return vf.SingleAgentEnvConfig(
        taskset={"id": TASKSET_ID},
        agent=vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig()),
        # One local interception server (no tunnel); the default elastic pool asks for prime tunnels when it grows.
        interception=InterceptionServerConfig(),
        max_concurrent_agents=max_concurrent_agents,
    )


def native_env_config(native: dict):
    """The env config of a team's taskset: its id and config, its Env (or SingleAgentEnv), our agent seat (the
    null harness in the subprocess runtime, capped at the plan's turns) and one local interception server."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.interception import InterceptionServerConfig
    from verifiers.v1.utils.loaders import resolve_env_config

    agent = vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig(), max_turns=native["max_turns"])
    config = resolve_env_config({"id": native.get("env_id") or "", "taskset": native["taskset"],
                                 "interception": InterceptionServerConfig().model_dump()})
    roles = list(agent_config_fields(config))
    if roles != ["agent"]:
        raise RuntimeError(f"native asset: the env of taskset {native['taskset']['id']!r} ({type(config).__name__}) "
                           f"has the roles {roles}; runner runs one policy seat, `agent` (SingleAgentEnv)")
    return config.model_copy(update={"agent": agent})


def use_environment_python_for_chat_program(interpreter: str = sys.executable) -> Path:
    """Points the subprocess runtime's PEP 723 script cache at this environment's interpreter (or the
    prefork launcher, which forks it pre-imported) for the null harness's chat program, so no
    `uv sync --script` (network) runs: the program's dependencies (openai, mcp==2.0.0, httpx, httpx2,
    tenacity, certifi) are pinned in the stack lock already. Writes the script where the runtime would and
    returns its path."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_bytes() != data:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    SubprocessRuntime._interpreters[str(path)] = interpreter
    return path


def main(argv: list[str]) -> int:
    from verifiers.v1.serve.pool import _arm_teardown
    from verifiers.v1.serve.server import EnvServer

    native = None
    if "--native" in argv:
        at = argv.index("--native")
        native, argv = json.loads(argv[at + 1]), argv[:at] + argv[at + 2:]
    ready = Path(argv[0])
    max_concurrent = int(argv[1]) if len(argv) > 1 else None
    die_with_parent()
    _arm_teardown()  # SIGTERM -> KeyboardInterrupt, so serving() tears down the rollouts' subprocesses
    logging.basicConfig(level=os.environ.get("RUNNER_VF_LOG", "INFO"), stream=sys.stderr, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    warm_up(RENDERER_MODULES)
    script = use_environment_python_for_chat_program()
    prefork = start_prefork(ready.parent / f"prefork-{os.getpid()}", script, CHAT_PROGRAM_MODULES)
    if prefork is not None:
        use_environment_python_for_chat_program(str(prefork.launcher))
    if tool_python := os.environ.get(TOOL_PYTHON_VARIABLE):
        sys.executable = tool_python  # last: what started above runs on the real interpreter
    server = EnvServer(env_config() if native is None else native_env_config(native), address="tcp://127.0.0.1:0", max_concurrent=max_concurrent)
    freeze_heap()

    async def serve() -> None:
        task = asyncio.create_task(server.run())
        await asyncio.sleep(0)
        tmp = ready.with_suffix(".tmp")
        tmp.write_text(f"{server.address}\n{os.getpid()}\n")
        tmp.replace(ready)
        await task

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
