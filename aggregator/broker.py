"""The embedded MQTT 3.1.1 broker (amqtt) that `aggregator serve` starts when no --broker is given.

It runs on its own asyncio loop in a daemon thread of the server process, so a laptop demo needs
no separate broker; anything beyond a demo should use mosquitto/EMQX (docs/security.md).
"""

from __future__ import annotations

import asyncio
import logging
import threading

from amqtt.broker import Broker


class EmbeddedBroker:
    def __init__(self, host: str = "127.0.0.1", port: int = 1883) -> None:
        self.host, self.port = host, port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="embedded-broker", daemon=True)
        self._broker: Broker | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def start(self, timeout_s: float = 15.0) -> None:
        """Bind and serve; raises RuntimeError (e.g. port in use) instead of failing later."""
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
