"""FedJigsaw's pieces: module zoo and valid actions, the pointer network, REINFORCE, source-based
aggregation, FedRolex window aggregation, budgets, the exchange messages and the critic."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nefl.cost import training_peak_bytes
from nefl.jigsaw.baselines import WIDTH_LEVELS, scaled_metas, submodel_windows, width_for_budget
from nefl.jigsaw.coretune import ServerCritic, exploration_bonus, observation
from nefl.jigsaw.policy import META_FEATURES, Agent, AttenAssemble, assemble, meta_features, returns
from nefl.jigsaw.symbio import InProcessExchange, MetadataBroadcast, ModuleFetch, ModuleReturn, neighbours, source_average
from nefl.jigsaw.zoo import (
    BASES_DIR, ArchError, ModuleMeta, Zoo, build_model, check_chain, list_bases, load_base, model_cost, parse_base, peak_bytes,
)
from nefl.messages import MessageError
from nefl.rolling import aggregate_windows, extract, extract_state, rolled_window
from nefl.state import load_module_state, module_state

MIB = 2**20
torch.set_num_threads(1)  # tiny tensors: threads only add contention on a shared machine


# -- base architectures and modules ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["cnn-2", "cnn-3", "cnn-4", "cnn-6", "vgg-11", "vgg-13", "vgg-16", "vgg-19"])
def test_base_architectures_build_and_their_cost_counts_the_real_parameters(name: str) -> None:
    base = load_base(name)
    metas = base.metas(3)
    model = build_model(metas)
    assert model(torch.zeros(2, *base.input)).shape == (2, base.classes)
    assert model_cost(metas).params == sum(p.numel() for p in model.parameters())
    assert all(m.source == 3 and m.position == p for p, m in enumerate(metas))
    convs = {"cnn-2": 2, "cnn-3": 3, "cnn-4": 4, "cnn-6": 6}.get(name)
    if convs:  # the paper's CNN-k: k conv blocks, then 2 FC layers
        assert [m.kind for m in metas] == ["conv"] * convs + ["fc", "head"]
    else:  # VGG-n: 5 stages whose conv counts add up to n - 3, then 2 FC layers
        assert sum(int(m.type.split("-")[1]) for m in metas if m.kind == "stage") == int(name.split("-")[1]) - 3


def test_vgg_full_widths_are_one_setting_away() -> None:
    assert {"vgg-11", "vgg-19", "cnn-6"} <= set(list_bases())
    full = parse_base((BASES_DIR / "vgg-16.toml").read_text().replace("width_scale = 0.125", "width_scale = 1.0"))
    assert [m.d_out[0] for m in full.metas(0)] == [64, 128, 256, 512, 512, 512, 10]


def test_a_broken_architecture_file_names_the_problem() -> None:
    with pytest.raises(ArchError, match="not a base architecture"):
        parse_base("name = 'x'\n")
    with pytest.raises(ArchError, match="no base architecture"):
        load_base("cnn-99")


def test_a_chain_with_mismatched_dims_is_refused() -> None:
    a, b = load_base("cnn-2").metas(0), load_base("cnn-4").metas(1)
    with pytest.raises(ValueError, match="expects"):
        check_chain([a[0], b[1], a[-1]])  # (32,14,14) into a block expecting (32,28,28)


# -- valid actions: property test over random zoos -------------------------------------------------------

def _random_zoo(draw_ints: list[int], source_count: int) -> list[ModuleMeta]:
    """A random zoo over a small dims lattice: conv blocks (optionally pooling), FC layers and heads."""
    it = iter(draw_ints)
    mods: list[ModuleMeta] = []
    chans, sizes, feats = (1, 4, 8), (8, 4, 2), (6, 12)  # about 20% of the zoos reach a head
    for pos in range(len(draw_ints) // 4):
        kind, a, b, src = next(it) % 3, next(it), next(it), next(it) % source_count
        if kind == 0:
            cin, h, pool = chans[a % 3], sizes[b % 2], (b // 2) % 2 == 1
            d_in, d_out, t = (cin, h, h), (chans[1 + (b // 4) % 2], h // 2 if pool else h, h // 2 if pool else h), "conv"
        elif kind == 1:
            d_in = (chans[1 + a % 2], sizes[a % 3], sizes[a % 3]) if b % 2 else (feats[a % 2], 1, 1)
            d_out, t = (feats[b % 2], 1, 1), "fc"
        else:
            d_in, d_out, t = (feats[a % 2], 1, 1), (10, 1, 1), "head"
        mods.append(ModuleMeta(source=src, position=pos, type=t, d_in=d_in, d_out=d_out))
    return mods


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 50), min_size=24, max_size=96), st.integers(1, 5), st.integers(1, 6),
       st.floats(0.0, 1.0), st.integers(0, 2**16))
def test_assembly_never_mismatches_dims_and_never_exceeds_the_budget(ints, sources, max_blocks, slack, seed) -> None:
    mods = _random_zoo(ints, sources)
    zoo = Zoo.build(mods, (1, 8, 8), 16, max_blocks)
    smallest = zoo.smallest_peak()
    policy = AttenAssemble(10)
    gen = torch.Generator().manual_seed(seed)
    if math.isinf(smallest):  # no chain from the input to a head: refused with the reason, never a broken model
        with pytest.raises(ValueError, match="no model fits"):
            assemble(policy, zoo, 0, torch.rand(10), 1e12, generator=gen)
        return
    budget = smallest + slack * 2 * MIB
    for _ in range(3):
        ep = assemble(policy, zoo, 0, torch.rand(10), budget, generator=gen)
        check_chain(ep.metas)
        assert ep.metas[0].d_in == (1, 8, 8)
        assert len(ep.metas) - 1 <= max_blocks
        assert peak_bytes(ep.metas, (1, 8, 8), 16) <= budget
        assert len(ep.steps) == len(ep.metas)  # one decision per block, plus STOP
    model = build_model(ep.metas)
    assert model(torch.zeros(1, 1, 8, 8)).shape == (1, 10)


def test_assembly_respects_a_memory_budget_and_refuses_one_nothing_fits() -> None:
    bases = [load_base(n) for n in ("cnn-2", "cnn-3", "cnn-4", "cnn-6")]
    mods = [m for c, b in enumerate(bases) for m in b.metas(c)]
    zoo = Zoo.build(mods, (1, 28, 28), 32, 7)
    policy = AttenAssemble(10)
    gen = torch.Generator().manual_seed(0)
    for budget in (zoo.smallest_peak(), zoo.smallest_peak() + 2 * MIB, peak_bytes(bases[0].metas(0), (1, 28, 28), 32)):
        for _ in range(10):
            ep = assemble(policy, zoo, 0, torch.rand(10), budget, generator=gen)
            assert peak_bytes(ep.metas, (1, 28, 28), 32) <= budget
    with pytest.raises(ValueError, match="no model fits a budget"):
        assemble(policy, zoo, 0, torch.rand(10), zoo.smallest_peak() - 1)


def test_the_peak_formula_is_the_device_cost_model() -> None:
    from edge_client.costmodel import estimate_peak
    from nefl.cost import submodel_cost
    from nefl.profile import load_profile
    from nefl.state import Layout

    layout = Layout.build(load_profile("resnet20-fmnist-w"))
    for k, spec in enumerate(layout.profile.submodels):
        c = submodel_cost(layout.profile, spec)
        assert estimate_peak(layout, k, 32) == training_peak_bytes(c.params, c.activations, 28 * 28, 32)
    base = load_base("cnn-2")
    c = model_cost(base.metas(0))
    exact = training_peak_bytes(c.params, c.activations, 784, 8)
    assert 0 <= peak_bytes(base.metas(0), base.input, 8) - exact <= len(base.metas(0))  # rounded up per module


# -- the pointer network ---------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(st.integers(1, 9), st.integers(0, 5), st.integers(0, 2**16))
def test_pointer_handles_any_number_of_candidates_and_masked_ones_do_not_count(k, n_state, seed) -> None:
    torch.manual_seed(seed)
    policy = AttenAssemble(10)
    data, state = torch.rand(10), torch.rand(n_state, META_FEATURES)
    cands = torch.rand(k, META_FEATURES)
    valid = torch.rand(k) < 0.6
    valid[torch.randint(k, (1,))] = True
    probs = policy.logits(data, state, cands, valid).softmax(0)
    assert probs.shape == (k,) and torch.allclose(probs.sum(), torch.tensor(1.0))
    assert bool((probs[~valid] == 0).all()) and bool((probs[valid] > 0).all())
    other = cands.clone()
    other[~valid] = torch.rand(int((~valid).sum()), META_FEATURES) * 5  # masked tokens: any content
    assert torch.allclose(policy.logits(data, state, other, valid).softmax(0), probs, atol=1e-6)
    with pytest.raises(ValueError, match="no valid action"):
        policy.logits(data, state, cands, torch.zeros(k, dtype=torch.bool))


def test_temperature_flattens_the_distribution() -> None:
    torch.manual_seed(0)
    policy = AttenAssemble(10)
    args = (torch.rand(10), torch.rand(2, META_FEATURES), torch.rand(6, META_FEATURES), torch.ones(6, dtype=torch.bool))
    sharp = policy.logits(*args).softmax(0)
    policy.tau = 50.0
    flat = policy.logits(*args).softmax(0)
    entropy = lambda p: float(-(p * p.log()).sum().detach())  # noqa: E731
    assert entropy(flat) > entropy(sharp)


def _toy_zoo() -> Zoo:
    """Two first blocks to choose from (A: 4 channels, B: 8), each with an FC + head of its own."""
    mods = [ModuleMeta(source=0, position=0, type="conv", d_in=(1, 8, 8), d_out=(4, 4, 4)),
            ModuleMeta(source=1, position=0, type="conv", d_in=(1, 8, 8), d_out=(8, 4, 4)),
            ModuleMeta(source=0, position=1, type="fc", d_in=(4, 4, 4), d_out=(6, 1, 1)),
            ModuleMeta(source=1, position=1, type="fc", d_in=(8, 4, 4), d_out=(6, 1, 1)),
            ModuleMeta(source=0, position=2, type="head", d_in=(6, 1, 1), d_out=(10, 1, 1))]
    return Zoo.build(mods, (1, 8, 8), 8, 2)


def test_reinforce_moves_probability_toward_the_rewarded_module() -> None:
    zoo, agent = _toy_zoo(), Agent(10, lr=0.05, seed=0)
    data = torch.rand(10)
    gen = torch.Generator().manual_seed(0)

    def p_neighbour_first() -> float:
        state, cands = torch.zeros(0, META_FEATURES), torch.tensor([meta_features(m, 0) for m in zoo.modules[:2]] + [meta_features(None, 0)])
        with torch.no_grad():
            return float(agent.policy.logits(data, state, cands, torch.tensor([True, True, False])).softmax(0)[1])

    before = p_neighbour_first()
    for _ in range(60):
        ep = assemble(agent.policy, zoo, 0, data, math.inf, generator=gen)
        agent.update(ep, 1.0 if ep.metas[0].source == 1 else 0.0)
    assert before < 0.8 < p_neighbour_first()


def test_returns_are_discounted_from_the_terminal_reward() -> None:
    assert returns(2.0, 3, 0.5) == [0.5, 1.0, 2.0]


# -- SymbioArchitect -------------------------------------------------------------------------------------

def test_topologies_are_symmetric_without_self_links() -> None:
    for topo in ("full", "ring", "random"):
        links = neighbours(7, topo, k=2, seed=3)
        assert all(i not in links[i] and all(i in links[j] for j in links[i]) for i in range(7))
    assert neighbours(5, "full")[0] == [1, 2, 3, 4] and neighbours(5, "ring")[0] == [1, 4]
    with pytest.raises(ValueError, match="topology"):
        neighbours(3, "star")  # type: ignore[arg-type]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(0, 2), min_size=0, max_size=12), st.integers(0, 2**16))
def test_source_based_aggregation_equals_a_brute_force_average(clients, borrows, seed) -> None:
    torch.manual_seed(seed)
    base = load_base("cnn-2")
    store = {m.key: {"w": torch.randn(3, 2), "b": torch.randn(4)} for c in range(clients) for m in base.metas(c)[:3]}
    original = {k: {n: t.clone() for n, t in v.items()} for k, v in store.items()}
    ex = InProcessExchange("fed", store)
    sent: dict[str, list[dict]] = {}
    for i, pos in enumerate(borrows):
        src, borrower = i % clients, (i * 7) % clients
        got = ex.fetch(ModuleFetch(federation="fed", client=borrower, source=src, round=0, position=pos))
        trained = {n: t + torch.randn_like(t) for n, t in got.items()}
        ex.give_back(ModuleReturn(federation="fed", client=borrower, source=src, round=0, position=pos, samples=5), trained)
        sent.setdefault(f"c{src}.m{pos}", []).append(trained)
    counts = ex.aggregate()
    assert counts == {k: len(v) for k, v in sent.items()}
    for key, st_ in store.items():
        for name, t in st_.items():
            copies = sent.get(key)
            for idx in itertools.product(*(range(d) for d in t.shape)):
                want = original[key][name][idx] if not copies else sum(c[name][idx] for c in copies) / len(copies)
                assert math.isclose(float(t[idx]), float(want), rel_tol=1e-5, abs_tol=1e-6)


def test_hostile_returns_are_refused_and_counted() -> None:
    store = {"c0.m0": {"w": torch.zeros(2, 2)}}
    ex = InProcessExchange("fed", store)
    hdr = ModuleReturn(federation="fed", client=1, source=0, round=0, position=0, samples=1)
    ex.give_back(hdr, {"w": torch.zeros(3, 2)})
    ex.give_back(hdr, {"w": torch.full((2, 2), float("nan"))})
    ex.give_back(hdr, {"w": torch.zeros(2, 2), "extra": torch.zeros(1)})
    with pytest.raises(MessageError, match="unknown_module"):
        ex.fetch(ModuleFetch(federation="fed", client=1, source=0, round=0, position=9))
    assert dict(ex.rejected) == {"shape_mismatch": 2, "non_finite": 1, "unknown_module": 1} and ex.aggregate() == {}
    assert torch.equal(store["c0.m0"]["w"], torch.zeros(2, 2))
    with pytest.raises(ValueError):
        source_average([])


def test_metadata_travels_as_a_validated_message_and_hostile_metadata_is_refused() -> None:
    metas = load_base("cnn-3").metas(2)
    msg = MetadataBroadcast(federation="fed", client=2, modules=metas)
    assert MetadataBroadcast.from_json(msg.to_json()).modules == metas
    bad = msg.to_json().replace(b'"d_in":[1,28,28]', b'"d_in":[1,28,-5]')
    with pytest.raises(MessageError):
        MetadataBroadcast.from_json(bad)
    with pytest.raises(MessageError):
        MetadataBroadcast.from_json(msg.to_json().replace(b'"type":"conv"', b'"type":"rm -rf"', 1))
    ex = InProcessExchange("fed", {})
    ex.broadcast(msg, fan_out=3)
    assert ex.metadata[2] == metas and ex.bytes["metadata"] == 3 * len(msg.to_json())


# -- FedRolex / HeteroFL windows ---------------------------------------------------------------------

def test_rolling_window_rolls_by_one_index_per_round() -> None:
    assert rolled_window(5, 3, 0).tolist() == [0, 1, 2]
    assert rolled_window(5, 3, 1).tolist() == [1, 2, 3]
    assert rolled_window(5, 3, 4).tolist() == [4, 0, 1]
    with pytest.raises(ValueError):
        rolled_window(3, 4, 0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 20), st.integers(1, 4), st.integers(0, 20), st.booleans()),
                min_size=0, max_size=5), st.integers(0, 2**16))
def test_window_aggregation_equals_a_brute_force_over_rolled_windows(clients, seed) -> None:
    torch.manual_seed(seed)
    shape = (6, 4, 3)
    old = {"w": torch.randn(shape), "b": torch.randn(6)}
    updates = []
    for keep0, off0, keep1, off1, full_last in clients:
        w0, w1 = rolled_window(6, keep0, off0), rolled_window(4, keep1, off1)
        windows = {"w": (w0, w1, None if full_last else rolled_window(3, 2, off0)), "b": (w0,)}
        values = {n: torch.randn(extract(old[n], windows[n]).shape) for n in old}
        updates.append((values, windows))
    new = aggregate_windows(old, updates)
    for name, t in old.items():
        for idx in itertools.product(*(range(d) for d in t.shape)):
            covered = []
            for values, windows in updates:
                win = [range(t.shape[d]) if w is None else w.tolist() for d, w in enumerate(windows[name])]
                if all(i in w for i, w in zip(idx, win)):
                    covered.append(float(values[name][tuple(w.index(i) for i, w in zip(idx, win))]))
            want = sum(covered) / len(covered) if covered else float(t[idx])
            assert math.isclose(float(new[name][idx]), want, rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.parametrize("gamma", WIDTH_LEVELS)
@pytest.mark.parametrize("offset", [0, 1, 37])
def test_submodel_windows_cut_a_trainable_submodel_out_of_the_global_model(gamma: float, offset: int) -> None:
    base = load_base("cnn-6")
    global_state = module_state(build_model(base.metas(0)))
    sub = build_model(scaled_metas(base, gamma))
    windows = submodel_windows(base, gamma, offset)
    assert set(windows) == set(module_state(sub))
    load_module_state(sub, extract_state(global_state, windows))  # every shape fits
    assert sub(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    if offset == 0:  # HeteroFL: the prefix, as NeFL's width slicing
        w = windows["0.0.weight"][0]
        assert w.tolist() == list(range(math.ceil(32 * gamma)))


def test_width_follows_the_device_budget() -> None:
    base = load_base("cnn-6")
    peak = lambda g: peak_bytes(scaled_metas(base, g), base.input, 32)  # noqa: E731
    assert width_for_budget(base, peak(1.0), 32) == 1.0
    assert width_for_budget(base, peak(0.5) + 1, 32) == 0.5
    assert width_for_budget(base, 0, 32) == min(WIDTH_LEVELS)


# -- CoRe-Tune -------------------------------------------------------------------------------------------

def test_exploration_bonus_matches_the_papers_formula() -> None:
    torch.manual_seed(0)
    data = [torch.rand(4) for _ in range(3)]
    arch = [torch.tensor([1.0, 0, 1, 0]), torch.tensor([1.0, 1, 0, 0]), torch.tensor([1.0, 0, 1, 0])]
    cos = lambda a, b: float(a @ b / (a.norm() * b.norm()))  # noqa: E731
    want = [sum(cos(data[i], data[j]) * (1 - cos(arch[i], arch[j])) for j in range(3) if j != i) / 2 for i in range(3)]
    assert exploration_bonus(data, arch) == pytest.approx(want, abs=1e-6)
    assert exploration_bonus(data[:1], arch[:1]) == [0.0]


def test_critic_handles_episodes_of_different_lengths_and_learns_their_returns() -> None:
    metas = load_base("cnn-4").metas(0)
    obs = [torch.stack([observation(torch.rand(10), metas[:t], 0, 6) for t in range(n)]) for n in (2, 5, 3)]
    targets = [[0.2] * 2, [0.9] * 5, [0.5] * 3]
    critic = ServerCritic(obs[0].shape[1], lr=1e-2, seed=0)
    assert [len(v) for v in critic.values(obs)] == [2, 5, 3]
    first = critic.update(obs, targets)
    for _ in range(150):
        last = critic.update(obs, targets)
    assert last < first / 5
