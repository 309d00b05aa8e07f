"""A small HTTP server for `/metrics` and whatever else a process serves (the dashboard).

Standard library only, on daemon threads: scraping never blocks a role, and a process that
cannot get a port logs why and runs without one rather than failing the role.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

# A route answers with (content type, body); it runs on the server's request thread.
Route = Callable[[], tuple[str, bytes]]

_log = logging.getLogger("splitmq.metrics")


def metrics_route(registry: CollectorRegistry) -> Route:
    def route() -> tuple[str, bytes]:
        return CONTENT_TYPE_LATEST, generate_latest(registry)

    return route


def _handler(routes: Mapping[str, Route]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            route = routes.get(path)
            if route is None:
                self._send(404, "text/plain; charset=utf-8", b"not found\n")
                return
            try:
                content_type, body = route()
            except Exception:
                _log.exception("serving %s failed", path)
                self._send(500, "text/plain; charset=utf-8", b"internal error\n")
                return
            self._send(200, content_type, body)

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            _log.debug("%s %s", self.address_string(), format % args)

    return Handler


@dataclass
class Endpoint:
    """A running server; `url` is its base (`http://host:port`)."""

    server: ThreadingHTTPServer
    thread: threading.Thread
    url: str

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5.0)


def serve(
    routes: Mapping[str, Route],
    *,
    host: str,
    first_port: int,
    span: int = 1,
    name: str = "splitmq-metrics",
) -> Endpoint | None:
    """Serve `routes` on the first free port in [first_port, first_port + span) (first_port 0:
    any free port); None, logged, when none is free."""
    ports = [0] if first_port == 0 else range(first_port, min(65536, first_port + span))
    shown = "127.0.0.1" if host in ("", "0.0.0.0") else host
    shown = f"[{shown}]" if ":" in shown else shown
    handler = _handler(dict(routes))
    for port in ports:
        try:
            server = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                continue
            _log.warning("cannot serve metrics on %s:%d: %s", host, port, exc)
            return None
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
        thread.start()
        return Endpoint(server, thread, f"http://{shown}:{server.server_address[1]}")
    _log.warning(
        "cannot serve metrics: ports %d-%d on %s are all taken",
        first_port,
        first_port + span - 1,
        host,
    )
    return None
