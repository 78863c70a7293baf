"""A fork server for a program a rollout runs once per episode (a harness, a chat program), so an episode
does not pay a Python start and the import of openai and httpx (~1-1.5 s of CPU) before its first model call.

A backend starts it once (`start_prefork(directory, program, warm)`, which runs `python -m runner_kit.prefork
NAME DIR PROGRAM WARM...`, NAME an abstract socket; the program is a script, or `-mMODULE[,MODULE...]` for
modules run as `python -m MODULE`): it compiles the script (imports the modules), imports the `warm` modules and
calls the `module:function` entries among them (what the program does on first use and then caches: the task-
family lookup, say), runs the program's own top level (and, when openai is imported, makes a few chat-completion
calls through the SDK against a throwaway server on 127.0.0.1, so that the SDK's lazily built models and caches
are built once, not in every child), loads SSL contexts from the CA bundle files a program may name (certifi's,
SSL_CERT_FILE) for the children to take, and forks one child per request. A backend that starts the program
itself asks the fork server directly (`ForkedProgram`); where an upstream starts it from an interpreter path, it
runs it through the launcher this module writes (`<dir>/bin/python`, a `python -SE` script) instead of the
interpreter; the launcher of modules runs any other command line (`python -c ...`) on the real interpreter, so
it can stand in for `sys.executable` in a process that starts the modules that way. Either hands the argv,
working directory, environment and stdio descriptors to the fork server and gets the child's status (128 + N
when signal N killed it, as a shell reports). The child runs the unchanged program as `__main__` with exactly
those. When the connection closes (the launcher dies, or `ForkedProgram.kill()`) the fork server SIGKILLs the
child's group; the child dies with the fork server, which dies with the backend. When the fork server cannot be
reached, the program starts plainly on the real interpreter, as without the fork server. RUNNER_PREFORK=0 turns
it off.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import importlib
import json
import logging
import marshal
import os
import runpy
import secrets
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path
from typing import NamedTuple

from runner_kit.processes import die_with_parent, freeze_heap, kill_trees, spawn, wait_until

log = logging.getLogger("runner_kit.prefork")

# What a program behind the OpenAI SDK imports lazily (openai's resources on first use, the HTTP transports
# when a client is built); a backend adds its program's own.
OPENAI_MODULES = ["asyncio", "certifi", "anyio", "anyio._backends._asyncio", "anyio.streams.tls",
                  "anyio.streams.stapled", "httpx", "httpcore", "h11", "openai", "openai.resources",
                  "openai.lib.streaming.chat"]
FORK_SERVER_MODULE = "runner_kit.prefork"
HEADER = struct.Struct("!Q")

# The launcher imports only built-in modules (_socket, marshal): a Python start is ~7 ms of CPU, and the
# socket, json and struct wrappers would add ~9 more to every episode. Its interpreter is the fork server's,
# so both read the same marshal format; only our own uid can reach the server (SO_PEERCRED).
LAUNCHER = r'''#!{python} -SE
# Written by runner_kit.prefork: runs {program} in a child of the fork server at {socket!r}.
import _socket, marshal, os, sys
SOCKET, PYTHON, MODULES = {socket!r}, {python!r}, {modules!r}
def plain():
    os.execv(PYTHON, [PYTHON, *sys.argv[1:]])
if MODULES is not None and not (len(sys.argv) > 2 and sys.argv[1] == "-m" and sys.argv[2] in MODULES):
    plain()
try:
    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    conn.connect(SOCKET)
    payload = marshal.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}})
    conn.sendmsg([len(payload).to_bytes(8, "big")],
                 [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, b"".join(fd.to_bytes(4, sys.byteorder) for fd in (0, 1, 2)))])
    conn.sendall(payload)
except OSError:
    plain()
status = b""
while len(status) < 4:
    try:
        chunk = conn.recv(4 - len(status))
    except InterruptedError:
        continue
    except OSError:
        chunk = b""
    if not chunk:
        break
    status += chunk
if len(status) < 4:
    sys.stderr.write("prefork: the fork server went away before the program finished\n")
    sys.exit(1)
sys.exit(int.from_bytes(status, "big", signed=True))
'''


def _modules(program: str) -> tuple[str, ...] | None:
    """The modules a fork server's program argument names (`-mMODULE[,MODULE...]`), None for a script."""
    return tuple(program[2:].split(",")) if program.startswith("-m") else None


