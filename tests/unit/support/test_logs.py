import json
import logging

import pytest

from nefl.support.logs import HANDLER_NAME, PACKAGES, setup_logging

log = logging.getLogger("aggregator.test")


@pytest.fixture(autouse=True)
def _restore_logging():
    """setup_logging configures the process: leave the next test the logging it started with."""
    root = logging.getLogger()
    saved = root.level, [logging.getLogger(p).level for p in PACKAGES]
    yield
    for h in [h for h in root.handlers if h.get_name() == HANDLER_NAME]:
        root.removeHandler(h)
    root.setLevel(saved[0])
    for p, level in zip(PACKAGES, saved[1]):
        logging.getLogger(p).setLevel(level)


def test_json_lines_carry_the_event_fields(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("info", "json")
    log.info("update rejected", extra={"round": 3, "client": "c1", "submodel": 2, "reason": "norm"})
    log.debug("not at info")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    doc = json.loads(lines[0])
    assert set(doc) == {"time", "level", "logger", "msg", "round", "client", "submodel", "reason"}
    assert (doc["level"], doc["logger"], doc["msg"], doc["round"], doc["reason"]) == ("info", "aggregator.test",
                                                                                      "update rejected", 3, "norm")


def test_plain_is_one_undecorated_line_and_a_second_setup_replaces_the_first(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("info", "json")
    setup_logging("DEBUG")
    log.debug("round closed " + "x" * 200, extra={"round": 4})
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err
    assert err.rstrip().endswith("x round=4") and " DEBUG aggregator.test: round closed" in err
    assert [h.get_name() for h in logging.getLogger().handlers].count(HANDLER_NAME) == 1


def test_unknown_level_or_format_is_refused() -> None:
    with pytest.raises(ValueError, match="--log-level must be one of 'debug', 'info'"):
        setup_logging("verbose")
    with pytest.raises(ValueError, match="--log-format must be one of 'plain', 'json'"):
        setup_logging("info", "yaml")  # type: ignore[arg-type]
