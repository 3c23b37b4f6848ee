"""The aggregator's read-only HTTP face (`aggregator serve --http HOST:PORT`).

    GET /            the dashboard page (static files from aggregator/dashboard/, no build step, no CDN)
    GET /api/state   what the page draws: aggregator.metrics.DashboardState as JSON (the page polls it)
    GET /api/rollout which device runs which model version (aggregator/rollout.py RolloutWatcher)
    GET /metrics     Prometheus text format
    GET /health      {"status": "ok"}

Nothing here changes the federation. On 127.0.0.1 there is no login; bound to any other address
the command requires a token (`--http-token`), checked in constant time on /api/state and
/metrics, sent as `Authorization: Bearer TOKEN` (Prometheus' `authorization` setting) or as
`?token=TOKEN` (a browser opening the page; the page passes it on). The static files carry no fleet
data and are served without it. The token travels in clear over plain HTTP: off a trusted network,
put the port behind a TLS reverse proxy (docs/operations.md).

stdlib http.server in daemon threads, bounded: at most MAX_CONNECTIONS at once (beyond that a 503),
each with a socket timeout, so a slow or flooding client costs threads of this server only and the
federation's main thread never waits on it.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from aggregator.metrics import Observer
from nefl.support.listen import is_loopback

MAX_CONNECTIONS = 32
TIMEOUT_S = 10.0
STATIC = {"/": ("index.html", "text/html; charset=utf-8"), "/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/style.css": ("style.css", "text/css; charset=utf-8")}
SECURITY_HEADERS = {"Content-Security-Policy": "default-src 'self'; style-src 'self'; img-src 'self' data:",
                    "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}
log = logging.getLogger(__name__)


class TokenRequired(ValueError):
    """--http on a non-loopback address without --http-token."""


def dashboard_files() -> dict[str, bytes]:
    """The page's files, read once from the installed package."""
    root = resources.files("aggregator") / "dashboard"
    return {path: (root / name).read_bytes() for path, (name, _) in STATIC.items()}


NO_ROLLOUT = b'{"rollout": null, "devices": []}'


def make_handler(observer: Observer, token: str | None, files: dict[str, bytes],
                 rollout: Callable[[], dict[str, Any]] | None = None) -> type[BaseHTTPRequestHandler]:
    expected = token.encode() if token else None

    class Handler(BaseHTTPRequestHandler):
        server_version = "nefl-aggregator"
        protocol_version = "HTTP/1.0"  # one request per connection: no idle kept-alive thread
        timeout = TIMEOUT_S

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), fmt % args)

        def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in SECURITY_HEADERS.items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status: HTTPStatus, message: str) -> None:
            self._send(status, json.dumps({"error": message}).encode(), "application/json")

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """http.server's own refusals (bad request line, unknown method) in the same JSON."""
            self.close_connection = True
            self._error(HTTPStatus(code), message or HTTPStatus(code).phrase)

        def _authorised(self, query: dict[str, list[str]]) -> bool:
            if expected is None:
                return True
            header = self.headers.get("Authorization", "")
            given = header[7:] if header.startswith("Bearer ") else (query.get("token") or [""])[0]
            return hmac.compare_digest(given.encode(), expected)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            url = urlsplit(self.path)
            routes: dict[str, Callable[[], tuple[bytes, str]]] = {
                "/api/state": lambda: (observer.snapshot_json(), "application/json"),
                "/api/rollout": lambda: (json.dumps(rollout()).encode() if rollout else NO_ROLLOUT, "application/json"),
                "/metrics": lambda: (generate_latest(observer.metrics.registry), CONTENT_TYPE_LATEST),
            }
            try:
                if url.path in STATIC:
                    self._send(HTTPStatus.OK, files[url.path], STATIC[url.path][1])
                elif url.path == "/health":
                    self._send(HTTPStatus.OK, b'{"status": "ok"}', "application/json")
                elif url.path not in routes:
                    self._error(HTTPStatus.NOT_FOUND, f"no route GET {url.path}; try /, /api/state or /metrics")
                elif not self._authorised(parse_qs(url.query)):
                    self._error(HTTPStatus.UNAUTHORIZED, "send the --http-token as 'Authorization: Bearer TOKEN' "
                                "or ?token=TOKEN")
                else:
                    self._send(HTTPStatus.OK, *routes[url.path]())
            except OSError:
                raise  # the client went away: http.server closes the connection
            except Exception:  # a bug here must never reach the federation: log it, answer 500
                log.exception("GET %s failed", url.path)
                self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error; see the aggregator's log")

        do_HEAD = do_GET

    return Handler


class DashboardServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a cap on connections served at once."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._thread = threading.Thread(target=self.serve_forever, name="aggregator-http", daemon=True)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def start(self) -> DashboardServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self.shutdown()
        self.server_close()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/"


def start_http(observer: Observer, host: str, port: int, token: str | None = None,
               rollout: Callable[[], dict[str, Any]] | None = None) -> DashboardServer:
    """Serve in a background thread; port 0 picks a free one (see .url). Off loopback a token is required.
    `rollout` gives /api/rollout its view (none: an empty one)."""
    if not is_loopback(host) and not token:
        raise TokenRequired(f"--http {host}:{port} would show the fleet to anyone who can reach that address: "
                            "give --http-token (or $NEFL_HTTP_TOKEN), or bind 127.0.0.1")
    return DashboardServer((host, port), make_handler(observer, token, dashboard_files(), rollout)).start()