def write_launcher(directory: Path, socket_path: str, program: str, python: str = sys.executable) -> Path:
    """`<directory>/bin/python`: the runtime derives VIRTUAL_ENV and PATH from the interpreter's location."""
    launcher = directory / "bin" / "python"
    launcher.parent.mkdir(parents=True, exist_ok=True)
    launcher.write_text(LAUNCHER.format(python=python, socket=socket_path, program=program, modules=_modules(program)))
    launcher.chmod(0o755)
    return launcher


class Prefork(NamedTuple):
    """A started fork server: its process, the launcher that runs the program through it, its socket address."""

    process: subprocess.Popen
    launcher: Path
    address: str


def start_prefork(directory: Path, program: Path | str | list[str], warm: list[str],
                  env: dict[str, str] | None = None) -> Prefork | None:
    """Starts the program's fork server (a child of this process that dies with it, from whichever thread) and
    writes its launcher under `directory`; None when turned off (RUNNER_PREFORK=0). The program is a script (a Path,
    run as `python SCRIPT ...`) or modules' names (a str or a list, run as `python -m MODULE ...`). `env` is the
    fork server's environment (this process's by default): give it what the program's would be, as what a module
    reads from the environment when imported is read there, once.

    The server listens on an abstract Unix socket (no file, so no 108-byte path limit under a deep run
    directory) and serves only connections from its own uid (SO_PEERCRED), as a 0600 socket file would."""
    if os.environ.get("RUNNER_PREFORK", "1") == "0":
        return None
    directory.mkdir(parents=True, exist_ok=True)
    name = f"runner-prefork-{os.getpid()}-{secrets.token_hex(8)}"
    if isinstance(program, Path):
        argument = str(program)
    else:
        argument = "-m" + ",".join([program] if isinstance(program, str) else program)
    launcher = write_launcher(directory, "\0" + name, argument)
    process = spawn([sys.executable, "-m", FORK_SERVER_MODULE, name, str(directory), argument, *warm],
                    stdin=subprocess.DEVNULL, env=env)
    return Prefork(process, launcher, "\0" + name)


def wait_listening(prefork: Prefork, timeout_s: float = 10.0) -> bool:
    """Waits until the fork server's socket is bound (from then on a launcher's request queues while it imports,
    ~0.1 s after its start; before, the launcher starts the program plainly); False if it exited or took longer
    than `timeout_s`."""
    name = " @" + prefork.address[1:]

    def bound() -> bool:
        with open("/proc/net/unix") as table:
            return any(line.rstrip().endswith(name) for line in table)

    try:
        wait_until(bound, what="the fork server", timeout_s=timeout_s, alive=lambda: prefork.process.poll() is None)
    except (RuntimeError, OSError):
        return False
    return True


def stop_prefork(process: subprocess.Popen) -> None:
    """Ends a fork server and the programs it forked, and waits: killed alone, its children would outlive it
    until the kernel's death signal reached them."""
    kill_trees([process.pid])
    process.wait()


