"""The MQTT topic tree of one federation: the only place that spells topic strings.

Everything lives under `nefl/{federation}/` so one broker can carry several federations and an
ACL can confine a client to `.../{client}` leaves (docs/security.md). MQTT 3.1.1 features only.

    announce/{client}     client -> server  retained  device summary, samples, largest submodel
    status/{client}       client -> server  retained  "online"; last will "offline"
    task/{client}         server -> client  retained  round, submodel, lr, epochs
    model/{sub}/{chunk}   server -> all     retained  submodel weights, once per round (broker fans out)
    update/{client}       client -> server            chunked delta of the assigned submodel
    control               server -> all     retained  {"event": "end"} when the federation is over
    server/status         server -> all     retained  live state; last will "offline"
"""

from __future__ import annotations

import re

PREFIX = "nefl"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_name(kind: str, value: str) -> str:
    """Federation and client ids become topic levels, so wildcards and slashes are refused."""
    if not _NAME.fullmatch(value):
        raise ValueError(f"invalid {kind} {value!r}: use 1-64 letters, digits, '_', '.' or '-'")
    return value


class Topics:
    def __init__(self, federation: str) -> None:
        self.federation = check_name("federation name", federation)
        self.root = f"{PREFIX}/{federation}"

    def announce(self, client: str) -> str:
        return f"{self.root}/announce/{client}"

    def status(self, client: str) -> str:
        return f"{self.root}/status/{client}"

    def task(self, client: str) -> str:
        return f"{self.root}/task/{client}"

    def update(self, client: str) -> str:
        return f"{self.root}/update/{client}"

    def model_chunk(self, submodel: int, index: int) -> str:
        return f"{self.root}/model/{submodel}/{index}"

    def model_all(self, submodel: int) -> str:
        return f"{self.root}/model/{submodel}/+"

    @property
    def control(self) -> str:
        return f"{self.root}/control"

    @property
    def server_status(self) -> str:
        return f"{self.root}/server/status"

    def server_subscriptions(self) -> list[str]:
        return [f"{self.root}/{kind}/+" for kind in ("announce", "status", "update")]

    def client_of(self, topic: str, kind: str) -> str | None:
        """The client id of an `{kind}/{client}` topic, or None when the topic is not one."""
        head = f"{self.root}/{kind}/"
        if not topic.startswith(head):
            return None
        client = topic[len(head):]
        return client if _NAME.fullmatch(client) else None
