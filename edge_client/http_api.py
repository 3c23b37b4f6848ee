"""HTTP front of the adaptive runtime: POST an image, get the class and which submodel answered;
GET /metrics gives Prometheus the request counts and latencies per submodel (edge_client/metrics.py).

stdlib http.server (no extra dependency on a device), with the limits a listening port needs:

- a fixed pool of worker threads and a bounded number of accepted connections waiting for one;
  beyond that the accept loop itself answers 503, so a flood of connections never adds a thread;
- one deadline for a request's headers and body together: a per-recv timeout restarts with every
  byte, so a client trickling a byte every few seconds would hold a worker forever;
- the body cap is checked on Content-Length before reading, the pixel cap on the image header
  before decoding;
- a connection answered before its request was read (413, 503, ...) is half-closed and handed to
  one lingering thread that reads and discards the rest (bounded in bytes and time): closing a
  socket with unread bytes makes the kernel send RST, and a client still uploading would see
  "connection reset" instead of the answer.

Every failure a client can cause is a JSON 4xx with a message; anything else is a JSON 500 and the
server keeps serving.

The runtime comes from a `Serving` (edge_client/serving.py): each request takes the version serving
at its start and keeps it to the end, so `edge-client serve --follow` swaps models between requests
and no request sees half of each. Until a followed device has its first version, /predict and
/health answer 503.
"""

from __future__ import annotations

import io
import json
import logging
import queue
import re
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from edge_client.metrics import InferenceMetrics
from edge_client.runtime import MAX_IMAGE_PIXELS, AdaptiveRuntime, ImageError, ImageTooLarge
from edge_client.serving import Active, Serving

MAX_BODY_BYTES = 4 << 20
WORKERS = 8
QUEUE_SIZE = 16  # accepted connections waiting for a worker; beyond this: 503
REQUEST_TIMEOUT_S = 10.0
DRAIN_BYTES = 16 << 20  # read past an early answer: an honest client over the cap gets its 413, not a reset
LINGER_SOCKETS = 256  # connections being drained at once; beyond this they are closed outright
CONTENT_LENGTH = re.compile(r"[0-9]{1,15}")  # int() of a 5000-digit header raises instead of answering
_BUSY_BODY = json.dumps({"error": "server busy: every worker and queue slot is taken; retry in a second"}).encode()
BUSY_RESPONSE = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    max_body: int = MAX_BODY_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    workers: int = WORKERS
    queue_size: int = QUEUE_SIZE
    timeout_s: float = REQUEST_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("max_body", "max_pixels", "workers", "queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")