class ForkedProgram:
    """The program run once, from this process, as a child of the fork server when it answers, else as a plain
    start of this interpreter: either way in a session of its own, with `argv` (the script first), `env` and
    pipes to its stdio. A launcher process would cost a Python start (~11 ms of CPU) per run.

    Popen's `communicate` (call it again after a timeout: nothing read is lost), `poll` and `returncode`; a
    forked child killed by signal N reports 128 + N, as the launcher does. `kill()`, from any thread, SIGKILLs
    the program's session (forked: the fork server does it when the connection closes); a forked program
    whose status never came reports -SIGKILL."""

    def __init__(self, prefork: Prefork | None, argv: list[str], *, env: dict[str, str]):
        self.returncode: int | None = None
        self._plain: subprocess.Popen | None = None
        if prefork is not None:
            try:
                self._fork(prefork.address, argv, env)
                return
            except OSError:
                log.warning("prefork: the fork server at %r did not answer; a plain start", prefork.address)
        self._plain = subprocess.Popen([sys.executable, *argv], env=env, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

    @property
    def forked(self) -> bool:
        return self._plain is None

    def _fork(self, address: str, argv: list[str], env: dict[str, str]) -> None:
        pipes = [os.pipe() for _ in range(3)]
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1]]
        self._stdin, self._stdout, self._stderr = pipes[0][1], pipes[1][0], pipes[2][0]
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(address)
            payload = marshal.dumps({"argv": list(argv), "cwd": os.getcwd(), "env": dict(env)})
            self._conn.sendmsg([HEADER.pack(len(payload))],
                               [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", theirs))])
            self._conn.sendall(payload)
        except OSError:
            self._conn.close()
            for fd in (self._stdin, self._stdout, self._stderr):
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        self._input: memoryview | None = None
        self._read = {self._stdout: bytearray(), self._stderr: bytearray()}
        self._status = bytearray()
        self._open = {self._stdin, self._stdout, self._stderr, self._conn.fileno()}

    def communicate(self, input: str = "", timeout: float | None = None) -> tuple[str, str]:
        """Writes `input` and closes stdin, reads stdout and stderr to their ends and waits for the exit;
        subprocess.TimeoutExpired after `timeout` seconds (the program still runs)."""
        if self._plain is not None:
            out, err = self._plain.communicate(input.encode(), timeout=timeout)
            self.returncode = self._plain.returncode
            return out.decode(errors="replace"), err.decode(errors="replace")
        if self._input is None:
            self._input = memoryview(input.encode())
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for fd in self._open:
                selector.register(fd, selectors.EVENT_WRITE if fd == self._stdin else selectors.EVENT_READ)
            while self._open:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired("forked program", timeout)
                for key, _ in selector.select(left):
                    if self._step(key.fd):
                        selector.unregister(key.fd)
                        self._open.discard(key.fd)
                        if key.fd != self._conn.fileno():
                            os.close(key.fd)
        status = bytes(self._status)
        self._conn.close()
        self.returncode = int.from_bytes(status, "big", signed=True) if len(status) == 4 else -signal.SIGKILL
        return self._read[self._stdout].decode(errors="replace"), self._read[self._stderr].decode(errors="replace")

    def _step(self, fd: int) -> bool:
        """Moves the data one ready descriptor has; whether it is done."""
        if fd == self._stdin:
            try:
                # at most PIPE_BUF: a pipe that polls writable takes that much without blocking
                self._input = self._input[os.write(fd, self._input[:select.PIPE_BUF]):]
            except BrokenPipeError:  # the program exited without reading it all
                return True
            return not self._input
        if fd == self._conn.fileno():
            try:
                chunk = self._conn.recv(4 - len(self._status))
            except OSError:  # shut down by kill()
                chunk = b""
            self._status += chunk
            return not chunk or len(self._status) == 4
        chunk = os.read(fd, 1 << 16)
        self._read[fd] += chunk
        return not chunk

    def poll(self) -> int | None:
        return self._plain.poll() if self._plain is not None else self.returncode

    def kill(self) -> None:
        if self._plain is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._plain.pid, signal.SIGKILL)
        else:
            with contextlib.suppress(OSError):
                self._conn.shutdown(socket.SHUT_RDWR)


def warm_up(entries: list[str]) -> None:
    """Imports each `module` entry, and calls each `module:function` entry's function, in this process: the
    first-use work a long-lived process (or every program forked from it) would otherwise do while serving.
    An entry that fails is logged and skipped: what is not warmed is done on first use, as without it."""
    for entry in entries:
        module, _, function = entry.partition(":")
        try:
            imported = importlib.import_module(module)
            if function:
                getattr(imported, function)()
        except Exception:  # noqa: BLE001
            log.warning("could not warm %s", entry, exc_info=True)


def _warm(program: str, entries: list[str]) -> types.CodeType | None:
    """Imports what the program would; the script's code (None for modules, which runpy finds in the child)."""
    modules = _modules(program)
    if modules is not None:
        warm_up([*entries, *modules])  # their imports, class and function definitions, not their `__main__` blocks
        code = None
    else:
        code = compile(Path(program).read_bytes(), program, "exec", dont_inherit=True)
        warm_up(entries)
        # The program's own top level (its imports, class and function definitions), not its entry point.
        top_level = types.ModuleType("__prefork_warm__")
        top_level.__file__ = program
        sys.modules[top_level.__name__] = top_level
        try:
            exec(code, top_level.__dict__)
        except Exception:  # noqa: BLE001
            log.warning("prefork: warming %s failed", program, exc_info=True)
        finally:
            sys.modules.pop(top_level.__name__, None)
    try:  # what openai's platform headers ask for (`uname -p` in a subprocess otherwise); the CA bundle path
        import platform

        import certifi

        platform.platform(), platform.processor(), platform.machine(), certifi.where()
    except Exception:  # noqa: BLE001
        pass
    if "openai" in sys.modules:
        try:
            _warm_openai_sdk()
        except Exception:  # noqa: BLE001 - the children build what the warm calls did not
            log.warning("prefork: the OpenAI SDK's warm-up calls failed", exc_info=True)
    return code


# A completion with one tool call, whole and as server-sent events (the SDK parses both on first use).
_WARM_MESSAGE = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call-0", "type": "function", "function": {"name": "tool", "arguments": "{}"}}]}
_WARM_USAGE = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
_WARM_COMPLETION = {"id": "warm", "object": "chat.completion", "created": 0, "model": "warm", "usage": _WARM_USAGE,
                    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": _WARM_MESSAGE}]}
_WARM_CHUNKS = [
    {"id": "warm", "object": "chat.completion.chunk", "created": 0, "model": "warm", "choices": [
        {"index": 0, "finish_reason": None,
         "delta": {**_WARM_MESSAGE, "tool_calls": [{"index": 0, **_WARM_MESSAGE["tool_calls"][0]}]}}]},
    {"id": "warm", "object": "chat.completion.chunk", "created": 0, "model": "warm", "usage": _WARM_USAGE,
     "choices": [{"index": 0, "finish_reason": "tool_calls", "delta": {}}]},
]
_WARM_REQUEST = {
    "model": "warm",
    "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, _WARM_MESSAGE,
                 {"role": "tool", "tool_call_id": "call-0", "content": "r"}],
    "tools": [{"type": "function", "function": {"name": "tool", "description": "d", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}],
}


def _warm_openai_sdk() -> None:
    """Chat-completion calls the way programs make them (sync and async, whole and streamed, with tools),
    through the OpenAI SDK against a throwaway server on 127.0.0.1. The SDK builds its response models'
    validators and its request-transform caches on first use: done here once, a forked program finds them
    built (measured: a team harness's CPU per episode went from 68 to 40 ms). The server's thread and the
    event loop are gone before the first fork."""
    import asyncio
    import http.server
    import threading

    import openai

    class WarmServer(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            request = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
            if request.get("stream"):
                body = b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in _WARM_CHUNKS)
                body, kind = body + b"data: [DONE]\n\n", "text/event-stream"
            else:
                body, kind = json.dumps(_WARM_COMPLETION).encode(), "application/json"
            self.send_response(200)
            for name, value in (("content-type", kind), ("content-length", str(len(body))), ("connection", "close")):
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    async def async_calls(base_url: str) -> None:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="warm", max_retries=0, timeout=10) as client:
            await client.chat.completions.create(**_WARM_REQUEST)
            async for _ in await client.chat.completions.create(**_WARM_REQUEST, stream=True,
                                                                stream_options={"include_usage": True}):
                pass
            # the SDK's stream accumulator (it parses tool arguments only for strict tools: none given)
            async with client.chat.completions.stream(model="warm", messages=_WARM_REQUEST["messages"]) as stream:
                async for _ in stream:
                    pass

    server = http.server.HTTPServer(("127.0.0.1", 0), WarmServer)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), name="prefork-warm", daemon=True)
    thread.start()
    no_proxy = {name: os.environ.get(name) for name in ("NO_PROXY", "no_proxy")}
    os.environ.update(dict.fromkeys(no_proxy, "*"))  # the calls go to 127.0.0.1, whatever proxy is named
    try:
        base_url = f"http://127.0.0.1:{server.server_port}/v1"
        with openai.OpenAI(base_url=base_url, api_key="warm", max_retries=0, timeout=10) as client:
            client.chat.completions.create(**_WARM_REQUEST)
            for _ in client.chat.completions.create(**_WARM_REQUEST, stream=True):
                pass
        asyncio.run(async_calls(base_url))
    finally:
        for name, value in no_proxy.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.shutdown()
        server.server_close()
        thread.join()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(HEADER.size, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if len(data) != HEADER.size or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError("malformed prefork request")
    try:
        return _read_request(conn, HEADER.unpack(data)[0]), list(fds)
    except (OSError, ValueError):
        for fd in fds:
            os.close(fd)
        raise


def _read_request(conn: socket.socket, size: int) -> dict:
    body = bytearray()
    while len(body) < size:
        chunk = conn.recv(min(1 << 20, size - len(body)))
        if not chunk:
            raise ValueError("truncated prefork request")
        body += chunk
    try:
        request = marshal.loads(body)
    except (EOFError, TypeError) as error:
        raise ValueError(f"malformed prefork request: {error}") from None
    if not isinstance(request, dict):
        raise ValueError("malformed prefork request")
    return request


# Contexts per CA bundle file made before forking: a program that makes more clients from one file per run
# loads the rest itself.
CA_CONTEXTS_PER_FILE = 2


def _ca_file_key(path: str) -> tuple[str, int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return os.path.realpath(path), stat.st_mtime_ns, stat.st_size


def _load_ca_files() -> dict[tuple[str, int, int], list]:
    """SSL contexts from the CA bundle files programs name explicitly (certifi's, as verifiers' chat program
    passes `verify=certifi.where()`; SSL_CERT_FILE), made once here: loading a bundle parses every
    certificate in it, ~20 ms of CPU per context, which SSL_CERT_DIR cannot spare a program that names a file."""
    import ssl

    files = [os.environ.get("SSL_CERT_FILE")]
    if "certifi" in sys.modules:
        files.append(sys.modules["certifi"].where())
    loaded: dict[tuple[str, int, int], list] = {}
    for path in filter(None, files):
        key = _ca_file_key(path)
        if key is None or key in loaded:
            continue
        try:
            loaded[key] = [ssl.create_default_context(cafile=path) for _ in range(CA_CONTEXTS_PER_FILE)]
        except (OSError, ssl.SSLError):
            log.warning("prefork: could not load the CA file %s", path, exc_info=True)
    return loaded


def _hand_out_loaded_ca_files(loaded: dict[tuple[str, int, int], list]) -> None:
    """In the child: `ssl.create_default_context(cafile=F)` returns one of the contexts the server loaded from F,
    unused, while any are left and F is unchanged (path, mtime, size); anything else is made as the standard
    library makes it."""
    import ssl

    if not loaded:
        return
    make = ssl.create_default_context

    def create_default_context(purpose=ssl.Purpose.SERVER_AUTH, *, cafile=None, capath=None, cadata=None):
        if cafile is not None and capath is None and cadata is None and purpose == ssl.Purpose.SERVER_AUTH:
            ready = loaded.get(_ca_file_key(os.fspath(cafile)))
            if ready:
                return ready.pop()
        return make(purpose, cafile=cafile, capath=capath, cadata=cadata)

    create_default_context.__doc__ = make.__doc__
    ssl.create_default_context = create_default_context


def _child(request: dict, fds: list[int], code: types.CodeType | None, program: str, launcher_bin: str,
           ca_contexts: dict) -> None:
    """In the forked child: become the program (never returns)."""
    status = 1
    try:
        os.setsid()
        die_with_parent()
        for number, fd in enumerate(fds):
            os.dup2(fd, number)
            os.close(fd)
        argv, env = request["argv"], dict(request["env"])
        # The runtime pointed VIRTUAL_ENV/PATH at the launcher's directory: point them at the real environment.
        real_bin = str(Path(sys.executable).parent)
        if env.get("VIRTUAL_ENV") == str(Path(launcher_bin).parent):
            env["VIRTUAL_ENV"] = str(Path(real_bin).parent)
        env["PATH"] = os.pathsep.join(real_bin if part == launcher_bin else part
                                      for part in env.get("PATH", "").split(os.pathsep))
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        _hand_out_loaded_ca_files(ca_contexts)
        try:
            modules = _modules(program)
            module = argv[1] if modules is not None and len(argv) > 1 and argv[0] == "-m" else None
            if modules is not None and module not in modules:
                raise SystemExit(f"prefork: this fork server runs -m {' or '.join(modules)}, not {argv[:2]}")
            if modules is None and (not argv or os.path.realpath(argv[0]) != os.path.realpath(program)):
                raise SystemExit(f"prefork: this fork server runs {program}, not {argv[:1]}")
            if module is not None:  # as `python -m`: the working directory first on the path, argv[0] the file
                sys.argv = [module, *argv[2:]]
                sys.path[0] = os.getcwd()
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                main = types.ModuleType("__main__")
                main.__file__ = argv[0]
                sys.modules["__main__"] = main
                exec(code, main.__dict__)
            status = 0
        except SystemExit as stop:
            if stop.code is None:
                status = 0
            elif isinstance(stop.code, int):
                status = stop.code
            else:
                print(stop.code, file=sys.stderr)
                status = 1
        except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught exception
            traceback.print_exc()
            status = 1
        try:
            atexit._run_exitfuncs()
            logging.shutdown()
        except BaseException:  # noqa: BLE001
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001
                pass
        os._exit(status & 0xFF)


def serve(name: str, launcher_dir: str, program: str, warm: list[str]) -> None:
    """Serves on the abstract socket `name` the launcher in `launcher_dir` connects to."""
    die_with_parent()
    launcher_bin = str(Path(launcher_dir) / "bin")
    socket_path = "\0" + name
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(256)  # launchers queue here while the imports below run
    code = _warm(program, warm)
    ca_contexts = _load_ca_files()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "wake")
    children: dict[int, socket.socket | None] = {}  # child pid -> its launcher's connection (None once gone)
    log.info("prefork: serving %s on @%s", program, name)

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = children.pop(pid, None)
            if conn is not None:
                code_ = os.waitstatus_to_exitcode(status)
                try:
                    conn.sendall(struct.pack("!i", code_ if code_ >= 0 else 128 - code_))
                except OSError:
                    pass
                selector.unregister(conn)
                conn.close()

    while True:
        for key, _ in selector.select():
            if key.data == "wake":
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
                reap()
            elif key.data == "accept":
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                struct.calcsize("3i")))
                if uid != os.getuid():  # an abstract socket has no file mode: only our own uid is served
                    log.warning("prefork: refused a connection from uid %d", uid)
                    conn.close()
                    continue
                try:
                    conn.settimeout(10)
                    request, fds = _receive(conn)
                except (OSError, ValueError) as error:
                    log.warning("prefork: bad request: %s", error)
                    conn.close()
                    continue
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                freeze_heap()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    selector.close()
                    for fd in (wake_r, wake_w, listener.fileno(), conn.fileno(),
                               *(c.fileno() for c in children.values() if c is not None)):
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                    _child(request, fds, code, program, launcher_bin, ca_contexts)
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            else:  # a launcher's connection: readable only when it went away
                pid, conn = key.data, key.fileobj
                try:
                    gone = conn.recv(1) == b""
                except OSError:
                    gone = True
                if gone:
                    selector.unregister(conn)
                    conn.close()
                    if children.get(pid) is conn:
                        children[pid] = None
                        for kill in (os.killpg, os.kill):  # its group; itself, should it not lead one yet
                            try:
                                kill(pid, signal.SIGKILL)
                            except OSError:
                                pass
                reap()


def main(argv: list[str]) -> int:
    # Our own logger only: the children inherit the root logger as a fresh interpreter has it (unconfigured).
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(os.environ.get("RUNNER_PREFORK_LOG", "INFO"))
    log.propagate = False
    try:
        serve(argv[0], argv[1], argv[2], argv[3:])
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
