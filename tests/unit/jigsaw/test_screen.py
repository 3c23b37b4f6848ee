"""The sources' screen of returned module copies (nefl/jigsaw/screen.py): a return is judged by its change from
the copy sent out, per tensor, against the round's other returns or the module's history."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nefl.jigsaw.screen import ReturnScreen, ScreenConfig
from nefl.jigsaw.symbio import InProcessExchange, ModuleReturn, source_average

KEY = "c0.m1"


def sent(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"0.weight": torch.randn(8, 4, 3, 3, generator=g) * 0.3, "0.bias": torch.zeros(8),
            "1.weight": torch.ones(8), "1.bias": torch.zeros(8)}


def norm(state: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.pow(2).sum()) for t in state.values()))


def honest(base: dict[str, torch.Tensor], seed: int, scale: float = 0.1, common: dict | None = None) -> dict[str, torch.Tensor]:
    """A copy trained honestly: each tensor moved by `scale` x its norm (x the module's share for zero tensors),
    along a direction shared by the round's borrowers (`common`) plus its own noise."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for k, v in base.items():
        d = torch.randn(v.shape, generator=g) + (common[k] if common else 0)
        ref = float(v.norm()) or norm(base) * math.sqrt(v.numel() / sum(t.numel() for t in base.values()))
        out[k] = v + d * (scale * ref / float(d.norm()))
    return out


def direction(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {k: 2 * torch.randn(v.shape, generator=g) for k, v in base.items()}


def flip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: -3.5 * v for k, v in state.items()}


def stretch(base: dict[str, torch.Tensor], state: dict[str, torch.Tensor], times_norm: float = 4.5) -> dict[str, torch.Tensor]:
    """The change of `state` stretched to `times_norm` x the module's norm (under the old fixed 5 x bound)."""
    d = {k: state[k] - base[k] for k in base}
    f = times_norm * norm(base) / norm(d)
    return {k: base[k] + f * d[k] for k in base}


def change(new: dict[str, torch.Tensor], base: dict[str, torch.Tensor], name: str) -> float:
    return float((new[name] - base[name]).norm())


def test_honest_returns_pass_untouched_even_with_large_early_changes() -> None:
    s = sent()
    common = direction(s)
    for n in (1, 2, 5):  # below and above min_peers, no history: first round
        returns = [(False, honest(s, i, scale=0.4, common=common)) for i in range(n)]
        new, verdict = ReturnScreen().aggregate(KEY, s, returns)
        assert verdict.refused == {} and verdict.clipped == 0, (n, verdict)
        want = source_average([st for _, st in returns])
        assert all(torch.equal(new[k], want[k]) for k in s)


def test_a_sign_flipped_return_is_refused_with_many_peers_and_alone() -> None:
    s = sent()
    common = direction(s)
    good = [(False, honest(s, i, common=common)) for i in range(4)]
    for returns in (good + [(False, flip(good[0][1]))], [(True, good[0][1]), (False, flip(good[1][1]))]):
        new, verdict = ReturnScreen().aggregate(KEY, s, returns)
        assert verdict.refused == {"sign_flip": 1}
        want = source_average([st for _, st in returns[:-1]])
        assert all(torch.equal(new[k], want[k]) for k in s)


def test_a_return_scaled_under_the_old_bound_is_clipped_to_the_honest_size() -> None:
    s = sent()
    common = direction(s)
    good = [(False, honest(s, i, common=common)) for i in range(4)]
    big = stretch(s, honest(s, 9, common=common))
    assert norm({k: big[k] - s[k] for k in s}) < 5 * norm(s)  # the old refusal let it through
    screen = ReturnScreen()
    verdict = screen.judge(KEY, s, good + [(False, big)])
    assert verdict.refused == {} and verdict.clipped >= 1
    cut = verdict.states[-1]
    for k in s:
        peers = sorted(change(st, s, k) for _, st in good + [(False, big)])
        assert change(cut, s, k) <= screen.cfg.margin * peers[len(peers) // 2] * (1 + 1e-5)
    alone = ReturnScreen().judge(KEY, s, [(False, big)])  # no peers, no history: the floor
    assert alone.clipped >= 1 and all(change(alone.states[0], s, k) <= 0.5 * norm(s) for k in s)


def test_a_layer_local_poison_is_refused_or_clipped_while_its_other_tensors_are_honest() -> None:
    s = sent()
    common = direction(s)
    good = [(False, honest(s, i, common=common)) for i in range(4)]
    flipped = dict(honest(s, 9, common=common), **{"0.weight": -3.5 * honest(s, 9, common=common)["0.weight"]})
    assert ReturnScreen().judge(KEY, s, good + [(False, flipped)]).refused == {"sign_flip": 1}
    one = honest(s, 9, common=common)
    scaled = dict(one, **{"0.weight": s["0.weight"] + 40 * (one["0.weight"] - s["0.weight"])})
    verdict = ReturnScreen().judge(KEY, s, good + [(False, scaled)])
    assert verdict.refused == {} and verdict.clipped == 1
    assert all(torch.equal(verdict.states[-1][k], one[k]) for k in s if k != "0.weight")  # the honest tensors untouched


def test_a_change_opposite_to_the_majority_is_refused_where_there_are_peers() -> None:
    s = sent()
    common = direction(s)
    good = [(False, honest(s, i, scale=0.1, common=common)) for i in range(4)]
    against = {k: s[k] - (good[0][1][k] - s[k]) for k in s}  # small, same size as an honest one: only its direction lies
    assert ReturnScreen().judge(KEY, s, good + [(False, against)]).refused == {"opposite": 1}
    assert ReturnScreen().judge(KEY, s, good[:1] + [(False, against)]).refused == {}  # two returns: no majority


def test_the_source_own_return_always_counts() -> None:
    s = sent()
    own = flip(honest(s, 0))
    new, verdict = ReturnScreen().aggregate(KEY, s, [(True, own), (False, honest(s, 1)), (False, honest(s, 2))])
    assert verdict.refused == {} and len(verdict.states) == 3


def test_history_bounds_a_lone_return_after_the_first_rounds() -> None:
    screen, s = ReturnScreen(), sent()
    for r in range(3):
        s, _ = screen.aggregate(KEY, s, [(False, honest(s, r, scale=0.05))])
    _, verdict = ReturnScreen().aggregate(KEY, s, [(False, honest(s, 9, scale=0.3))])
    assert verdict.clipped == 0  # fresh: the floor lets 0.3 x through
    _, verdict = screen.aggregate(KEY, s, [(False, honest(s, 9, scale=0.3))])
    assert verdict.clipped > 0  # 6 x the module's past changes: above margin x its history


def test_a_lone_liar_cannot_raise_its_own_bound_round_after_round() -> None:
    """A module returned each round by its source and one borrower that stretches its change to 4.5 x the module's
    norm: the borrower's clipped change stays within margin x the source's own honest changes in every round (a
    bound taken from a history that held the clipped changes would grow by half each round), so the module moves
    per round at most (1 + margin) / 2 x an honest change."""
    screen, s = ReturnScreen(), sent()
    own_sizes: dict[str, list[float]] = {k: [] for k in s}
    for r in range(8):
        own = honest(s, r, scale=0.05)
        bad = stretch(s, honest(s, 100 + r, scale=0.05))
        new, verdict = screen.aggregate(KEY, s, [(True, own), (False, bad)])
        if r > 0 and "jump" not in verdict.refused:
            lied = {k: 2 * new[k] - own[k] for k in s}  # the average of two: what the liar's copy counted as
            for k in s:
                past = sorted(own_sizes[k])
                median = past[len(past) // 2] if len(past) % 2 else 0.5 * (past[len(past) // 2 - 1] + past[len(past) // 2])
                assert change(lied, s, k) <= screen.cfg.margin * median * (1 + 1e-4), (r, k)
        for k in s:
            own_sizes[k].append(change(own, s, k))
        s = new


def test_a_jump_far_above_the_module_history_keeps_the_previous_value() -> None:
    screen, s = ReturnScreen(ScreenConfig(margin=1e9)), sent()  # no clipping: the jump rule alone
    for r in range(3):
        s, _ = screen.aggregate(KEY, s, [(False, honest(s, r, scale=0.02))])
    new, verdict = screen.aggregate(KEY, s, [(True, honest(s, 5, scale=0.5))])
    assert verdict.refused == {"jump": 1} and all(torch.equal(new[k], s[k]) for k in s)


def test_the_in_process_exchange_screens_returns_when_the_round_closes() -> None:
    s = sent()
    common = direction(s)
    store = {KEY: {k: v.clone() for k, v in s.items()}}
    ex = InProcessExchange("fed", store, [[1, 2, 3, 4], [0], [0], [0], [0]], norm_bound=5.0, screen=ReturnScreen())
    copies = [honest(s, i, common=common) for i in range(3)] + [flip(honest(s, 3, common=common))]
    for c, state in enumerate(copies, start=1):
        ex.give_back(ModuleReturn(federation="fed", client=c, source=0, round=0, position=1, samples=10), state)
    assert ex.aggregate() == {KEY: 4}
    assert ex.rejected["sign_flip"] == 1
    want = source_average(copies[:3])
    assert all(torch.equal(store[KEY][k], want[k]) for k in s)


@settings(max_examples=40, deadline=None)
@given(peers=st.integers(0, 5), factor=st.floats(-50, 50, allow_nan=False), layer=st.booleans(), seed=st.integers(0, 50))
def test_whatever_one_borrower_returns_the_module_moves_no_further_than_the_honest_bound(
        peers: int, factor: float, layer: bool, seed: int) -> None:
    """One attacker's return = sent + factor x (an honest change), in one tensor or all: the averaged change of
    every tensor stays within margin x the honest size (the floor with few returns)."""
    s = sent(seed)
    common = direction(s)
    good = [(False, honest(s, i, common=common)) for i in range(peers)]
    one = honest(s, 99, common=common)
    bad = {k: s[k] + factor * (one[k] - s[k]) if (k == "0.weight" or not layer) else one[k] for k in s}
    screen = ReturnScreen()
    new, _ = screen.aggregate(KEY, s, good + [(False, bad)])
    total = math.sqrt(sum(t.numel() for t in s.values()))
    for k in s:
        honest_sizes = sorted(change(st, s, k) for _, st in good) or [0.0]
        share = 0.5 * max(float(s[k].norm()), norm(s) * math.sqrt(s[k].numel()) / total)
        bound = max(screen.cfg.margin * max(honest_sizes + [change(one, s, k)]), share)
        assert change(new, s, k) <= bound * (1 + 1e-4), (k, change(new, s, k), bound)
