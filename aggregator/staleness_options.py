"""Buffered mode's options, shared by `aggregator serve --mode buffered` and `aggregator simulate --mode buffered`
(their defaults: nefl/aggregation/staleness.py StalenessConfig)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from aggregator.fleet import FleetMode
from nefl.support.option_groups import SharedOption

BufferSizeOption = Annotated[int, typer.Option(min=1, help="buffered: updates per committed version (K).")]
StalenessExponentOption = Annotated[float, typer.Option(
    min=0, help="buffered: an update tau versions old counts (1 + tau)^-a (0.5: FedBuff's; 0: alike).")]
MaxStalenessOption = Annotated[int, typer.Option(
    min=0, help="buffered: updates more versions old than this are refused (stale).")]
ModeOption = SharedOption(Optional[FleetMode], "--mode",
                           help="buffered (a version whenever K updates arrive, each weighted by its staleness) or sync.")
