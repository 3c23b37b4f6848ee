"""Start-up's objects out of the cyclic garbage collector's reach, for long-running commands.

A process that imported torch and the kit holds about 330,000 objects the collector tracks, and each full
collection walks all of them (0.2 s here). An aggregator's stream of updates leaves enough survivors (each
client's round metrics, receipts, the round's bookkeeping) to set one off every few hundred updates: under a
fleet's load test perf put the collector at about a fifth of a worker's samples (docs/scale.md; measured alone,
freezing moved the worker's CPU per MiB by less than the runs' spread). Frozen objects are
never collected, so only what start-up built and keeps for good belongs there: call `freeze_startup` once a
command is set up, just before its loop.
"""

from __future__ import annotations

import gc


def freeze_startup() -> None:
    """Collect start-up's garbage, then move every object still alive to the permanent generation."""
    gc.collect()
    gc.freeze()
