"""Resumable sweeps of independent runs over worker processes, shared by the benchmarks that run many
simulations (bench_accuracy.py, bench_robust.py): each finished run lands atomically as JSON at its
job's path and is skipped on the next start, a progress bar per running job, one broken run never
loses the others."""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from multiprocessing import Manager
from pathlib import Path
from typing import Protocol, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class SweepJob(Protocol):
    @property
    def label(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def rounds(self) -> int: ...


J = TypeVar("J", bound=SweepJob)


def run_sweep(jobs: Sequence[J], workers: int, run: Callable[[J, object], dict], load: Callable[[J], dict | None],
              describe: Callable[[dict], str], console: Console) -> list[dict]:
    """Every job's result: `load(job)` for those already on disk, `run(job, progress_queue)` in a worker
    process for the rest (it puts (label, rounds done) on the queue and writes its result to job.path)."""
    results = [r for j in jobs if (r := load(j)) is not None]
    todo = [j for j in jobs if not Path(j.path).exists()]
    console.print(f"{len(jobs)} runs: {len(results)} already done, {len(todo)} to run with {workers} job(s)")
    if not todo:
        return results
    failed: list[str] = []
    columns = (TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Manager() as manager, Progress(*columns, console=console) as progress, \
            ProcessPoolExecutor(max_workers=workers) as pool:
        rounds_q = manager.Queue()
        overall = progress.add_task("[bold]sweep", total=len(todo))
        tasks = {j.label: progress.add_task(j.label, total=j.rounds, visible=False) for j in todo}
        pending: dict[Future, J] = {pool.submit(run, j, rounds_q): j for j in todo}
        try:
            while pending:
                done, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                _drain(rounds_q, progress, tasks)
                for fut in done:
                    job = pending.pop(fut)
                    progress.update(tasks[job.label], visible=False)
                    progress.advance(overall)
                    try:
                        result = fut.result()
                    except Exception as exc:  # one broken run must not lose the others' hours
                        failed.append(f"{job.label}: {type(exc).__name__}: {exc}")
                        progress.console.print(f"[red]{failed[-1]}")
                        continue
                    results.append(result)
                    progress.console.print(f"{job.label}: {describe(result)}")
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed (finished runs are saved; rerun to resume):\n" + "\n".join(failed))
    return results


def _drain(rounds_q, progress: Progress, tasks: dict) -> None:
    while True:
        try:
            label, done_rounds = rounds_q.get_nowait()
        except queue.Empty:
            return
        progress.update(tasks[label], completed=done_rounds, visible=True)
