"""Bounded updates, a commit check for the global state, and the DP-FedAvg privacy accountant.

Shape, dtype and finite checks do not stop a participant from uploading a finite delta of 1e30:
one such update spoils the global weights for good, and two of 3e38 overflow the NeFedAvg sum.
So every update's L2 norm is bounded per submodel before it is summed (UpdateGuard), and a
candidate global state is checked before it is committed (check_state). Clipping every update to
C and adding Gaussian noise to the sums (NeFedAvg.add_noise) is DP-FedAvg; DPAccountant says what
that costs in epsilon. The defaults come from the sweep in docs/security.md.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import torch

from nefl.nested.state import GlobalState, Layout
from nefl.nested.tensors import Tiled, l2_norm
from nefl.support.choices import check_choice
from nefl.support.settings import DEFAULT_ADAPTIVE_K, DEFAULT_MAX_ABS, DEFAULT_RELATIVE, DEFAULT_WARMUP, DEFAULT_WINDOW

REASON = "update_norm"
# reject: refuse an oversized update; clip: scale it down to the bound (DP-FedAvg's clipping)
GuardMode = Literal["reject", "clip"]
# pld: tight privacy-loss-distribution accounting; rdp: the classic Renyi-DP bound (looser)
AccountantMethod = Literal["pld", "rdp"]


class UpdateRejected(ValueError):
    """An update whose norm is out of bounds; `reason` is the counter the server logs it under."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.reason = REASON


def update_norm(delta: dict[str, torch.Tensor]) -> float:
    """Global L2 norm accumulated in float64: an fp32 sum of squares is already inf for one 3e38
    entry, which would make a finite update look non-finite and so impossible to clip.
    math.inf only for non-finite input (NaN included), so callers need a single comparison.
    An update decoded off the wire (nefl.protocol.wire.Tiled) is normed as its one flat buffer: one pass, not
    one per tensor (a resnet20 update has 116), and once: the bound and the centre check both ask, and
    the answer is kept with the buffer's version counter, so a write into the buffer recomputes it."""
    if not isinstance(delta, Tiled):
        return _finite_or_inf(math.hypot(*(l2_norm(t) for t in delta.values())))
    return _finite_or_inf(delta.norm())


def _finite_or_inf(total: float) -> float:
    return total if math.isfinite(total) else math.inf


def reference_norm(state: GlobalState, layout: Layout, k: int) -> float:
    """Norm of submodel k's current global weights over exactly the tensors it uploads, so the
    relative bound compares like with like; constant within a round, so computed once per submodel
    per round. One float64 dot product over the tensors laid end to end: a norm per tensor (116 in a
    resnet20 submodel, most too small for l2_norm's rows) is a call into torch each."""
    views = state.slices(layout, k)
    parts = [views[n].reshape(-1) for n in layout.upload_shapes(k)]
    flat = torch.cat(parts).double() if parts else torch.zeros(0, dtype=torch.float64)
    return _finite_or_inf(math.sqrt(float(torch.dot(flat, flat))))


