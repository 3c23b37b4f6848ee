"""`--http HOST:PORT`: where a command serves its metrics, shared by the aggregator and the device.

A bare PORT means 127.0.0.1:PORT: a metrics page says who is in the fleet and what each device can
do, so it is never exposed to the network unless the operator names an address on purpose.
"""

from __future__ import annotations

import ipaddress
import re
import socket

_LISTEN = re.compile(r"(?:(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):)?([0-9]{1,5})")


def parse_listen(text: str, option: str = "--http") -> tuple[str, int]:
    """'9100' -> ('127.0.0.1', 9100); '0.0.0.0:9100'; '[::1]:9100' -> ('::1', 9100)."""
    m = _LISTEN.fullmatch(text.strip())
    if not m or not 0 <= int(m.group(2)) <= 65535:
        raise ValueError(f"{option} {text!r}: write HOST:PORT (e.g. 127.0.0.1:9100) or just a port")
    host = (m.group(1) or "127.0.0.1").strip("[]")
    return host, int(m.group(2))


def is_loopback(host: str) -> bool:
    """Only this machine can connect: 127.0.0.0/8, ::1 or localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bindable(host: str, port: int, option: str = "--http") -> None:
    """Bind HOST:PORT and let go at once, so a taken port is found before a command does its slow work; raises
    ValueError naming the option."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        socket.create_server((host, port), family=family).close()
    except OSError as e:
        raise ValueError(f"{option} {host}:{port}: {e.strerror or e} (is another process on that port? pick another)") from None
