"""The broker `aggregator serve` starts when no --broker is given: mosquitto as a child process when
its binary is installed, else amqtt in a thread of the server.

mosquitto is what production runs on and moves far more than amqtt does through one thread
(docs/benchmarks.md, "Fleet load test"); amqtt (pure Python, a dependency of the full install) keeps
a laptop demo working where nobody installed mosquitto. Either way the broker lives and dies with the
server: the mosquitto child gets its own config in a temporary directory, listens on the given (or a
free) port on localhost unless told otherwise, is stopped with the server, and the kernel ends it if
the server dies without stopping it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Literal, Protocol

BrokerKind = Literal["auto", "mosquitto", "amqtt"]
MOSQUITTO_PATHS = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")
AMQTT_NOTE = ("no mosquitto binary found, so the embedded broker is amqtt (pure Python): it moves about a tenth "
              "of what mosquitto does (docs/benchmarks.md); install mosquitto (`apt install mosquitto`) for more")
log = logging.getLogger("aggregator.server")


class EmbeddedBroker(Protocol):
    name: str
    host: str
    port: int

    @property
    def url(self) -> str: ...

    def start(self, timeout_s: float = 15.0) -> None: ...

    def stop(self, timeout_s: float = 5.0) -> None: ...


def find_mosquitto() -> str | None:
    """The mosquitto binary on PATH or where Debian and source installs put it (sbin is often off PATH)."""
    return shutil.which("mosquitto") or next((p for p in MOSQUITTO_PATHS if os.access(p, os.X_OK)), None)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host if host not in ("0.0.0.0", "") else "127.0.0.1", port)) == 0


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends SIGTERM when the thread that started it (the server's
    main thread) dies (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: stop() still stops it; a killed server leaves it running


class MosquittoBroker:
    """mosquitto as a child process of the server, with a config of its own."""

    name = "mosquitto"

    def __init__(self, host: str = "127.0.0.1", port: int = 1883, binary: str | None = None) -> None:
        self.binary = binary or find_mosquitto()
        if self.binary is None:
            raise RuntimeError("no mosquitto binary found")
        self.host, self.port = host, port or free_port(host)
        self._dir: Path | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{'127.0.0.1' if self.host in ('0.0.0.0', '') else self.host}:{self.port}"

    def config(self) -> str:
        """Anonymous access (like amqtt's), no persistence: a federation's state lives in its checkpoints,
        and retained messages are republished after a restart. Room for a round's updates in flight."""
        user = "user root\n" if os.geteuid() == 0 else ""  # as root, mosquitto would switch to a user that may not exist
        return (f"listener {self.port} {self.host}\nallow_anonymous true\npersistence false\n{user}"
                "max_queued_messages 100000\nmax_inflight_messages 100\nlog_dest stderr\nlog_type error\nlog_type warning\n")

    def start(self, timeout_s: float = 15.0) -> None:
        """Run it and wait until it listens; RuntimeError (e.g. port in use) with mosquitto's own words."""
        if _listening(self.host, self.port):
            raise RuntimeError(f"embedded mosquitto could not listen on {self.host}:{self.port} (something already "
                               "does); pick another --embedded-port or pass --broker")
        self._dir = Path(tempfile.mkdtemp(prefix="nefl-mosquitto-"))
        conf, out = self._dir / "mosquitto.conf", self._dir / "mosquitto.log"
        conf.write_text(self.config())
        with open(out, "wb") as log_file:
            self.proc = subprocess.Popen([self.binary, "-c", str(conf)], stdout=log_file, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                said = out.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                self._cleanup()
                raise RuntimeError(f"embedded mosquitto could not listen on {self.host}:{self.port} ({said[0]}); "
                                   "pick another --embedded-port or pass --broker")
            if _listening(self.host, self.port):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"embedded mosquitto did not listen on {self.host}:{self.port} within {timeout_s:g}s")

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class AmqttBroker:
    """amqtt on its own asyncio loop in a daemon thread of the server process."""

    name = "amqtt"

    def __init__(self, host: str = "127.0.0.1", port: int = 1883) -> None:
        self.host, self.port = host, port or free_port(host)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="embedded-broker", daemon=True)
        self._broker = None

    @property
    def url(self) -> str:
        return f"mqtt://{'127.0.0.1' if self.host in ('0.0.0.0', '') else self.host}:{self.port}"

    def start(self, timeout_s: float = 15.0) -> None:
        """Bind and serve; raises RuntimeError (e.g. port in use) instead of failing later."""
        from amqtt.broker import Broker

        for name in ("amqtt", "transitions"):
            logging.getLogger(name).setLevel(logging.ERROR)
        self._thread.start()
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }

        async def boot() -> None:
            self._broker = Broker(config)
            await self._broker.start()

        try:
            asyncio.run_coroutine_threadsafe(boot(), self._loop).result(timeout_s)
        except Exception as e:
            raise RuntimeError(f"embedded broker could not listen on {self.host}:{self.port} ({e}); "
                               "pick another --embedded-port or pass --broker") from None

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._broker is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._broker.shutdown(), self._loop).result(timeout_s)
            except Exception:  # shutting down: a broker that will not stop cleanly is abandoned with the thread
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)


def embedded_broker(kind: BrokerKind, host: str, port: int) -> EmbeddedBroker:
    """The broker to start: mosquitto when asked or (auto) installed, amqtt when asked or as the fallback,
    saying in one line what the fallback gives up. ValueError when mosquitto is asked for and missing."""
    if kind == "amqtt":
        return AmqttBroker(host, port)
    if find_mosquitto() is not None:
        return MosquittoBroker(host, port)
    if kind == "mosquitto":
        raise ValueError("--embedded-broker mosquitto: no mosquitto binary found (install it, e.g. "
                         "`apt install mosquitto`, or use --embedded-broker auto)")
    log.warning(AMQTT_NOTE)
    return AmqttBroker(host, port)
