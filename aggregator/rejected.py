"""`Rejected`: an inbound message the server refuses, with the reason code it is counted under.

Its own torch-free module, so enrolment (and `aggregator enroll --help`) needs none of the
federation's state code.
"""

from __future__ import annotations


class Rejected(ValueError):
    """An inbound message refused for `reason`; logged and counted, never fatal."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
