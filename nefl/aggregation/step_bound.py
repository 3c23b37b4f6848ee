"""A per-tensor bound on the committed step of every tensor: the per-submodel tensors (batch norm, step sizes)
and each cell of the shared tensors.

A submodel's inconsistent tensors are averaged over that submodel's updates only, so in a round of a
few devices on several submodels each copy is moved by a single update: no vote or statistic can judge
it, and the size clip bounds a whole update, where batch-norm statistics are most of the norm. An
update of -weights then moves gamma, running variances and step sizes by up to -1 x themselves.

So each copy's step (new - old of submodel k's tensor `name`) is measured per element, as its RMS, and
bounded by `k` x the median of a pool: the RMS steps of the same tensor's other copies this round (the
other submodels' batch norm of the same layer: peers of the same round, honest while half the copies are)
and the tensor's history, one entry per earlier round that moved at least `peers` copies, that round's
median over its copies (every median here is the lower one of an even count: `middle`). A copy above the
bound is scaled down to it. The history is never built from a lone copy or a pair (which one update
decides), so an attacker that is the only trainer of a submodel cannot ratchet it; it moves only while it
controls most copies of a round. Warm-up: no bound until the
pool holds `peers` sizes (round 1 already, when `peers` submodels trained). Honest steps are clipped when
one copy's step exceeds `k` x the median of its peers and history, e.g. a submodel trained for the first
time after the others settled; it then moves at most `k` x the typical step per round.

Running variances must stay positive: their steps are taken in log space (new / old), so the
committed value is old x exp(bounded step), positive and finite whatever the update said.

It runs where a round's candidate state is committed (nefl/aggregation/pipeline.py), with the centre check,
so `serve`, the coordinator of `--workers` and `simulate` all apply it, under any rule. Cost: at commit,
one pass over the per-submodel tensors (all copies end to end in one float64 buffer) and the bounded shared
ones (tensor by tensor), summed per copy or cell by one `index_add_`; no update held, and a few batched
operations a round rather than torch calls copy by copy and box by box.

Consistent (shared, nested) tensors get the same rule per cell of the nesting: the ring of submodel k's
slice outside the next smaller slice is covered only by the round's updates of submodels whose slice
contains it, so in a round of three the largest submodel's outer ring is moved by one update. Each cell
covered by fewer than `peers` updates has its committed step's RMS bounded by `k` x the median of a pool:
the same tensor's cells this round covered by at least `WELL` updates (averages no lone update decides)
and the tensor's cell history, one entry per round that moved a well-covered cell, that round's median
over them. Cells covered by `peers` or more (the classifier's bias, the shared core) are bounded by `k` x the
median of that history alone, so no round moves any tensor far; warm-up as above, no bound until the history
holds `peers` entries. The classifier is also judged class by class (`by_rows`): each row of a cell (a class's
weights over the ring's features; its bias element) is held to the cell's limit, so a push on one class (the bias
push) cannot pass at sqrt(classes) x that limit inside the cell's RMS over all classes; in a thin cell, also to `k`
x the median row of the well-covered cells and their own history (`ROWS`), a typical class's step rather than a
whole cell's, which also ends the warm-up in round 1. A well-covered cell's rows are held to the cell's limit only,
from whole cells' history, so honest rounds that all propose repairing one class there raise the bound as before.
The history is measured before bounding, so honest rounds that all propose larger steps (repairing a bad commit)
bring the bound along within half a window; a per-submodel copy, which only its own submodel's updates repair, may
always step back toward its anchor (`_Anchor`). Coverage counts the updates
the rule was given (`RoundAggregate.updates`): a rule that drops one counts it still, so a cell it left to
one update may count as two.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import math
import statistics
from collections import deque
from typing import Any

import torch

from nefl.nested.state import GlobalState, Layout
from nefl.nested.tensors import ring
from nefl.aggregation.config import AggregationConfig

POSITIVE = ("running_var",)  # tensors a valid model keeps > 0: bounded in log space
_TINY = 1e-30  # a non-positive running variance counts as this before its log
WELL = 2  # a cell covered by at least this many updates is an average no lone update decides: it joins the pool
ROWS = "#rows"  # suffix of a tensor judged by rows: its history of per-row sizes, beside the cells' own

Box = tuple[slice, ...]


def middle(sizes: list[float]) -> float:
    """The pools' and history's median: the lower one of an even count, so that half the copies (two attackers of four
    submodels a round) cannot raise the bound; the mean of the middle two would be halfway to theirs."""
    return statistics.median_low(sizes)


def positive(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in POSITIVE


def _step(name: str, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The step of one copy in float64: the difference, or the log ratio for a positive tensor."""
    old, new = old.double(), new.double()
    return new.clamp_min(_TINY).log() - old.log() if positive(name) else new - old


