"""The centre check in front of any rule: a majority vote on direction and a bound on size (`Screened`)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from nefl.aggregation.aggregate import RoundAggregate, tensor_bytes, update_weight
from nefl.aggregation.buffered import Held
from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.coordinate import Copies, small_tensors
from nefl.aggregation.coverage import Sketch, pairwise_cosines, shared_core
from nefl.aggregation.nefedavg import Mergeable, NeFedAvg, as_mergeable
from nefl.aggregation.robust import update_norm
from nefl.aggregation.tensor_screen import Sizes, TensorSizes, add_noise, clip_factors, clipped_norm, measure
from nefl.nested.state import GlobalState


class Screened(RoundAggregate):
    """The centre check in front of any rule: a majority vote on direction, and a bound on size.

    Each update is reduced to its relative norm (to its submodel's weight norm) and a sketch of the
    round's shared core. An update must point the same way as at least `min_agree` of the round's other
    updates, or it is dropped: with fewer than half of the updates hostile, an honest update agrees with
    the honest majority and a flipped or foreign one does not, whatever its size (a median centre of
    three sketches, one of them 9x the others, follows the large one where the two honest ones differ).
    Pointing the same way means a cosine above the margin, not merely above 0: an update unrelated to the
    others (-weights in a net with batch norm after every conv is near orthogonal to honest updates) has a
    cosine of either sign by chance, and a positive one with half of the others by a coin flip. The margin
    is `agree_z` / sqrt(sketch size), the spread of unrelated vectors' cosine, or `agree_of_strongest` x
    the round's strongest pairwise cosine where that is lower: honest updates of submodels far apart in
    size can align more weakly than the spread, and a hostile update raising the strongest cosine only
    brings the margin back to the spread's. Only updates within the size bound below vote (an outsized
    one is already an outlier). The vote acts only while `vote_quorum` of the voters reach `min_agree`:
    honest updates can point apart, and then no update is dropped for its direction. Nor is one that points along the
    server's own step of the last commit, where it has one (its fine-tuning on clean images). One larger than
    `max_norm_ratio` x the round's median relative norm is clipped to that if the vote confirmed it, and
    to the median itself if not (short of `min_agree` in a round where the vote abstained). The
    first `hold` updates are judged together, later ones each as of its arrival (the median, margin and
    others it had then) against the `compare` most recent (streaming: memory is `hold` updates plus one
    sketch per update). Later ones are judged in batches of up to `hold`, so that one product with the recent
    sketches scores a batch: reading 256 sketches (4 MiB) costs more than the arithmetic, and done per update
    it would be the largest single cost of a worker's update. With fewer than `min_cover` updates
    in the round there is no majority and nothing is dropped or clipped as a whole.

    Every named tensor of a kept update is also judged on its own size (nefl/aggregation/tensor_screen.py): one
    above `tensor_clip` x its reference (the round's median per-element size of that tensor and its history) is
    scaled to that bound before the whole-update clip, which then measures what is left; in rounds of any size,
    from the history where the round is too thin. A per-submodel tensor's copy that fewer than `min_cover` of the
    round's updates carry is left to the step bound at commit, whole: neither clipped here nor counted in the
    whole-update clip (a submodel's running statistics, first trained or repaired after a bad round, are most of
    an honest update's norm and would have the rest of it scaled down).

    The small shared tensors (the classifier; at most `coordinate_max` elements) of the kept updates, as clipped, are
    also held, and at finalize merged per element by a trimmed mean in place of the rule's average
    (nefl/aggregation/coordinate.py): no direction vote judges them under non-IID data."""

    compare = 256  # most recent sketches an arriving update is compared with: O(1) work per update

    def __init__(self, inner: RoundAggregate, cfg: AggregationConfig, weight_norm: Callable[[int], float],
                 assignments: Mapping[str, int], seed: int, sizes: TensorSizes,
                 server_step: Mapping[str, torch.Tensor] | None = None) -> None:
        super().__init__(inner.layout, inner.weighting)
        self.inner, self.cfg, self.weight_norm, self.sizes = inner, cfg, weight_norm, sizes
        self.noise = torch.Generator().manual_seed(seed ^ 0x5EED)  # tensor noise: the round's seed, apart from the sketch's
        self.name = inner.name
        self.hold = max(1, min(cfg.hold, len(assignments)))
        self.sketch = Sketch(shared_core(inner.layout, assignments.values()), cfg.sketch, seed)
        self.spread = cfg.agree_z / math.sqrt(max(1, self.sketch.size))  # agree_z x unrelated vectors' cosine spread
        self.server = self._server_sketch(server_step)
        self.with_server: dict[str, float] = {}  # client -> its sketch's cosine with the server's step, where the vote asked
        self._strongest = 0.0  # the largest cosine between a sketch and one it was compared with on arrival
        # row i: update i's sketch, its norm and relative norm, in numpy (a vote's few small operations cost less than
        # torch's dispatch); rows grow by doubling, so a vote is one product with a slice, not a stack, and nothing
        # about an earlier update is recomputed
        rows = max(1, min(len(assignments), self.compare + 1))
        self.sketches = np.empty((rows, self.sketch.size), dtype=np.float32)
        self.norms = np.empty(rows, dtype=np.float32)
        self.ratio_of = np.empty(rows)  # float64
        self._sorted: list[float] = []  # the relative norms so far, sorted: the median as each update arrives
        self.medians: dict[int, float] = {}  # sketch i (pending) -> the median relative norm as of its arrival
        self.count = 0  # sketches held
        self._normed = 0  # sketches whose norms are in `norms`
        self.scored = 0  # sketches whose arrival cosines are folded into the strongest
        # sketch i (pending) -> the first of the others it was compared with on arrival (they run to i - 1), those
        # cosines, and the strongest cosine of the round up to and including its arrival
        self.arrivals: dict[int, tuple[int, np.ndarray, float]] = {}
        self.streaming = False  # the first `hold` were judged: the rest are judged each as of its arrival
        self.pending: list[tuple[Held, int, float]] = []  # (update, index of its sketch, relative norm)
        self.clipped: dict[str, float] = {}  # client -> the factor its update's norm was scaled by to the size bound
        self.own: dict[int, Sizes] = {}  # sketch i (pending) -> its update's tensor sizes
        self.references: dict[int, dict[str, float]] = {}  # sketch i (pending, streaming) -> its references on arrival
        self.tensors_clipped: dict[str, int] = {}  # client -> how many of its tensors were scaled to their bound
        self.agreement: dict[str, float] = {}  # client -> the share of the others it points the same way as
        self.judged = self.agreed = 0  # voters judged, and those that reached `min_agree`
        # the small shared tensors (the classifier) of the kept updates: merged per element at finalize
        small = small_tensors(inner.layout, cfg.coordinate_max) if cfg.coordinate_trim > 0 else frozenset()
        self.copies = Copies(small, cfg.coordinate_trim, cfg.min_cover, cfg.coordinate_rows)
        self.trimmed = 0  # elements whose step is the trimmed mean of their copies

    def add_validated(self, k: int, delta: dict[str, torch.Tensor], num_samples: int = 1, *, client: str = "",
                      owned: bool = False) -> None:
        self._check_open()
        update_weight(self.weighting, num_samples)
        delta = delta if owned else {n: t.to(torch.float32, copy=True) for n, t in delta.items()}
        ratio = update_norm(delta) / max(self.weight_norm(k), 1e-12)
        i = self._row()
        self.own[i] = own = measure(delta)
        self.sizes.add(k, own)
        if self.streaming:
            self.references[i] = self.sizes.bounds(k, own)
        self.sketch.into(delta, self.sketches[i])
        self.ratio_of[i] = ratio
        bisect.insort(self._sorted, ratio)
        self.medians[i] = self.median_ratio()
        self.updates[k] += 1
        self.pending.append((Held(client, k, delta, num_samples), i, ratio))
        if self.count >= self.hold and (not self.streaming or len(self.pending) >= self.hold):
            self._judge_pending()

    def _server_sketch(self, step: Mapping[str, torch.Tensor] | None) -> np.ndarray | None:
        """The server's step sketched as the updates are, unit length; None without one (or where it is zero)."""
        if step is None or not self.sketch.size or not all(n in step for n in self.sketch.core):
            return None
        out = self.sketch(dict(step)).numpy().astype(np.float32)
        norm = float(np.linalg.norm(out))
        return out / norm if norm > 0 and math.isfinite(norm) else None

    def _along_server(self, h: Held, i: int) -> bool:
        """Whether update i points along the server's own step (a cosine above the spread; recorded): the vote may not
        drop it. On their shared core, updates of submodels far apart in size can point apart, and with three updates a
        round the two large ones outvoted an honest small one (docs/security.md, "The server's step as a veto")."""
        if self.server is None:
            return False
        cos = float(self.sketches[i] @ self.server) / max(float(self._norms()[i]), 1e-30)
        self.with_server[h.client] = round(cos, 4)
        return cos > self.spread

    @property
    def strongest(self) -> float:
        """The largest cosine between a sketch and one it was compared with on arrival."""
        self._score()
        return self._strongest

    @property
    def margin(self) -> float:
        """The least cosine that counts as pointing the same way."""
        return self._margin(self.strongest)

    def _margin(self, strongest: float) -> float:
        return max(0.0, min(self.spread, self.cfg.agree_of_strongest * strongest))

    def _score(self) -> None:
        """The arrival cosines of the sketches added since the last call, in one product of the recent rows with
        theirs: sketch i was compared on arrival with the `compare` before it."""
        first, n = self.scored, self.count
        if first == n:
            return
        lo = max(0, first - self.compare)
        sketches, norms = self.sketches, self._norms()
        cos = pairwise_cosines(sketches[lo:n], norms[lo:n], sketches[first:n], norms[first:n])
        for b, i in enumerate(range(first, n)):
            a = max(0, i - self.compare)
            mine = cos[a - lo:i - lo, b]
            if len(mine):
                self._strongest = max(self._strongest, float(mine.max()))
            self.arrivals[i] = (a, mine, self._strongest)
        self.scored = n

    def _norms(self) -> np.ndarray:
        """The sketches' norms, those of the sketches added since the last call in one batched call (a call per
        arrival would cost as much in dispatch as its norm's arithmetic)."""
        if self._normed < self.count:
            new = slice(self._normed, self.count)  # torch's norm (as the sketches' were always taken), on numpy's memory
            torch.linalg.vector_norm(torch.from_numpy(self.sketches[new]), dim=1, out=torch.from_numpy(self.norms[new]))
            self._normed = self.count
        return self.norms

    def _others(self, i: int) -> np.ndarray:
        """The indices of the sketches sketch i is compared with: the `compare` most recent, not itself."""
        n = self.count
        lo = max(0, n - self.compare - 1)
        lo += i < lo  # i is not among the most recent: the `compare` before the newest
        others = np.arange(lo, n)
        return others[others != i]

    def _row(self) -> int:
        """The index of a new sketch's row, the rows doubled when full."""
        if self.count == len(self.ratio_of):
            grow = max(1, self.count)
            self.sketches = np.concatenate([self.sketches, np.empty_like(self.sketches[:grow])])
            self.norms = np.concatenate([self.norms, np.empty_like(self.norms[:grow])])
            self.ratio_of = np.concatenate([self.ratio_of, np.empty(grow)])
        self.count += 1
        return self.count - 1

    def cosines(self, i: int, others: np.ndarray) -> np.ndarray:
        """Sketch i's cosines with `others` (ascending: a run of recent rows, less at most one): one product with
        the rows' span, a view (gathering 256 rows first copied 4 MiB per update, more than the product)."""
        if not len(others):
            return np.empty(0, dtype=np.float32)
        lo, hi = int(others[0]), int(others[-1]) + 1
        sketches, norms = self.sketches, self._norms()
        return pairwise_cosines(sketches[lo:hi], norms[lo:hi], sketches[i:i + 1], norms[i:i + 1])[others - lo, 0]

    def compared(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """The others sketch i is compared with now and its cosines with them: those of its arrival while it is the
        newest (one product, not two)."""
        if i == self.count - 1 and i in self.arrivals:
            a, cos, _ = self.arrivals[i]
            return np.arange(a, i), cos
        others = self._others(i)
        return others, self.cosines(i, others)

    def voter_limit(self) -> float:
        """The relative norm above which an update is outsized: it is clipped, and it does not vote."""
        return self.cfg.max_norm_ratio * self.median_ratio()

    def agrees(self, i: int, limit: float | None = None) -> float:
        """The share of the voters among the others sketch i is compared with whose cosine with it exceeds the
        margin. Voters are the updates within the size bound (`voter_limit`, given when judging many at once): one
        above it is already an outlier, and a large flip's chance cosine with one of two weakly aligned honest
        updates must not outvote the other (docs/security.md, "Robust aggregation over nested submodels")."""
        others, cos = self.compared(i)
        return self._share(self.ratio_of[others], cos, self.voter_limit() if limit is None else limit, self.margin)

    @staticmethod
    def _share(ratios: np.ndarray, cos: np.ndarray, limit: float, margin: float) -> float:
        """The share of the voters (relative norms `ratios` within `limit`) whose cosine `cos` exceeds `margin`
        (compared in float32, as the cosines are)."""
        voting = ratios <= limit
        return np.count_nonzero(cos[voting] > np.float32(margin)) / max(1, np.count_nonzero(voting))

    @property
    def ratios(self) -> list[float]:
        """The round's relative norms, in arrival order."""
        return self.ratio_of[:self.count].tolist()

    def median_ratio(self) -> float:
        """The median of the round's relative norms, the lower of the middle two for an even count (the median one
        is not clipped), infinite while there are too few for a centre."""
        n = len(self._sorted)
        return self._sorted[(n - 1) // 2] if n >= self.cfg.min_cover else math.inf

    def _short(self, pending: list[tuple[Held, int, float]], limit: float, n: int,
               share_of: Callable[[int, float], float]) -> tuple[set[int], bool]:
        """Sketch indices short of `min_agree`, and whether the vote drops them: only while at least `vote_quorum`
        of the round's voters (updates within the size bound `limit`) reach it. Honest updates can point apart
        (non-IID shards, submodels of different size compared on their shared core); then nobody has a majority,
        the vote has nothing to go by, and the size bound alone applies, at the median for the outsized updates it
        could not confirm. Outsized updates count for the quorum no more than they vote: else a few large flips
        among the first `hold` could keep the quorum short and the vote from acting on them (docs/security.md,
        "Robust aggregation over nested submodels")."""
        if n < self.cfg.min_cover or not self.sketch.size:
            return set(), False
        short = set()
        for h, i, ratio in pending:
            share = self.agreement[h.client] = round(share_of(i, limit), 4)
            if share < self.cfg.min_agree:
                short.add(i)
            if ratio <= limit:
                self.judged += 1
                self.agreed += share >= self.cfg.min_agree
        return short, self.agreed >= self.cfg.vote_quorum * self.judged - 1e-9

    def _judge_pending(self) -> None:
        """The held updates: the first `hold` together, each against all the others, with the round as it stands;
        later ones each as of its arrival."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        self._score()
        if not self.streaming:
            self.streaming = self.count >= self.hold
            self._judge(pending, self.count, self.median_ratio(), self.agrees)
            return
        for entry in pending:
            i = entry[1]
            a, cos, strongest = self.arrivals[i]
            self._judge([entry], i + 1, self.medians[i],
                        lambda _, limit: self._share(self.ratio_of[a:i], cos, limit, self._margin(strongest)))

    def _judge(self, pending: list[tuple[Held, int, float]], n: int, median_ratio: float,
               share_of: Callable[[int, float], float]) -> None:
        """Drop, clip or keep each of `pending`, with the round as it stood at its first `n` updates (median
        relative norm `median_ratio`)."""
        limit = self.cfg.max_norm_ratio * median_ratio
        short, vote = self._short(pending, limit, n, share_of)
        for h, i, ratio in pending:
            self.arrivals.pop(i, None)
            self.medians.pop(i, None)
            own = self.own.pop(i)
            references = self.references.pop(i, None) or self.sizes.bounds(h.k, own)
            if vote and i in short and not self._along_server(h, i):
                self.dropped[h.client] = "against_centre"
                continue
            factors = clip_factors(own, references, self.cfg.tensor_clip)
            if factors:
                self.tensors_clipped[h.client] = len(factors)
            # the whole-update clip measures and scales what the step bound does not judge alone (its thin copies)
            whole = {n: size for n, size in own.items()
                     if n not in self.sizes.per_submodel or math.isfinite(references[n])}
            norm = max(self.weight_norm(h.k), 1e-12)
            left = clipped_norm(whole, factors) / norm
            bound = limit
            if left > bound and i in short:  # outsized and unconfirmed: nothing speaks for more than the median
                bound = median_ratio
            if left > bound:
                self.clipped[h.client] = bound * norm / clipped_norm(whole, {})  # the tensors' clips included
                factors = {name: factors.get(name, 1.0) * bound / left for name in whole}
            for name, f in factors.items():
                h.delta[name].mul_(f)
            if self.cfg.tensor_noise > 0:
                add_noise(h.delta, references, self.cfg.tensor_noise, self.noise)
            self.copies.add(h.delta)
            self.inner.add_validated(h.k, h.delta, h.samples, client=h.client, owned=True)

    @property
    def held_bytes(self) -> int:
        return (self.inner.held_bytes + tensor_bytes(t for h, _, _ in self.pending for t in h.delta.values())
                + self.sketches[:self.count].nbytes + tensor_bytes(self.copies.held))

    def finalize(self, state: GlobalState) -> GlobalState:
        self._check_open()
        self._judge_pending()
        new = self.inner.finalize(state)
        self.trimmed = self.copies.apply(state, new)
        self.dropped = {**self.dropped, **self.inner.dropped}
        self._finalized = True
        return new

    def facts(self) -> dict[str, Any]:
        clipped = {c: round(f, 4) for c, f in sorted(self.clipped.items())}
        return {**self.inner.facts(), **super().facts(), **({"clipped_to_centre": clipped} if clipped else {}),
                **({"tensors_clipped": dict(sorted(self.tensors_clipped.items()))} if self.tensors_clipped else {}),
                **({"agreement": dict(sorted(self.agreement.items()))} if self.agreement else {}),
                **({"with_server": dict(sorted(self.with_server.items()))} if self.with_server else {}),
                **({"trimmed_elements": self.trimmed} if self.trimmed else {}),
                **({"rows_from_average": self.copies.from_average} if self.copies.from_average else {})}


class ScreenedSums(Screened):
    """The centre check in front of a Mergeable rule: what it keeps becomes the inner rule's sums, so it merges,
    ships its partial and takes DP noise as they do, once it has judged what it still holds."""

    def merge(self, other: Mergeable) -> None:
        self._judge_pending()
        self.copies.complete = False  # a partial carries no copies of the small tensors: the rule's average stands
        as_mergeable(self.inner).merge(other.inner if isinstance(other, Screened) else other)
        self.updates = [a + b for a, b in zip(self.updates, other.updates)]

    def add_noise(self, std: float, generator: torch.Generator) -> None:
        self._judge_pending()
        as_mergeable(self.inner).add_noise(std, generator)

    def partial(self) -> NeFedAvg:
        """Judge what is still held, then the inner rule's sums (a worker ships them)."""
        self._judge_pending()
        return as_mergeable(self.inner).partial()


def screened(inner: RoundAggregate, cfg: AggregationConfig, weight_norm: Callable[[int], float],
             assignments: Mapping[str, int], seed: int, sizes: TensorSizes,
             server_step: Mapping[str, torch.Tensor] | None = None) -> Screened:
    """The centre check in front of `inner`, Mergeable when `inner` is; `sizes`: the round's tensor sizes, judged
    against the history they were begun from; `server_step`: the server's own step of the last commit (None: none)."""
    cls = ScreenedSums if isinstance(inner, Mergeable) else Screened
    return cls(inner, cfg, weight_norm, assignments, seed, sizes, server_step)
