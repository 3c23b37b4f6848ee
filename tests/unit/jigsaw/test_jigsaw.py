"""FedJigsaw's pieces: module zoo and valid actions, the pointer network, REINFORCE, source-based
aggregation, FedRolex window aggregation, budgets, the exchange messages and the critic."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nefl.nested.cost import training_peak_bytes
from nefl.jigsaw.baselines import WIDTH_LEVELS, scaled_metas, submodel_windows, width_for_budget
from nefl.jigsaw.coretune import CoReTune, PolicyReport, ServerCritic, exploration_bonus, observation
from nefl.jigsaw.observations import ObservationLog
from nefl.jigsaw.policy import (
    TOKEN_FEATURES, PolicyAgent, AttenAssemble, assemble, chain_log_prob, log_probs, returns, tokens_for,
)
from nefl.jigsaw.symbio import InProcessExchange, MetadataBroadcast, ModuleFetch, ModuleReturn, neighbours, source_average
from nefl.jigsaw.zoo import (
    BASES_DIR, ArchError, ModuleMeta, Zoo, build_model, check_chain, common_chain, list_bases, load_base, model_cost, parse_base,
    peak_bytes,
)
from nefl.protocol.messages import MessageError
from nefl.aggregation.rolling import aggregate_windows, extract, extract_state, rolled_window
from nefl.nested.state import load_module_state, module_state

MIB = 2**20
TOKENS = tokens_for(0, None, 0)  # client 0 before it has observed anything
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
            assemble(policy, zoo, TOKENS, torch.rand(10), 1e12, 0, generator=gen)
        return
    budget = smallest + slack * 2 * MIB
    for _ in range(3):
        ep = assemble(policy, zoo, TOKENS, torch.rand(10), budget, 0, generator=gen)
        check_chain(ep.metas)
        assert ep.metas[0].d_in == (1, 8, 8)
        assert len(ep.metas) - 1 <= max_blocks
        assert peak_bytes(ep.metas, (1, 8, 8), 16) <= budget
        several_heads = len(zoo.heads_for(ep.metas[-2].d_out)) > 1
        assert len(ep.steps) == len(ep.metas) + several_heads  # one decision per block, STOP, the head if there is a choice
        assert len({m.key for m in ep.metas[:-1]}) == len(ep.metas) - 1  # no module placed twice
    model = build_model(ep.metas)
    assert model(torch.zeros(1, 1, 8, 8)).shape == (1, 10)


LATTICE = [(1, 8, 8), (4, 8, 8), (4, 4, 4), (8, 4, 4), (6, 1, 1)]  # dims a dense random zoo's modules connect


def _dense_zoo(specs: list[tuple[int, int, int]]) -> list[ModuleMeta]:
    """Blocks from lattice dims i to j >= i (square ones included), a channel-reducing way back from (8,4,4) to
    (4,4,4) so chains can revisit dims, and heads on two of the dims: many chains."""
    mods = [ModuleMeta(source=9, position=0, type="head", d_in=LATTICE[-1], d_out=(10, 1, 1)),
            ModuleMeta(source=9, position=1, type="head", d_in=LATTICE[3], d_out=(10, 1, 1))]
    for pos, (i, j, src) in enumerate(specs, start=2):
        i, j = i % (len(LATTICE) - 1), j % len(LATTICE)
        j = j if (i, j) == (3, 2) else max(j, i + (i == 0))
        kind = "fc" if LATTICE[j][1] == 1 else "conv"
        mods.append(ModuleMeta(source=src % 3, position=pos, type=kind, d_in=LATTICE[i], d_out=LATTICE[j]))
    return mods


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9), st.integers(0, 2)), min_size=3, max_size=9),
       st.integers(1, 4), st.floats(0.0, 1.0), st.data())
def test_valid_actions_are_exactly_the_blocks_some_complete_chain_within_budget_starts_with(specs, max_blocks, slack, data) -> None:
    """Against brute force: every chain of distinct blocks (at most `max_blocks`) from the input to a head."""
    mods = _dense_zoo(specs)
    zoo = Zoo.build(mods, (1, 8, 8), 16, max_blocks)
    if math.isinf(zoo.smallest_peak()):
        return
    budget = zoo.smallest_peak() + slack * 0.05 * MIB
    blocks = [m for m in mods if m.kind != "head"]

    def chains(prefix: list[ModuleMeta]):
        current = prefix[-1].d_out if prefix else (1, 8, 8)
        head = (zoo.heads_for(current) or [None])[0]
        if prefix and head is not None and peak_bytes(prefix + [head], (1, 8, 8), 16) <= budget:
            yield prefix
        if len(prefix) < max_blocks:
            for m in blocks:
                if m.d_in == current and m not in prefix:
                    yield from chains(prefix + [m])

    complete = list(chains([]))
    prefix: list[ModuleMeta] = []
    while True:
        valid, stop = zoo.valid_actions(prefix, budget)
        n = len(prefix)
        want = {c[n].key for c in complete if len(c) > n and c[:n] == prefix}
        assert {zoo.modules[i].key for i in valid} == want
        assert stop == any(c == prefix for c in complete)
        if not valid:
            break
        prefix = prefix + [zoo.modules[data.draw(st.sampled_from(valid))]]


def test_a_block_is_not_offered_when_only_a_placed_module_could_complete_the_chain() -> None:
    m0 = ModuleMeta(source=0, position=0, type="conv", d_in=(1, 8, 8), d_out=(4, 4, 4))
    up = ModuleMeta(source=0, position=1, type="conv", d_in=(4, 4, 4), d_out=(8, 4, 4))
    back = ModuleMeta(source=1, position=0, type="conv", d_in=(8, 4, 4), d_out=(4, 4, 4))
    head = ModuleMeta(source=0, position=2, type="head", d_in=(8, 4, 4), d_out=(10, 1, 1))
    zoo = Zoo.build([m0, up, back, head], (1, 8, 8), 8, 4)
    valid, stop = zoo.valid_actions([m0, up], math.inf)
    assert valid == [] and stop  # `back` would need `up` a second time to reach the head


def test_assembly_respects_a_memory_budget_and_refuses_one_nothing_fits() -> None:
    bases = [load_base(n) for n in ("cnn-2", "cnn-3", "cnn-4", "cnn-6")]
    mods = [m for c, b in enumerate(bases) for m in b.metas(c)]
    zoo = Zoo.build(mods, (1, 28, 28), 32, 7)
    policy = AttenAssemble(10)
    gen = torch.Generator().manual_seed(0)
    for budget in (zoo.smallest_peak(), zoo.smallest_peak() + 2 * MIB, peak_bytes(bases[0].metas(0), (1, 28, 28), 32)):
        for _ in range(10):
            ep = assemble(policy, zoo, TOKENS, torch.rand(10), budget, 0, generator=gen)
            assert peak_bytes(ep.metas, (1, 28, 28), 32) <= budget
    with pytest.raises(ValueError, match="no model fits a budget"):
        assemble(policy, zoo, TOKENS, torch.rand(10), zoo.smallest_peak() - 1, 0)


def test_the_peak_formula_is_the_device_cost_model() -> None:
    from edge_client.costmodel import estimate_peak
    from nefl.nested.cost import submodel_cost
    from nefl.nested.profile import load_profile
    from nefl.nested.state import Layout

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
    data, state = torch.rand(10), torch.rand(n_state, TOKEN_FEATURES)
    cands = torch.rand(k, TOKEN_FEATURES)
    valid = torch.rand(k) < 0.6
    valid[torch.randint(k, (1,))] = True
    probs = policy.logits(data, state, cands, valid).softmax(0)
    assert probs.shape == (k,) and torch.allclose(probs.sum(), torch.tensor(1.0))
    assert bool((probs[~valid] == 0).all()) and bool((probs[valid] > 0).all())
    other = cands.clone()
    other[~valid] = torch.rand(int((~valid).sum()), TOKEN_FEATURES) * 5  # masked tokens: any content
    assert torch.allclose(policy.logits(data, state, other, valid).softmax(0), probs, atol=1e-6)
    with pytest.raises(ValueError, match="no valid action"):
        policy.logits(data, state, cands, torch.zeros(k, dtype=torch.bool))


def test_temperature_flattens_the_distribution() -> None:
    torch.manual_seed(0)
    policy = AttenAssemble(10)
    args = (torch.rand(10), torch.rand(2, TOKEN_FEATURES), torch.rand(6, TOKEN_FEATURES), torch.ones(6, dtype=torch.bool))
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
    zoo, agent = _toy_zoo(), PolicyAgent(10, lr=0.05, seed=0)
    data = torch.rand(10)
    gen = torch.Generator().manual_seed(0)

    def p_neighbour_first() -> float:
        state, cands = torch.zeros(0, TOKEN_FEATURES), torch.tensor([TOKENS(m) for m in zoo.modules[:2]] + [TOKENS(None)])
        with torch.no_grad():
            return float(agent.policy.logits(data, state, cands, torch.tensor([True, True, False])).softmax(0)[1])

    before = p_neighbour_first()
    for _ in range(60):
        ep = assemble(agent.policy, zoo, TOKENS, data, math.inf, 0, generator=gen)
        agent.update(ep, 1.0 if ep.metas[0].source == 1 else 0.0)
    assert before < 0.8 < p_neighbour_first()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["cnn-2", "cnn-3", "cnn-4", "cnn-6"]), st.integers(0, (1 << 20) - 1)),
                min_size=1, max_size=12),
       st.lists(st.tuples(st.integers(0, 200), st.sampled_from([0.0, 0.5, 1.0]), st.integers(0, 60)), max_size=20),
       st.integers(0, 1 << 20), st.integers(0, 80))
def test_distinct_modules_get_distinct_policy_inputs(clients, events, me, round_index) -> None:
    """Clients with the same base architecture announce modules equal in everything but their source; whatever
    the client has (or has not) observed of them, each module's token differs from every other's."""
    modules = list({m.key: m for name, src in clients for m in load_base(name).metas(src)}.values())
    log = ObservationLog()
    for i, acc, r in events:  # identical accuracies and rounds on purpose: observations alone cannot separate them
        log.record([modules[i % len(modules)].key], acc, r)
    tokens = tokens_for(me, log, round_index)
    inputs = {tuple(tokens(m)) for m in modules}
    assert len(inputs) == len(modules)
    assert tuple(tokens(None)) not in inputs and all(len(t) == TOKEN_FEATURES for t in inputs)


def test_observations_say_how_a_module_did_when_used_how_often_and_how_long_ago() -> None:
    log = ObservationLog(decay=0.5)
    assert log.features("c1.m0", 5) == [0.0, 0.0, 0.0, 1.0]  # never used
    log.record(["c1.m0", "c1.m0", "c2.m1"], 0.8, 3)  # used twice in one chain: one use
    log.record(["c1.m0"], 0.4, 4)
    acc, used, uses, age = log.features("c1.m0", 4)
    assert (acc, used, age) == (pytest.approx(0.0), 1.0, 0.0) and 0 < uses < 1  # 0.6: as typical (0.6)
    log.record(["c3.m0"], 0.2, 5)  # typical now 0.4
    assert log.features("c2.m1", 5)[0] == pytest.approx(0.8 - 0.4) and log.features("c3.m0", 5)[0] == pytest.approx(0.2 - 0.4)
    assert log.features("c1.m0", 5)[0] == pytest.approx(0.6 - 0.4)  # better than usual on any accuracy scale
    assert log.features("c2.m1", 10)[3] > log.features("c2.m1", 4)[3] > 0  # older, larger
    assert log.features("c1.m0", 4)[2] > log.features("c2.m1", 4)[2]  # used more often
    assert log.features("c9.m0", 4) == [0.0, 0.0, 0.0, 1.0]  # never used


def test_reinforce_learns_to_prefer_one_source_over_an_identical_module_of_another() -> None:
    """The defect the source-aware tokens fix: same type, dims and position, different source."""
    twin = dict(position=0, type="conv", d_in=(1, 8, 8), d_out=(4, 4, 4))
    mods = [ModuleMeta(source=1, **twin), ModuleMeta(source=2, **twin),
            ModuleMeta(source=0, position=1, type="fc", d_in=(4, 4, 4), d_out=(6, 1, 1)),
            ModuleMeta(source=0, position=2, type="head", d_in=(6, 1, 1), d_out=(10, 1, 1))]
    zoo, agent, data = Zoo.build(mods, (1, 8, 8), 8, 2), PolicyAgent(10, lr=0.05, seed=0), torch.rand(10)
    gen = torch.Generator().manual_seed(0)

    def p_source_2() -> float:
        cands = torch.tensor([TOKENS(m) for m in mods[:2]] + [TOKENS(None)])
        with torch.no_grad():
            return float(agent.policy.logits(data, torch.zeros(0, TOKEN_FEATURES), cands, torch.tensor([True, True, False])).softmax(0)[1])

    before = p_source_2()
    for _ in range(60):
        ep = assemble(agent.policy, zoo, TOKENS, data, math.inf, 0, generator=gen)
        agent.update(ep, 1.0 if ep.metas[0].source == 2 else 0.0)
    assert 0.2 < before < 0.8 < p_source_2()


def test_greedy_decoding_takes_the_argmax_and_chain_log_prob_scores_a_chain() -> None:
    bases = [load_base(n) for n in ("cnn-2", "cnn-3", "cnn-4", "cnn-6")]
    zoo = Zoo.build([m for c, b in enumerate(bases) for m in b.metas(c)], (1, 28, 28), 32, 7)
    budget = peak_bytes(bases[3].metas(3), (1, 28, 28), 32)
    policy, data, gen = AttenAssemble(10), torch.rand(10), torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    greedy = assemble(policy, zoo, TOKENS, data, budget, 0, temperature=0.0)
    assert greedy.metas == assemble(policy, zoo, TOKENS, data, budget, 0, temperature=0.0).metas
    with torch.no_grad():
        for s in greedy.steps:
            assert s.action == int(policy.logits(data, s.state, s.candidates, s.valid).argmax())
        for _ in range(5):
            ep = assemble(policy, zoo, TOKENS, data, budget, 0, generator=gen)
            assert chain_log_prob(policy, zoo, TOKENS, data, budget, 0, ep.metas) == pytest.approx(float(log_probs(policy, ep).sum()), abs=1e-5)
    too_big = bases[3].metas(3)  # CNN-6 does not fit CNN-2's budget
    assert chain_log_prob(policy, zoo, TOKENS, data, peak_bytes(bases[0].metas(0), (1, 28, 28), 32), 0, too_big) == -math.inf
    with pytest.raises(ValueError, match="temperature"):
        assemble(policy, zoo, TOKENS, data, budget, 0, temperature=-1.0)


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
    ex = InProcessExchange("fed", {}, links=[[2], [2], [0, 1, 3], [2]])
    ex.broadcast(msg)  # three clients have client 2 as a neighbour: three copies
    assert ex.metadata[2] == metas and ex.bytes["metadata"] == 3 * len(msg.to_json())
    assert ex.catalogue(0) == metas and ex.catalogue(2) == []  # what a client sees: its neighbours' announcements
    forged = MetadataBroadcast(federation="fed", client=3, modules=load_base("cnn-2").metas(0))
    ex.broadcast(forged)  # client 3 advertising client 0's modules: refused, counted
    assert 3 not in ex.metadata and ex.rejected["foreign_module"] == 1


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
    prefix = lambda t: torch.tensor([TOKENS(m) for m in metas[:t]]).reshape(t, TOKEN_FEATURES)  # noqa: E731
    obs = [torch.stack([observation(torch.rand(10), prefix(t), 6) for t in range(n)]) for n in (2, 5, 3)]
    targets = [[0.2] * 2, [0.9] * 5, [0.5] * 3]
    critic = ServerCritic(obs[0].shape[1], lr=1e-2, seed=0)
    assert [len(v) for v in critic.values(obs)] == [2, 5, 3]
    first = critic.update(obs, targets)
    for _ in range(150):
        last = critic.update(obs, targets)
    assert last < first / 5


def _report(client: int, r: int, steps: int, seed: int) -> PolicyReport:
    g = torch.Generator().manual_seed(seed)
    obs = torch.rand(steps, 10 + TOKEN_FEATURES + 1, generator=g)
    return PolicyReport(federation="fed", client=client, round=r, accuracy=float(torch.rand(1, generator=g)), cap=0.5, samples=40,
                        data_feature=torch.rand(10, generator=g).tolist(), chain=[(client, 0), ((client + 1) % 3, 1), (client, 2)],
                        observations=obs.tolist())


def test_coretune_withholds_its_values_until_warm_and_gives_the_papers_exp() -> None:
    server = CoReTune("fed", 10 + TOKEN_FEATURES + 1, alpha=0.7, beta=0.1, gamma=0.95, warmup_rounds=2, lr=1e-2, seed=0)
    reports = [_report(c, 0, 2 + c, c) for c in range(3)]
    errors = []
    for r in range(40):
        advice, stats = server.step(reports)
        assert [a.values is None for a in advice] == [r < 2] * 3 and stats["critic_warm"] == (r >= 2)
        errors.append(stats["critic_abs_error"])
    assert [len(a.values) for a in advice] == [2, 3, 4] and [a.client for a in advice] == [0, 1, 2]
    arch = [torch.tensor([float(k in r.chain) for k in sorted({k for x in reports for k in x.chain})]) for r in reports]
    want = exploration_bonus([torch.tensor(r.data_feature) for r in reports], arch)
    assert [a.exp for a in advice] == pytest.approx(want, abs=1e-6)
    assert errors[-1] < errors[0] / 3  # the critic learns the returns it is trained on


def test_the_common_chain_is_the_smallest_base_model_head_included() -> None:
    zoo = _toy_zoo()
    assert [m.key for m in zoo.common] == ["c0.m0", "c0.m1", "c0.m2"]
    bigger_first = [ModuleMeta(source=5, position=p, type=m.type, d_in=m.d_in, d_out=m.d_out) for p, m in enumerate(zoo.common)]
    assert [m.key for m in common_chain([*bigger_first, *zoo.modules], zoo.input, zoo.batch_size)] == \
        ["c0.m0", "c0.m1", "c0.m2"]  # a tie goes to the lowest source, whatever the order announced


def test_the_common_chain_prior_adds_its_bonus_to_the_common_step_only_and_nothing_without_it() -> None:
    torch.manual_seed(0)
    plain = AttenAssemble(10)
    torch.manual_seed(0)
    biased = AttenAssemble(10, prior=2.5)
    assert plain.prior is None and sum(p.numel() for p in biased.parameters()) == sum(p.numel() for p in plain.parameters()) + 1
    g = torch.Generator().manual_seed(3)
    data, state, cands = torch.rand(10, generator=g), torch.rand(2, TOKEN_FEATURES, generator=g), torch.rand(6, TOKEN_FEATURES, generator=g)
    valid = torch.tensor([True, True, False, True, True, True])
    common = torch.tensor([False, True, False, False, False, False])
    expected = plain.logits(data, state, cands, valid) + 2.5 * common.float()
    assert torch.equal(biased.logits(data, state, cands, valid, common), expected)
    assert torch.equal(biased.logits(data, state, cands, valid), plain.logits(data, state, cands, valid))


def test_an_untrained_policy_with_the_prior_decodes_the_common_chain_and_reinforce_can_unlearn_it() -> None:
    zoo, gen = _toy_zoo(), torch.Generator().manual_seed(0)
    data = torch.rand(10, generator=gen)
    for seed in range(4):
        agent = PolicyAgent(10, seed=seed, prior=20.0)
        assert assemble(agent.policy, zoo, TOKENS, data, math.inf, 0, temperature=0).metas == list(zoo.common)
    agent = PolicyAgent(10, lr=0.05, seed=0, prior=1.0)
    common_first = lambda: math.exp(chain_log_prob(agent.policy, zoo, TOKENS, data, math.inf, 0, list(zoo.common)))  # noqa: E731
    before = common_first()
    for _ in range(80):  # the neighbour's first block is what pays
        ep = assemble(agent.policy, zoo, TOKENS, data, math.inf, 0, temperature=1.0, generator=gen)
        agent.update(ep, 1.0 if ep.metas[0].source == 1 else 0.0)
    assert agent.policy.prior is not None and float(agent.policy.prior.detach()) < 1.0
    assert before > 0.6 and common_first() < 0.1
