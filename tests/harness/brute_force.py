"""NeFedAvg element by element, straight from its definition, random updates for it, and the comparison of two
global states: the reference the aggregation tests hold the real implementations to."""

from __future__ import annotations

import itertools

import torch

from nefl.nested.state import GlobalState, Layout


def random_updates(layout: Layout, counts: list[int], gen: torch.Generator) -> list[tuple[int, dict, int]]:
    ups = []
    for k, c in enumerate(counts):
        for _ in range(c):
            delta = {n: torch.randn(s, generator=gen) for n, s in layout.upload_shapes(k).items()}
            ups.append((k, delta, int(torch.randint(1, 50, (1,), generator=gen))))
    return ups


def brute_force(layout: Layout, state: GlobalState, ups, weighting: str) -> GlobalState:
    """Element by element, straight from the definition (slow on purpose)."""
    new = state.clone()
    for n, old in state.consistent.items():
        out = new.consistent[n]
        for idx in itertools.product(*(range(d) for d in old.shape)):
            num = den = 0.0
            for k, delta, ns in ups:
                shape = layout.upload_shapes(k).get(n)
                if shape is not None and all(i < d for i, d in zip(idx, shape)):
                    w = ns if weighting == "samples" else 1.0
                    num += w * float(delta[n][idx])
                    den += w
            if den > 0:
                out[idx] = old[idx] + num / den
    for k in range(layout.num_submodels):
        mine = [(d, ns) for kk, d, ns in ups if kk == k]
        if not mine:
            continue
        ws = [ns if weighting == "samples" else 1.0 for _, ns in mine]
        for n in layout.upload_shapes(k):
            if n in layout.inconsistent:
                new.inconsistent[k][n] = state.inconsistent[k][n] + sum(w * d[n] for (d, _), w in zip(mine, ws)) / sum(ws)
    return new


def assert_state_close(a: GlobalState, b: GlobalState, atol: float = 1e-5) -> None:
    for n in a.consistent:
        torch.testing.assert_close(a.consistent[n], b.consistent[n], atol=atol, rtol=1e-5, msg=n)
    for k, (da, db) in enumerate(zip(a.inconsistent, b.inconsistent)):
        for n in da:
            torch.testing.assert_close(da[n], db[n], atol=atol, rtol=1e-5, msg=f"{k}:{n}")