class ApiError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def result_json(runtime: AdaptiveRuntime, image: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> dict[str, Any]:
    result = runtime.predict(runtime.decode_image(image, max_pixels))
    label = result.labels[0]
    names = runtime.class_names
    return {
        "class": label, "class_name": names[label] if names else None,
        "probabilities": [round(float(p), 6) for p in result.probabilities[0]],
        "submodel": result.submodel + 1, "gamma": result.gamma,  # 1-based, like the CLIs and logs
        "latency_ms": round(result.latency_ms, 3), "predicted_ms": round(result.predicted_ms, 3),
        "reason": result.reason,
    }


class _DeadlineReader(io.RawIOBase):
    """Socket reads that all share the request's one deadline (see the module docstring)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request deadline passed")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


NO_MODEL_YET = "no model yet: this device follows a rollout and has not received a version; retry later"


def make_handler(serving: Serving, limits: Limits, metrics: InferenceMetrics) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "nefl-edge"
        protocol_version = "HTTP/1.0"  # one request per connection: an idle kept-alive one would hold a worker
        timeout = limits.timeout_s  # for writes; reads run against the request deadline
        _unread: int | None = 0  # body bytes still on the socket; None: unknown (chunked or malformed length)

        def setup(self) -> None:
            super().setup()
            self.rfile.close()  # an open makefile() would keep the socket from really closing
            self.rfile = io.BufferedReader(_DeadlineReader(self.connection, time.monotonic() + limits.timeout_s))

        def log_message(self, fmt: str, *args: Any) -> None:
            log.info("%s %s", self.address_string(), fmt % args)

        def _send(self, status: HTTPStatus, body: dict[str, Any]) -> None:
            self._send_bytes(status, json.dumps(body).encode(), "application/json")

        def _send_bytes(self, status: HTTPStatus, data: bytes, content_type: str) -> None:
            if status >= 400:
                metrics.failed.labels(str(int(status))).inc()
            self.connection.settimeout(limits.timeout_s)
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """http.server's own rejections (bad request line, 414, 431, unknown method), in JSON like ours."""
            self.close_connection = True
            self._send(HTTPStatus(code), {"error": message or HTTPStatus(code).phrase})

        def _handle(self, route: Callable[[], dict[str, Any]]) -> None:
            self._unread = self._body_size()
            try:
                self._send(HTTPStatus.OK, route())
            except ApiError as e:
                self._send(e.status, {"error": str(e)})
            except ImageTooLarge as e:
                self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": str(e)})
            except ImageError as e:
                self._send(HTTPStatus.BAD_REQUEST, {"error": str(e)})
            except Exception:  # never take the server down: log it, answer 500, keep serving
                log.exception("request failed")
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error; see the server log"})
            self._discard_unread()

        def _body_size(self) -> int | None:
            length = self.headers.get("Content-Length")
            if length is None:
                return None if "Transfer-Encoding" in self.headers else 0
            return int(length) if CONTENT_LENGTH.fullmatch(length.strip()) else None

        def _discard_unread(self) -> None:
            """Leave the unread body to the lingering thread: a dup keeps the connection open past our close."""
            if self._unread == 0:
                return
            max_bytes = DRAIN_BYTES if self._unread is None else min(self._unread, DRAIN_BYTES)
            self._unread = 0
            self.server.linger(self.connection.dup(), max_bytes)  # type: ignore[attr-defined]

        def _path(self) -> str:
            return self.path.split("?", 1)[0]

        def _active(self) -> Active:
            active = serving.current()
            if active is None:
                raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, NO_MODEL_YET)
            return active

        def _get(self) -> dict[str, Any]:
            if self._path() == "/health":
                active = self._active()
                return {"status": "ok", "submodels": len(active.runtime.submodels), "version": active.version}
            if self._path() == "/models":
                active = self._active()
                return active.runtime.describe() | {"version": active.version}
            raise _unknown(self.command, self._path())

        def _post(self) -> dict[str, Any]:
            if self._path() != "/predict":
                raise _unknown(self.command, self._path())
            size = self._unread
            if size is None or "Content-Length" not in self.headers:
                raise ApiError(HTTPStatus.LENGTH_REQUIRED, "send the image as the body with a Content-Length header")
            if size > limits.max_body:
                raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                               f"body of {size} bytes exceeds the {limits.max_body}-byte limit; send a smaller image")
            if size == 0:
                raise ApiError(HTTPStatus.BAD_REQUEST, "empty body; POST PNG or JPEG bytes to /predict")
            started = time.perf_counter()
            self._unread = 0  # read now, whatever happens: after a timeout there is nothing left to wait for
            try:
                body = self.rfile.read(size)
            except TimeoutError:
                raise ApiError(HTTPStatus.REQUEST_TIMEOUT, f"body not received within {limits.timeout_s:g} s "
                               "(the server's --request-timeout); send the whole image at once") from None
            if len(body) < size:
                raise ApiError(HTTPStatus.BAD_REQUEST, f"body ended after {len(body)} of {size} bytes; "
                               "send the whole image")
            active = self._active()
            try:
                answer = result_json(active.runtime, body, limits.max_pixels)
            except ImageError:
                raise  # the client's input, not the model's health
            except Exception:
                serving.observe(active, False, time.perf_counter() - started)
                raise
            seconds = time.perf_counter() - started
            serving.observe(active, True, seconds)
            metrics.answered(answer["submodel"], seconds)
            return answer | {"version": active.version}  # which rollout version answered (None: a plain --models)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self._path() == "/metrics":  # Prometheus text, not JSON
                self._unread = self._body_size()
                self._send_bytes(HTTPStatus.OK, generate_latest(metrics.registry), CONTENT_TYPE_LATEST)
                self._discard_unread()
                return
            self._handle(self._get)

        def do_POST(self) -> None:  # noqa: N802
            self._handle(self._post)

        def do_PUT(self) -> None:  # noqa: N802
            self._handle(lambda: _raise(_unknown(self.command, self._path())))

        do_DELETE = do_PATCH = do_PUT

    return Handler


def _unknown(method: str, path: str) -> ApiError:
    return ApiError(HTTPStatus.NOT_FOUND, f"no route {method} {path}; use POST /predict, GET /health, GET /models "
                    "or GET /metrics")


def _raise(error: Exception) -> dict[str, Any]:
    raise error


