"""What the commands write: log records for events, and a console for their results.

Events go through the stdlib logging module to stderr, one line each: `plain` for people, `json`
(one object per line: time, level, logger, msg and the event's own fields passed with `extra=`,
such as round, client, submodel, reason) for a fleet's log shipper, which then needs no pattern.
Neither holds rich markup or folds at 80 columns. Only a person at a terminal gets a live spinner or
bar (`progress`), and results written through `console()` turn plain once they go to a file or pipe.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, Literal

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from nefl.support.choices import check_choice

LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["plain", "json"]
PACKAGES = ("nefl", "aggregator", "edge_client", "export")  # whose records --log-level governs
HANDLER_NAME = "nefl"
PIPED_WIDTH = 10_000  # a table written to a file keeps its rows whole instead of folding at 80 columns

# what every LogRecord carries; any other attribute on a record came in through `extra=`
_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def _event_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The event's own fields (extra=...), in the order they were given."""
    return {k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS}


class PlainFormatter(logging.Formatter):
    """`2025-01-31 12:00:00 INFO aggregator.server: round 3 closed round=3 reason=quorum`."""

    def format(self, record: logging.LogRecord) -> str:
        fields = "".join(f" {k}={v}" for k, v in _event_fields(record).items())
        line = f"{self.formatTime(record, '%Y-%m-%d %H:%M:%S')} {record.levelname} {record.name}: {record.getMessage()}{fields}"
        return f"{line}\n{self.formatException(record.exc_info)}" if record.exc_info else line


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a traceback rides in `exc` so the line stays one line."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_event_fields(record),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


FORMATTERS: dict[LogFormat, type[logging.Formatter]] = {"plain": PlainFormatter, "json": JsonFormatter}


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record arrives: test runners and daemons swap it,
    and a handler holding the old stream would write into a closed file."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)  # StreamHandler.__init__ would pin the stream of today

    @property
    def stream(self) -> Any:
        return sys.stderr


class _Context(logging.Filter):
    """Fields every json line of this process carries unless the event names its own (e.g. client)."""

    def __init__(self, fields: Mapping[str, Any]) -> None:
        super().__init__()
        self.fields = dict(fields)

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in self.fields.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def setup_logging(level: str, fmt: LogFormat = "plain", context: Mapping[str, Any] | None = None) -> None:
    """Route this kit's loggers to stderr at `level` in `fmt`; calling it again replaces the earlier
    setup (one process may run several commands), and other libraries stay at warnings. `context`
    (json only: a shipper merging many devices' lines needs it, a person reading one stream does not)
    adds fields such as the client id to every line."""
    check_choice(LogLevel, level.lower(), "--log-level")
    check_choice(LogFormat, fmt, "--log-format")
    handler = _StderrHandler()
    handler.set_name(HANDLER_NAME)
    handler.setFormatter(FORMATTERS[fmt]())
    if context and fmt == "json":
        handler.addFilter(_Context(context))
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    for package in PACKAGES:
        logging.getLogger(package).setLevel(level.upper())



def console(stderr: bool = False) -> Console:
    """Rich output at a terminal; to a file or a pipe, plain text: no colour codes, no 80-column folding."""
    if (sys.stderr if stderr else sys.stdout).isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, color_system=None, highlight=False, soft_wrap=True, width=PIPED_WIDTH)


@contextmanager
def progress(fmt: LogFormat, logger: logging.Logger, total: int | None = None) -> Iterator[Callable[[str], None]]:
    """Yields `report(step)`: a live spinner (or, given a total, a bar that each report advances by
    one) for a person at a terminal; anywhere else, or with json logs, one log record per step."""
    if fmt != "plain" or not sys.stderr.isatty():
        yield logger.info
        return
    columns = ([SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()] if total is None else
               [MofNCompleteColumn(), BarColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), TimeRemainingColumn()])
    with Progress(*columns, console=console(stderr=True)) as bar:
        task = bar.add_task("", total=total)
        yield lambda step: bar.update(task, description=step, advance=0 if total is None else 1)
