"""A small JSON-over-HTTP server on 127.0.0.1 (stdlib only): it runs inside every stack environment.

Routes map (method, path regex) to a handler(Call) returning a Reply. A handler may return a Reply whose
`stream` is an iterator of already-encoded server-sent-event chunks.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Call:
    method: str
    path: str
    match: re.Match
    headers: dict[str, str]  # lower-case names
    body: Any


@dataclass
class Reply:
    status: int = 200
    body: Any = None
    stream: Iterator[bytes] | None = None
    headers: dict[str, str] = field(default_factory=dict)


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


Route = tuple[str, str, Callable[[Call], Reply]]


class JsonServer:
    """Serves `routes` on 127.0.0.1 (port 0 = a free one, or on `sock`, a listening socket bound there, e.g. one
    inherited from the parent) in a daemon thread; `url` is the base URL."""

    def __init__(self, routes: list[Route], port: int = 0, sock: socket.socket | None = None):
        compiled = [(method, re.compile(pattern + r"\Z"), handler) for method, pattern, handler in routes]

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # A reply's headers and body go out in one write (buffered, flushed after the handler; a body over
            # 8 KiB in a second): every socket call lets go of the GIL, and in a busy process (the policy server
            # beside its sampler) getting it back costs up to the 5 ms switch interval. Nagle off for the
            # streamed chunks: with it, a keep-alive client waits ~40 ms for the delayed ACK.
            wbufsize = -1
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:  # quiet: calls are logged as records where it matters
                pass

            def _dispatch(self, method: str) -> None:
                path = self.path.split("?", 1)[0]
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    raw = self.rfile.read(length) if length else b""
                    body = json.loads(raw) if raw else None
                except (ValueError, json.JSONDecodeError) as error:
                    return self._send(Reply(400, {"error": {"message": f"request body is not JSON: {error}"}}))
                for route_method, pattern, handler in compiled:
                    match = pattern.match(path)
                    if match and route_method == method:
                        headers = {k.lower(): v for k, v in self.headers.items()}
                        try:
                            reply = handler(Call(method, path, match, headers, body))
                        except HttpError as error:
                            reply = Reply(error.status, {"error": {"message": str(error)}})
                        except Exception as error:  # a bug in a handler must answer, not hang the client
                            reply = Reply(500, {"error": {"message": f"{type(error).__name__}: {error}"}})
                        return self._send(reply)
                self._send(Reply(404, {"error": {"message": f"no route for {method} {path}"}}))

            def _send(self, reply: Reply) -> None:
                if reply.stream is not None:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Cache-Control", "no-cache")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    for chunk in reply.stream:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                    self.close_connection = True
                    return
                payload = json.dumps(reply.body, ensure_ascii=False).encode()
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                for key, value in reply.headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:
                self._dispatch("GET")

            def do_POST(self) -> None:
                self._dispatch("POST")

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = False
            request_queue_size = 256  # listen backlog: socketserver's 5 resets a burst of concurrent episodes

            def handle_error(self, request: Any, client_address: tuple) -> None:
                """A client that hung up before its reply (an environment killed mid-call) is one line on
                stderr, not socketserver's traceback; anything else keeps the traceback."""
                error = sys.exc_info()[1]
                if isinstance(error, (BrokenPipeError, ConnectionResetError)):
                    print(f"json-server: the client at {client_address[0]}:{client_address[1]} closed the "
                          f"connection before the reply ({type(error).__name__})", file=sys.stderr, flush=True)
                    return
                super().handle_error(request, client_address)

        if sock is None:
            self._server = Server(("127.0.0.1", port), Handler)
        else:
            if sock.getsockname()[0] != "127.0.0.1":
                raise ValueError(f"refusing to serve on {sock.getsockname()[0]}: the socket must be bound to 127.0.0.1")
            self._server = Server(sock.getsockname(), Handler, bind_and_activate=False)
            self._server.socket.close()
            self._server.socket = sock
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> JsonServer:
        self._thread = threading.Thread(target=self._server.serve_forever, name="json-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> JsonServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def post_json(url: str, body: Any, *, headers: dict[str, str] | None = None, timeout: float = 600.0) -> Any:
    """POST JSON and decode the JSON reply; HTTP errors raise HttpError with the server's message."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise HttpError(error.code, f"{url}: {detail}") from None


def get_json(url: str, timeout: float = 30.0) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())