class EdgeHTTPServer(HTTPServer):
    """HTTPServer with a fixed pool of workers (ThreadingHTTPServer starts a thread per connection)."""

    request_queue_size = 128  # the kernel's listen backlog; workers + queue_size is the bound that matters

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], limits: Limits) -> None:
        super().__init__(address, handler)
        self.limits = limits
        # admission counts connections waiting *or* being served: a bounded Queue alone would refuse a
        # burst while idle workers have not yet been scheduled to take from it
        self._slots = threading.BoundedSemaphore(limits.workers + limits.queue_size)
        self._queue: queue.SimpleQueue[tuple[socket.socket, Any] | None] = queue.SimpleQueue()
        self._lingerer = _Lingerer(limits.timeout_s)
        self._workers = [threading.Thread(target=self._work, name=f"edge-http-{i}", daemon=True)
                         for i in range(limits.workers)]
        for worker in self._workers:
            worker.start()

    def linger(self, sock: socket.socket, max_bytes: int) -> None:
        self._lingerer.add(sock, max_bytes)

    def process_request(self, request: Any, client_address: Any) -> None:
        """On the accept loop: hand the connection to a worker, or answer 503 right here when none is free."""
        if self._slots.acquire(blocking=False):
            self._queue.put((request, client_address))
            return
        log.info("%s: busy, answered 503", client_address[0])
        try:
            request.setblocking(False)
            request.send(BUSY_RESPONSE)  # a fresh socket's send buffer has room: this never blocks
        except OSError:
            pass
        self.linger(request, DRAIN_BYTES)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            request, client_address = item
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)
                self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away is one log line; anything else keeps its traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log.info("%s: connection dropped (%s)", client_address[0], error)
        else:
            log.exception("request from %s failed", client_address[0])

    def server_close(self) -> None:
        """Close the connections still waiting (serving them could take queue_size deadlines), then stop."""
        super().server_close()
        while not self._queue.empty():
            if item := self._queue.get_nowait():
                self.shutdown_request(item[0])
        for _ in self._workers:
            self._queue.put(None)
        for worker in self._workers:
            worker.join(self.limits.timeout_s)
        self._lingerer.close()


class _Lingerer:
    """One thread that closes answered connections gracefully, however many there are.

    Each socket is half-closed (our answer, then FIN) and what the client still sends is read and
    dropped until it closes, `max_bytes` were read or `seconds` passed; only then is it closed.
    """

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._incoming: queue.SimpleQueue[tuple[socket.socket, int] | None] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="edge-http-linger", daemon=True)
        self._thread.start()

    def add(self, sock: socket.socket, max_bytes: int) -> None:
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.setblocking(False)
        except OSError:  # the client is already gone
            sock.close()
            return
        self._incoming.put((sock, max_bytes))
        self._wake_w.send(b"\0")

    def close(self) -> None:
        self._incoming.put(None)
        self._wake_w.send(b"\0")
        self._thread.join(self._seconds)
        self._wake_w.close()

    def _run(self) -> None:
        deadlines: dict[socket.socket, tuple[float, int]] = {}  # socket -> (deadline, bytes still to read)
        buffer = bytearray(1 << 16)
        while True:
            timeout = max(0.0, min(d for d, _ in deadlines.values()) - time.monotonic()) if deadlines else None
            for key, _ in self._selector.select(timeout):
                if key.fileobj is self._wake_r:
                    if not self._accept_new(deadlines):
                        for sock in list(deadlines):
                            self._drop(sock, deadlines)
                        self._selector.close()
                        self._wake_r.close()
                        return
                    continue
                sock = key.fileobj
                deadline, left = deadlines[sock]
                try:
                    n = sock.recv_into(buffer, min(left, len(buffer)))
                except BlockingIOError:
                    continue
                except OSError:
                    n = 0
                if n == 0 or n >= left:
                    self._drop(sock, deadlines)
                else:
                    deadlines[sock] = (deadline, left - n)
            now = time.monotonic()
            for sock in [s for s, (d, _) in deadlines.items() if d <= now]:
                self._drop(sock, deadlines)

    def _accept_new(self, deadlines: dict[socket.socket, tuple[float, int]]) -> bool:
        """Register queued sockets; False once close() asked the thread to stop."""
        self._wake_r.recv(4096)
        while True:
            try:
                item = self._incoming.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            sock, max_bytes = item
            if len(deadlines) >= LINGER_SOCKETS:
                sock.close()
                continue
            deadlines[sock] = (time.monotonic() + self._seconds, max_bytes)
            self._selector.register(sock, selectors.EVENT_READ)

    def _drop(self, sock: socket.socket, deadlines: dict[socket.socket, tuple[float, int]]) -> None:
        self._selector.unregister(sock)
        del deadlines[sock]
        sock.close()


def make_server(
    runtime: AdaptiveRuntime | Serving, host: str = "127.0.0.1", port: int = 8080, max_body: int = MAX_BODY_BYTES, *,
    max_pixels: int = MAX_IMAGE_PIXELS, workers: int = WORKERS, queue_size: int = QUEUE_SIZE,
    timeout_s: float = REQUEST_TIMEOUT_S, metrics: InferenceMetrics | None = None,
) -> EdgeHTTPServer:
    """Bound but not yet serving; port 0 picks a free port (see server.server_address). GET /metrics
    serves `metrics` (a fresh registry when not given). A runtime serves for the process's life; a
    Serving is what `--follow` swaps versions in."""
    serving = runtime if isinstance(runtime, Serving) else Serving(Active(runtime, None))
    limits = Limits(max_body, max_pixels, workers, queue_size, timeout_s)
    return EdgeHTTPServer((host, port), make_handler(serving, limits, metrics or InferenceMetrics()), limits)
