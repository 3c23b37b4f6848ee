"""The optimisation attacks of Shejwalkar & Houmansadr (NDSS 2021, "Manipulating the Byzantine"): the poison is the
mean of the honest updates the attacker knows moved against a direction, `mean - gamma x p`, with gamma the largest
a criterion still accepts, found by binary search (`largest_gamma`).

min-max: the poison's largest distance to an honest update stays within the largest distance between two honest
updates; min-sum: the sum of its squared distances to the honest updates stays within the largest such sum of an
honest update. Both are agnostic of the rule; `adaptive` (nefl/aggregation/attacks.py) searches with the kit's own
screening as the criterion instead (nefl/aggregation/attack_oracle.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from nefl.support.settings import Direction

Delta = dict[str, torch.Tensor]

GAMMA_START = 1.0  # the search's first guess; it doubles or halves from here
GAMMA_CAP = 2.0**30  # a gamma accepted this far out is returned as is (the criterion does not bound it)
GAMMA_FLOOR = 2.0**-30  # nothing above this accepted: gamma 0, the honest mean itself


def flat(delta: Delta) -> torch.Tensor:
    """The update as one float32 vector, in its tensors' order."""
    return torch.cat([t.reshape(-1).float() for t in delta.values()])


def unflat(vector: torch.Tensor, like: Delta) -> Delta:
    """`vector` cut back into tensors of `like`'s names, shapes and dtypes."""
    out, at = {}, 0
    for name, t in like.items():
        out[name] = vector[at:at + t.numel()].reshape(t.shape).to(t.dtype)
        at += t.numel()
    return out


def direction(stack: torch.Tensor, kind: Direction) -> torch.Tensor:
    """The perturbation direction p from the honest updates (rows of `stack`): the poison is mean - gamma x p.
    std falls back to the unit mean where there is no spread (one known update)."""
    mean = stack.mean(0)
    if kind == "sign":
        return torch.sign(mean)
    if kind == "std" and len(stack) > 1:
        return stack.std(0, unbiased=False)
    return mean / mean.norm().clamp_min(1e-12)


def min_max_accepts(stack: torch.Tensor) -> Callable[[torch.Tensor], bool]:
    """min-max's criterion: the candidate's largest distance to an honest update is at most the honest maximum."""
    bound = float(torch.cdist(stack, stack).max())
    return lambda poison: float(torch.cdist(poison[None], stack).max()) <= bound


def min_sum_accepts(stack: torch.Tensor) -> Callable[[torch.Tensor], bool]:
    """min-sum's criterion: the candidate's sum of squared distances to the honest updates is at most the largest
    such sum of an honest update."""
    bound = float(torch.cdist(stack, stack).square().sum(1).max())
    return lambda poison: float(torch.cdist(poison[None], stack).square().sum()) <= bound


def largest_gamma(accepts: Callable[[float], bool], tolerance: float) -> float:
    """The largest gamma `accepts` takes, to `tolerance` (relative): the result is accepted (or 0) and
    result / (1 - tolerance) is not. The search doubles or halves from GAMMA_START until it brackets the edge,
    then bisects; `accepts` is taken to be monotone (true up to the edge, false beyond)."""
    g = GAMMA_START
    if accepts(g):
        while g < GAMMA_CAP and accepts(2 * g):
            g *= 2
        if g >= GAMMA_CAP:
            return g
        lo, hi = g, 2 * g
    else:
        while g > GAMMA_FLOOR and not accepts(g / 2):
            g /= 2
        if g <= GAMMA_FLOOR:
            return 0.0
        lo, hi = g / 2, g
    while hi - lo > tolerance * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if accepts(mid) else (lo, mid)
    return lo


def search_poison(honest: Sequence[Delta], kind: Direction, tolerance: float,
                  accepts: Callable[[torch.Tensor], bool]) -> tuple[Delta, float]:
    """mean - gamma x p over the honest updates, gamma the largest `accepts` takes (of the flat candidate), and gamma."""
    stack = torch.stack([flat(d) for d in honest])
    mean, p = stack.mean(0), direction(stack, kind)
    gamma = largest_gamma(lambda g: accepts(mean - g * p), tolerance)
    return unflat(mean - gamma * p, honest[0]), gamma
