"""HTTP front of the adaptive runtime: POST an image, get the class and which submodel answered.

stdlib ThreadingHTTPServer: no extra dependency on a device, and the runtime serialises model
runs itself. Every failure a client can cause is a JSON 4xx with a message; anything else is a
JSON 500 and the server keeps serving.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from edge_client.runtime import AdaptiveRuntime, ImageError

MAX_BODY_BYTES = 4 << 20
log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def result_json(runtime: AdaptiveRuntime, image: bytes) -> dict[str, Any]:
    result = runtime.predict(runtime.decode_image(image))
    label = result.labels[0]
    names = runtime.class_names
    return {
        "class": label, "class_name": names[label] if names else None,
        "probabilities": [round(float(p), 6) for p in result.probabilities[0]],
        "submodel": result.submodel, "gamma": result.gamma,
        "latency_ms": round(result.latency_ms, 3), "predicted_ms": round(result.predicted_ms, 3),
        "reason": result.reason,
    }


def make_handler(runtime: AdaptiveRuntime, max_body: int = MAX_BODY_BYTES) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "nefl-edge"

        def log_message(self, fmt: str, *args: Any) -> None:
            log.info("%s %s", self.address_string(), fmt % args)

        def _send(self, status: HTTPStatus, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self, route: Any) -> None:
            try:
                self._send(HTTPStatus.OK, route())
            except ApiError as e:
                self.close_connection = True  # an unread body must not be parsed as the next request
                self._send(e.status, {"error": str(e)})
            except ImageError as e:
                self._send(HTTPStatus.BAD_REQUEST, {"error": str(e)})
            except Exception:  # never take the server down: log it, answer 500, keep serving
                log.exception("request failed")
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error; see the server log"})

        def _path(self) -> str:
            return self.path.split("?", 1)[0]

        def _get(self) -> dict[str, Any]:
            if self._path() == "/health":
                return {"status": "ok", "submodels": len(runtime.submodels)}
            if self._path() == "/models":
                return runtime.describe()
            raise _unknown(self.command, self._path())

        def _post(self) -> dict[str, Any]:
            if self._path() != "/predict":
                raise _unknown(self.command, self._path())
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise ApiError(HTTPStatus.LENGTH_REQUIRED, "send the image as the body with a Content-Length header")
            if int(length) > max_body:
                raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                               f"body of {length} bytes exceeds the {max_body}-byte limit; send a smaller image")
            if int(length) == 0:
                raise ApiError(HTTPStatus.BAD_REQUEST, "empty body; POST PNG or JPEG bytes to /predict")
            return result_json(runtime, self.rfile.read(int(length)))

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._handle(self._get)

        def do_POST(self) -> None:  # noqa: N802
            self._handle(self._post)

        def do_PUT(self) -> None:  # noqa: N802
            self._handle(lambda: _raise(_unknown(self.command, self._path())))

        do_DELETE = do_PATCH = do_PUT

    return Handler


def _unknown(method: str, path: str) -> ApiError:
    return ApiError(HTTPStatus.NOT_FOUND, f"no route {method} {path}; use POST /predict, GET /health or GET /models")


def _raise(error: Exception) -> dict[str, Any]:
    raise error


def make_server(runtime: AdaptiveRuntime, host: str = "127.0.0.1", port: int = 8080,
                max_body: int = MAX_BODY_BYTES) -> ThreadingHTTPServer:
    """Bound but not yet serving; port 0 picks a free port (see server.server_address)."""
    server = ThreadingHTTPServer((host, port), make_handler(runtime, max_body))
    server.daemon_threads = True
    return server