def _finite_step(name: str, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`_step` with NaN and infinities as 0: what a bad value's element may still move by once bounded."""
    return torch.nan_to_num(_step(name, old, new), nan=0.0, posinf=0.0, neginf=0.0)


def _apply(name: str, old: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    out = old.double() * step.exp() if positive(name) else old.double() + step
    return out.to(old.dtype)


def rms(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t)) / math.sqrt(max(1, t.numel()))


def cells(layout: Layout, name: str) -> list[tuple[list[Box], list[int]]] | None:
    """Consistent tensor `name`'s cells of the nesting, largest first: each one's boxes (`ring` of one
    submodel slice outside the next smaller one) and the submodels whose slice contains it. None when the
    slices are not nested (a hand-written ladder): the tensor is then not bounded."""
    shapes = sorted({s[name] for s in layout.sub_shapes if name in s}, key=lambda s: s.numel(), reverse=True)
    if not all(all(i <= o for i, o in zip(inner, outer)) for outer, inner in zip(shapes, shapes[1:])):
        return None
    return [(ring(outer, shapes[i + 1] if i + 1 < len(shapes) else None),
             [k for k, s in enumerate(layout.sub_shapes) if name in s and all(a >= b for a, b in zip(s[name], outer))])
            for i, outer in enumerate(shapes)]


def by_rows(layout: Layout, name: str) -> bool:
    """Whether the cells of `name` are also judged row by row: a tensor whose leading dim no slice cuts while a later
    one is cut (the classifier: a row per class, its columns the nested features), and its bias (a class's element)."""
    shapes = {s[name] for s in layout.sub_shapes if name in s}
    weight = name.removesuffix("bias") + "weight"
    if len(layout.global_shapes[name]) == 1 and name.endswith("bias") and weight in layout.global_shapes:
        return by_rows(layout, weight) and layout.global_shapes[weight][0] == layout.global_shapes[name][0]
    return len(layout.global_shapes[name]) >= 2 and len(shapes) > 1 and len({s[0] for s in shapes}) == 1


class _Copies:
    """The per-submodel tensors' copies end to end, running variances first: a round's steps, moves and
    invalid values over all of them are a few vectorised ops on one float64 buffer, summed per copy by one
    `index_add_` each, not a dozen torch calls, each with its dispatch, per copy."""

    def __init__(self, layout: Layout, names: list[str]) -> None:
        holders = {n: [k for k, s in enumerate(layout.sub_shapes) if n in s] for n in names}
        self._keys = sorted(((k, n) for n in names for k in holders[n]), key=lambda key: not positive(key[1]))
        index = {key: i for i, key in enumerate(self._keys)}
        self.of = {n: [(index[k, n], k) for k in ks] for n, ks in holders.items()}  # a name's copies: (index, submodel)
        numels = [layout.sub_shapes[k][n].numel() for k, n in self._keys]
        self._logs = sum(numel for (_, n), numel in zip(self._keys, numels) if positive(n))  # their elements
        self._copy = torch.repeat_interleave(torch.arange(len(numels)), torch.tensor(numels, dtype=torch.long))
        self._roots = torch.tensor(numels, dtype=torch.float64).clamp_min_(1).sqrt_()

    def measure(self, old: list[dict[str, torch.Tensor]], new: list[dict[str, torch.Tensor]]
                ) -> tuple[list[float], list[float], list[float]]:
        """Per copy: its step's RMS (`rms` of `_step`), how many of its values moved (!= as torch.equal: NaN
        has, -0.0 has not) and how many of a positive tensor's new values are not > 0 (NaN is not)."""
        before = _cat([old[k][n] for k, n in self._keys])
        after = _cat([new[k][n] for k, n in self._keys])
        logs = self._logs
        moved, invalid = self._sums(after != before), self._sums(~(after[:logs] > 0), logs)
        step = after  # in place: `after` is done with
        if logs:
            step[:logs].clamp_min_(_TINY).log_().sub_(before[:logs].log())
        step[logs:].sub_(before[logs:])
        sizes = self._sums(step.square_()).sqrt_().div_(self._roots)
        return sizes.tolist(), moved.tolist(), invalid.tolist()

    def _sums(self, values: torch.Tensor, end: int | None = None) -> torch.Tensor:
        """Per copy, the sum of `values`, one per element (up to `end`)."""
        return torch.zeros(len(self._keys), dtype=torch.float64).index_add_(0, self._copy[:end], values.double())


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors flat, end to end, in float64."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in tensors]).double()


class _Cells:
    """The consistent tensors' cells' step sizes: a tensor's squared steps summed over the trailing dims no
    slice cuts (a conv kernel: one matrix-vector product), then per cell over all tensors' rows in one
    `index_add_`, not a few torch calls per box. Tensor by tensor, not end to end as
    the copies: float64 buffers of all the shared weights would cost their page faults every round."""

    def __init__(self, layout: Layout, cells_: dict[str, list[tuple[list[Box], list[int]]]]) -> None:
        self.first = dict(zip(cells_, itertools.accumulate((len(c) for c in cells_.values()), initial=0)))
        trash = sum(len(c) for c in cells_.values())  # the cell of the elements no submodel's slice holds
        self._ones: dict[str, torch.Tensor] = {}  # per tensor, a row of ones: its rows' sums by one mv
        cell, numels = [], torch.zeros(trash + 1, dtype=torch.float64)
        for name, c in cells_.items():
            row, ids = _cell_rows(layout, name, c, self.first[name], trash)
            self._ones[name] = torch.ones(row, dtype=torch.float64)
            cell.append(ids)
            numels += torch.bincount(ids, minlength=trash + 1) * row
        self._cell = torch.cat(cell) if cell else torch.zeros(0, dtype=torch.long)  # each row's
        self._roots = numels.clamp_min_(1).sqrt_()

    def measure(self, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> list[float]:
        """Every cell's step RMS (`rms` of `_step` over its boxes), numbered as `first`."""
        rows = _cat([torch.mv(_step(n, old[n], new[n]).square_().reshape(-1, len(ones)), ones)
                     for n, ones in self._ones.items()])
        sums = torch.zeros(len(self._roots), dtype=torch.float64).index_add_(0, self._cell, rows)
        return sums.sqrt_().div_(self._roots).tolist()


def _cell_rows(layout: Layout, name: str, cells_: list[tuple[list[Box], list[int]]], first: int,
               trash: int) -> tuple[int, torch.Tensor]:
    """Consistent tensor `name`'s row length (the trailing dims no slice cuts) and each row's cell, numbered
    from `first`; `trash` where no submodel's slice holds it."""
    full = layout.global_shapes[name]
    shapes = [s[name] for s in layout.sub_shapes if name in s]
    cut = max((d + 1 for d in range(len(full)) if any(s[d] != full[d] for s in shapes)), default=0)
    row = math.prod(full[cut:]) if full.numel() else 1
    ids = torch.full(full, trash)
    for c, (boxes, _) in enumerate(cells_, start=first):
        for b in boxes:
            ids[b] = c
    return row, ids.reshape(-1, row)[:, 0].clone()


class _Anchor:
    """Per copy of a per-submodel tensor, the element-wise median of its last `window` committed values: where a
    repair may take it back to. A copy moved by one update has no peers that repair it in step with it, so a bad
    value that got through would otherwise come back at k x its peers' step a round, however far it went; a
    step that leaves the copy no farther from its anchor than it was (RMS, log space for running variances) is
    kept whole. One committed bad value does not move a median of the window; an attacker can use the allowance
    only to move a copy within the distance the honest rounds put between it and its anchor, and a copy on its way
    back does not move the anchor."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.past: dict[tuple[int, str], deque[torch.Tensor]] = {}  # per copy (submodel, name): its recorded values
        self._medians: dict[tuple[int, str], torch.Tensor] = {}

    def record(self, inconsistent: list[dict[str, torch.Tensor]], names: list[str],
               repairing: set[tuple[int, str]]) -> None:
        """A committed state's copies join their windows, but for those `repairing` (kept whole by `closer`): the
        anchor stays where it was until they are back."""
        for k, copy in enumerate(inconsistent):
            for n in names:
                if n in copy and (k, n) not in repairing:
                    self.past.setdefault((k, n), deque(maxlen=self.window)).append(copy[n].clone())
        self._medians = {}

    def closer(self, name: str, k: int, old: torch.Tensor, new: torch.Tensor) -> bool:
        """Whether `new` is no farther from copy (k, name)'s anchor than `old` (False without one)."""
        key = (k, name)
        if key not in self._medians:
            if key not in self.past:
                return False
            self._medians[key] = torch.stack(list(self.past[key])).median(0).values
        anchor = self._medians[key]
        return rms(_step(name, anchor, new)) <= rms(_step(name, anchor, old))

    def state_dict(self) -> list[list[Any]]:
        """Per copy, [submodel, name, its recorded values oldest first as base64 float32 (the model's dtype)]: the
        checkpoint's metadata is JSON."""
        return [[k, n, [base64.b64encode(v.to(torch.float32).contiguous().numpy().tobytes()).decode() for v in past]]
                for (k, n), past in sorted(self.past.items())]

    def load_state_dict(self, saved: Any, shapes: dict[tuple[int, str], torch.Size]) -> None:
        """The windows of a saved `state_dict`; refuses one that is not finite values of a known copy's shape
        (`shapes`: each copy's)."""
        past: dict[tuple[int, str], deque[torch.Tensor]] = {}
        try:
            for k, n, values in saved:
                shape = shapes[k, n]
                window = [torch.frombuffer(bytearray(base64.b64decode(v, validate=True)), dtype=torch.float32)
                          .reshape(shape) for v in values]
                if not all(bool(t.isfinite().all()) for t in window):
                    raise ValueError
                past[k, n] = deque(window, maxlen=self.window)
        except (TypeError, ValueError, KeyError, RuntimeError, binascii.Error):
            raise ValueError("the checkpoint's step-bound anchors are not finite values per known copy: resume with "
                             "the profile the checkpoint was written with") from None
        self.past, self._medians = past, {}


def _row_steps(name: str, boxes: list[Box], old: torch.Tensor, new: torch.Tensor
               ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A cell's steps box by box, and each row's (leading index: a class) step RMS over the cell's boxes."""
    steps = [_finite_step(name, old[b], new[b]) for b in boxes]
    sums = sum(s.square().reshape(len(s), -1).sum(1) for s in steps)
    return steps, (sums / sum(s[0].numel() for s in steps)).sqrt()


def _hold_rows(name: str, boxes: list[Box], old: torch.Tensor, new: torch.Tensor, limit: float) -> bool:
    """Scale each row (leading index: a class) of a cell's step in `new` (in place) whose RMS over the cell's boxes
    is above `limit` down to it; whether any was."""
    steps, size = _row_steps(name, boxes, old, new)
    factor = torch.where(size > limit, limit / size, 1.0)
    if not bool((factor < 1).any()):
        return False
    for b, s in zip(boxes, steps):
        new[b] = _apply(name, old[b], (s * factor.view(-1, *([1] * (s.dim() - 1)))).to(new.dtype))
    return True


class StepBound:
    """The bound's history across rounds, one per inconsistent tensor name (all submodels' copies) but those the
    server sets itself (`server_held`: its running statistics), and the copies' anchors."""

    def __init__(self, layout: Layout, cfg: AggregationConfig, server_held: frozenset[str] = frozenset()) -> None:
        self.server_held = server_held
        self.names = sorted(layout.inconsistent - layout.local - server_held)
        self.k, self.peers, self.window = cfg.step_k, cfg.min_cover, cfg.step_window
        self.element = cfg.step_element
        consistent = {n: cells(layout, n) for n in sorted(set(layout.global_shapes) - layout.inconsistent)}
        self.cells = {n: c for n, c in consistent.items() if c is not None}
        self.rows = frozenset(n for n in self.cells if by_rows(layout, n))
        self.history: dict[str, deque[float]] = {n: deque(maxlen=self.window)
                                                 for n in [*self.names, *self.cells, *(n + ROWS for n in self.rows)]}
        self._pending: dict[str, float] = {}  # this round's medians, for the history once the round commits
        self._copies, self._cells = _Copies(layout, self.names), _Cells(layout, self.cells)
        self.anchor = _Anchor(self.window)
        self._shapes = {(k, n): s[n] for n in self.names for k, s in enumerate(layout.sub_shapes) if n in s}
        self._candidate: list[dict[str, torch.Tensor]] = []  # the round's bounded copies, recorded once committed
        self._repairing: set[tuple[int, str]] = set()  # the round's copies kept whole on their way back to the anchor

    def limit(self, name: str, sizes: list[float]) -> float:
        """k x the median of this round's copies' sizes and the tensor's history; inf during warm-up."""
        pool = [*sizes, *self.history[name]]
        return self.k * middle(pool) if len(pool) >= self.peers else math.inf

    def apply(self, old: GlobalState, new: GlobalState, updates: list[int]) -> dict[int, int]:
        """Bound every moved copy of `new` in place (the round's candidate), and every thinly covered cell of
        its consistent tensors (`updates`: the round's updates per submodel); returns how many tensors of
        each submodel were scaled down (a cell counts for the largest submodel covering it). A positive
        tensor's copy is also rebuilt from its log step when a value went non-positive or non-finite."""
        bounded: dict[int, int] = {}
        self._pending, self._repairing = {}, set()
        sizes = self._cells.measure(old.consistent, new.consistent)
        for name, cells_ in self.cells.items():
            first = self._cells.first[name]
            for k in self._bound_cells(name, cells_, sizes[first:first + len(cells_)], old.consistent[name],
                                       new.consistent[name], updates):
                bounded[k] = bounded.get(k, 0) + 1
        sizes, moved, invalid = self._copies.measure(old.inconsistent, new.inconsistent)
        for name, ids in self._copies.of.items():
            copies = [(i, k) for i, k in ids if moved[i]]
            if not copies:
                continue
            finite = [sizes[i] for i, _ in copies if math.isfinite(sizes[i])]
            limit = self.limit(name, finite)
            for i, k in copies:
                size = sizes[i]
                if size > limit and math.isfinite(size) and not invalid[i] and self.anchor.closer(
                        name, k, old.inconsistent[k][name], new.inconsistent[k][name]):
                    self._repairing.add((k, name))
                elif size > limit or not math.isfinite(size) or invalid[i]:
                    o = old.inconsistent[k][name]
                    step = _finite_step(name, o, new.inconsistent[k][name])
                    size = rms(step)
                    if size > limit:
                        step = step * (limit / size)
                        bounded[k] = bounded.get(k, 0) + 1
                    new.inconsistent[k][name] = _apply(name, o, self._per_element(step, limit))
                elif self.element and math.isfinite(limit):
                    o = old.inconsistent[k][name]
                    step = _step(name, o, new.inconsistent[k][name])
                    cut = self._per_element(step, limit)
                    if not torch.equal(cut, step):
                        new.inconsistent[k][name] = _apply(name, o, cut)
                        bounded[k] = bounded.get(k, 0) + 1
            if len(finite) >= self.peers:
                self._pending[name] = middle(finite)
        self._candidate = new.inconsistent
        return bounded

    def _per_element(self, step: torch.Tensor, limit: float) -> torch.Tensor:
        """`step` with each element within +-`step_element` x `limit` (off: 0), so a copy honest in all elements but
        one channel is cut in that channel where its RMS passes the tensor's bound."""
        if not self.element or not math.isfinite(limit):
            return step
        return step.clamp(-self.element * limit, self.element * limit)

    def _bound_cells(self, name: str, cells_: list[tuple[list[Box], list[int]]], sizes: list[float],
                     old: torch.Tensor, new: torch.Tensor, updates: list[int]) -> list[int]:
        """Scale each thin cell's step in `new` (in place) to k x the median of the well-covered cells and
        history, and each cell covered by `peers` or more to k x the median of the history alone (`sizes`: the
        cells' step sizes), and in a tensor judged by rows (`by_rows`) each row of a cell to that cell's limit, of a
        thin cell also to k x the median of the well-covered cells' rows and their history (`ROWS`);
        returns the submodels that are the largest covering a cell scaled down (once each)."""
        moved = []
        for (boxes, ks), size in zip(cells_, sizes):
            cover = sum(updates[k] for k in ks)
            if cover > 0 and size > 0:
                moved.append((boxes, ks, cover, size))
        well = [size for _, _, cover, size in moved if cover >= WELL and math.isfinite(size)]
        thin, own = self.limit(name, well), self.limit(name, [])
        rows = name in self.rows
        well_rows = [r for boxes, _, cover, _ in moved if rows and cover >= WELL
                     for r in _row_steps(name, boxes, old, new)[1].tolist() if math.isfinite(r)]
        thin_rows = self.limit(name + ROWS, well_rows) if rows else math.inf
        out = []
        for boxes, ks, cover, size in moved:
            limit = thin if cover < self.peers else own
            if size > limit:
                for b in boxes:
                    step = _finite_step(name, old[b], new[b])
                    new[b] = _apply(name, old[b], step * (limit / size))
                out.append(max(ks))
            row_limit = min(limit, thin_rows) if cover < self.peers else limit
            if rows and math.isfinite(row_limit) and _hold_rows(name, boxes, old, new, row_limit):
                out.append(max(ks))
        if well:
            self._pending[name] = middle(well)
        if well_rows:
            self._pending[name + ROWS] = middle(well_rows)
        return sorted(set(out))

    def pending(self) -> tuple[dict[str, float], set[tuple[int, str]], list[dict[str, torch.Tensor]]]:
        """What `commit` would record (the last `apply`'s): kept across the gate's trial candidates, each bounded too."""
        return self._pending, self._repairing, self._candidate

    def restore(self, pending: tuple[dict[str, float], set[tuple[int, str]], list[dict[str, torch.Tensor]]]) -> None:
        self._pending, self._repairing, self._candidate = pending

    def commit(self) -> None:
        """The round's state was committed: its medians (rounds with enough copies) join the history, its copies
        the anchors' window."""
        for name, size in self._pending.items():
            self.history[name].append(size)
        self._pending = {}
        self.anchor.record(self._candidate, self.names, self._repairing)

    def state_dict(self) -> dict[str, Any]:
        return {"history": {n: list(h) for n, h in self.history.items() if h}, "anchors": self.anchor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed server keeps its bounds and anchors (a checkpoint without anchors leaves them empty, to be
        rebuilt over the next rounds; what it holds of tensors the server now sets itself is dropped); refuses a
        history that is not finite sizes per known tensor, or anchors that are not finite values per known copy."""
        if isinstance(state, dict) and isinstance(state.get("history"), dict):
            state = {**state, "history": {n: h for n, h in state["history"].items() if n not in self.server_held}}
        anchors = state.get("anchors", []) if isinstance(state, dict) else None
        if isinstance(anchors, list):
            anchors = [a for a in anchors if not (isinstance(a, list) and len(a) == 3 and isinstance(a[1], str)
                                                  and a[1] in self.server_held)]
        load_history(self.history, state, "step-bound")
        self.anchor.load_state_dict(anchors, self._shapes)


def load_history(history: dict[str, deque[float]], state: dict[str, Any], what: str) -> None:
    """Per-tensor size histories (`history`, each deque keeps its maxlen) from a checkpoint's `state`; refuses one
    that is not finite sizes >= 0 per tensor `history` knows."""
    saved = state.get("history") if isinstance(state, dict) else None
    if not isinstance(saved, dict) or not all(
            n in history and isinstance(h, list) and all(type(x) in (int, float) and math.isfinite(x) and x >= 0 for x in h)
            for n, h in saved.items()):
        raise ValueError(f"the checkpoint's {what} history is not finite sizes per known tensor: "
                         "resume with the profile the checkpoint was written with")
    for n, h in saved.items():
        history[n] = deque((float(x) for x in h), maxlen=history[n].maxlen)