def _positive(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number or None, got {value!r}")


@dataclass(frozen=True)
class NormBound:
    """Which bounds apply to an update's L2 norm; the tightest active one wins.

    max_norm: fixed (the operator's --max-update-norm). relative: a multiple of the norm of the
    submodel's current weights, scale-free, so it works out of the box for any model. adaptive_k: a
    multiple of the median of the latest kept norms of the submodel's `window` most recent clients (one
    vote per client), once `warmup` clients have one.
    mode "clip" scales an oversized update down to the bound instead of refusing it.
    """

    max_norm: float | None = None
    relative: float | None = DEFAULT_RELATIVE
    adaptive_k: float | None = DEFAULT_ADAPTIVE_K
    mode: GuardMode = "reject"
    window: int = DEFAULT_WINDOW
    warmup: int = DEFAULT_WARMUP

    def __post_init__(self) -> None:
        _positive("max_norm", self.max_norm)
        _positive("relative", self.relative)
        _positive("adaptive_k", self.adaptive_k)
        check_choice(GuardMode, self.mode, "update bound mode")
        if not 1 <= self.warmup <= self.window:
            raise ValueError(f"need 1 <= warmup <= window, got warmup {self.warmup}, window {self.window}")

    @classmethod
    def for_dp(cls, clip: float) -> NormBound:
        """DP-FedAvg clipping: every update scaled to norm <= clip. No adaptive bound: a threshold
        learnt from other clients' norms is data-dependent and would void the accountant's analysis."""
        return cls(max_norm=clip, relative=None, adaptive_k=None, mode="clip")


class UpdateGuard:
    """Applies a NormBound per submodel, keeping the history the adaptive bound needs.

    The history is one vote per client: each submodel remembers the latest kept norm of its `window`
    most recent clients, and the adaptive bound is k x the median over those clients. An attacker (one
    id) thus moves the median by at most one rank however often its updates are accepted, so it
    cannot ratchet the bound up round after round; only updates the round's rule kept are recorded."""

    def __init__(self, bound: NormBound, num_submodels: int) -> None:
        self.bound = bound
        self.history: list[OrderedDict[str, float]] = [OrderedDict() for _ in range(num_submodels)]
        self._medians: dict[int, float | None] = {}  # per submodel, until its history changes: asked once per update

    def median(self, k: int) -> float | None:
        """Median of submodel k's recent clients' norms; None until `warmup` clients have one."""
        if k not in self._medians:
            h = self.history[k]
            self._medians[k] = statistics.median(h.values()) if len(h) >= self.bound.warmup else None
        return self._medians[k]

    def limit(self, k: int, reference: float | None) -> tuple[float, str]:
        """The tightest active bound for submodel k and a short description of where it comes from."""
        b = self.bound
        limits = [(math.inf, "no bound")]
        if b.max_norm is not None:
            limits.append((b.max_norm, "the fixed bound"))
        if b.relative is not None:
            if reference is None or not (math.isfinite(reference) and reference > 0):
                raise ValueError(f"relative bound needs a positive weight norm, got {reference!r}: "
                                 "pass reference_norm(state, layout, k)")
            limits.append((b.relative * reference, f"{b.relative:g} x the weight norm {reference:.3g}"))
        median = self.median(k) if b.adaptive_k is not None else None
        if median is not None:
            limits.append((b.adaptive_k * median, f"{b.adaptive_k:g} x the median of recent clients' norms {median:.3g}"))
        return min(limits, key=lambda lim: lim[0])

    def check(self, k: int, delta: dict[str, torch.Tensor],
              reference: float | None = None) -> tuple[dict[str, torch.Tensor], float, bool]:
        """(delta to aggregate, its norm, whether it was clipped); raises UpdateRejected.

        The norm returned is that of the delta returned (the bound when clipped), so record(k, client, norm)
        never lets an outlier into the median the adaptive bound is built on."""
        norm = update_norm(delta)
        if norm == math.inf:
            raise UpdateRejected(f"submodel {k + 1}: update norm is not finite")
        bound, source = self.limit(k, reference)
        if norm <= bound:
            return delta, norm, False
        if self.bound.mode == "reject":
            raise UpdateRejected(f"submodel {k + 1}: update norm {norm:.3g} exceeds {bound:.3g} ({source})")
        scale = bound / norm  # may be far below fp32's normal range: scale in float64
        clipped = {n: t.to(torch.float64).mul_(scale).to(t.dtype) for n, t in delta.items()}
        return clipped, bound, True

    def record(self, k: int, client: str, norm: float) -> None:
        """Remember a kept update's norm as its client's latest (call once it is in the new state)."""
        if math.isfinite(norm) and norm >= 0:
            h = self.history[k]
            self._medians.pop(k, None)
            h.pop(client, None)
            h[client] = float(norm)
            while len(h) > self.bound.window:
                h.popitem(last=False)

    def recent(self, k: int) -> list[float]:
        """Submodel k's remembered norms, one per recent client (a worker's copy needs only these)."""
        return list(self.history[k].values())

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON types, so a resumed server keeps its adaptive bounds."""
        return {"norms": [list(h.values()) for h in self.history], "clients": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Also takes a history without client ids (a worker's plan, or a checkpoint from before votes were
        per client): each norm then counts as a client of its own."""
        norms = state.get("norms") if isinstance(state, dict) else None
        if not isinstance(norms, list) or len(norms) != len(self.history):
            got = len(norms) if isinstance(norms, list) else "no"
            raise ValueError(f"update-guard history has {got} submodels, the profile has {len(self.history)}: "
                             "resume with the profile the checkpoint was written with")
        clients = state.get("clients") or [[f"#{i}" for i in range(len(h) if isinstance(h, list) else 0)] for h in norms]
        history = []
        for k, (h, ids) in enumerate(zip(norms, clients)):
            if not isinstance(h, list) or not all(type(x) in (int, float) and math.isfinite(x) and x >= 0 for x in h) \
                    or not isinstance(ids, list) or len(ids) != len(h) or not all(isinstance(c, str) for c in ids):
                raise ValueError(f"update-guard history of submodel {k + 1} is not a list of finite norms per client: "
                                 "the checkpoint's guard state is corrupt")
            history.append(OrderedDict(list(zip(ids, (float(x) for x in h)))[-self.bound.window:]))
        self.history, self._medians = history, {}


def check_state(state: GlobalState, max_abs: float = DEFAULT_MAX_ABS) -> str | None:
    """Why a candidate global state must not be committed (first offending tensor), else None.

    Checked first over all tensors laid end to end (a copy of the state, cheaper than a call per tensor); only a
    state that fails is searched tensor by tensor for the one to name."""
    tensors = [*state.consistent.values(), *(t for d in state.inconsistent for t in d.values())]
    values = [t.reshape(-1) for t in tensors if t.numel()]
    if not values or _magnitude_problem(torch.cat(values), max_abs) is None:
        return None
    named = [(f"consistent {n}", t) for n, t in state.consistent.items()]
    named += [(f"submodel {k + 1} {n}", t) for k, d in enumerate(state.inconsistent) for n, t in d.items()]
    return next((f"{name}: {why}" for name, t in named if t.numel() and (why := _magnitude_problem(t, max_abs))), None)


def _magnitude_problem(t: torch.Tensor, max_abs: float) -> str | None:
    """One aminmax pass, no copy: NaN propagates into both results, inf shows in one, and max(|min|, |max|)
    is the largest magnitude."""
    lo, hi = (float(x) for x in torch.aminmax(t))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "non-finite values"
    peak = max(-lo, hi)
    return f"|w| reaches {peak:.3g}, above the bound {max_abs:g}" if peak > max_abs else None


class DPAccountant:
    """Epsilon spent by DP-FedAvg: each round is one Poisson-subsampled Gaussian event with
    q = clients_per_round / clients and noise std = noise_multiplier * clip on every group sum.
    PLD is the tighter accountant; RDP is the classic (looser) one, kept for comparison."""

    def __init__(self, noise_multiplier: float, sample_rate: float, delta: float,
                 method: AccountantMethod = "pld") -> None:
        _positive("noise_multiplier", noise_multiplier)
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1] (clients per round / clients), got {sample_rate!r}")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), typically below 1 / clients, got {delta!r}")
        check_choice(AccountantMethod, method, "privacy accountant")
        self.noise_multiplier, self.sample_rate, self.delta, self.method = noise_multiplier, sample_rate, delta, method

    def epsilon(self, rounds: int) -> float:
        """Epsilon after `rounds` rounds at this accountant's delta."""
        if rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {rounds}")
        if rounds == 0:
            return 0.0
        try:
            import dp_accounting
        except ImportError:
            raise ImportError("the privacy accountant needs dp-accounting: pip install 'nefl-edge[dp]'") from None
        accountant = dp_accounting.pld.PLDAccountant() if self.method == "pld" else dp_accounting.rdp.RdpAccountant()
        event = dp_accounting.PoissonSampledDpEvent(self.sample_rate, dp_accounting.GaussianDpEvent(self.noise_multiplier))
        accountant.compose(event, rounds)
        return float(accountant.get_epsilon(self.delta))
