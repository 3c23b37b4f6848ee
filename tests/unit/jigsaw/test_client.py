"""FedJigsaw's client and server steps as a library, the simulator's every method branch, device budgets and
method names: the client step touches other clients only through the four ModuleExchange calls, switches chains
only for a gain, refuses hostile advice, and every method of `aggregator jigsaw` runs on real data."""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from safetensors.torch import load_file

from nefl.jigsaw.sim import POLICY_FILE, JigsawConfig, JigsawResult, JigsawSimulator, device_budgets
from nefl.jigsaw.client import ClientSettings, JigsawClient, Loaders, StepResult, chain_keys, clearly_better
from nefl.nested.data import DATASETS, ArrayDataset
from nefl.jigsaw.coretune import CriticAdvice, PolicyReport, arch_features, co_training_credit, observation
from nefl.jigsaw.methods import METHODS, get_method
from nefl.jigsaw.policy import assemble, chain_log_prob, log_probs, tokens_for
from nefl.jigsaw.shards import ClientData, ClientShard, ShardSpec
from nefl.jigsaw.symbio import InProcessExchange, MetadataBroadcast, ModuleFetch, ModuleReturn
from nefl.jigsaw.zoo import ModuleMeta, base_for_budget, build_module, fixed_bytes, load_base, peak_bytes
from nefl.protocol.messages import MessageError
from nefl.nested.profile import METHOD_NAMES
from nefl.nested.state import module_state
from nefl.nested.train import TrainConfig, evaluate

torch.set_num_threads(1)
SETTINGS = ClientSettings("fed", max_blocks=7, batch_size=8, alpha=0.9, beta=0.1, gamma=0.95, tau=1.0, policy_lr=0.05,
                          execution_temperature=0.0, switch_cost=1.0, switch_patience=1, observation_decay=0.5, guard=False)
NAMES = ("cnn-2", "cnn-3", "cnn-4")


class RecordingExchange:
    """Only the ModuleExchange protocol, backed by a private in-process exchange: a client that reached for
    anything else (another client's store, metadata or policy) would fail with AttributeError."""

    def __init__(self, inner: InProcessExchange) -> None:
        self._inner = inner
        self.fetched: list[tuple[int, str]] = []
        self.returned: list[tuple[int, str, dict]] = []

    def broadcast(self, msg: MetadataBroadcast) -> None:
        self._inner.broadcast(msg)

    def catalogue(self, client: int) -> list[ModuleMeta]:
        return self._inner.catalogue(client)

    def fetch(self, req: ModuleFetch) -> dict[str, torch.Tensor]:
        self.fetched.append((req.client, f"c{req.source}.m{req.position}"))
        return self._inner.fetch(req)

    def give_back(self, msg: ModuleReturn, state: dict[str, torch.Tensor]) -> None:
        self.returned.append((msg.client, f"c{msg.source}.m{msg.position}", state))
        self._inner.give_back(msg, state)


def _federation(n: int = 3, assemble: bool = True) -> tuple[list[JigsawClient], RecordingExchange]:
    bases = [load_base(NAMES[c % 3]) for c in range(n)]
    torch.manual_seed(0)
    store = {m.key: module_state(build_module(m)) for c, b in enumerate(bases) for m in b.metas(c)}
    exchange = RecordingExchange(InProcessExchange("fed", store, [[j for j in range(n) if j != i] for i in range(n)]))
    budget = peak_bytes(load_base("cnn-6").metas(0), (1, 28, 28), 8)
    clients = [JigsawClient(c, b, budget, torch.rand(10), SETTINGS, seed=c, assemble=assemble) for c, b in enumerate(bases)]
    for cl in clients:
        cl.join(exchange)
    for cl in clients:
        cl.connect(exchange)
    return clients, exchange


def _loaders(seed: int) -> Loaders:
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(8, 1, 28, 28, generator=g), torch.randint(10, (8,), generator=g)) for _ in range(2)]
    return Loaders(batches, batches[:1])


def test_a_client_step_goes_through_the_exchange_and_returns_every_module_to_its_source() -> None:
    clients, exchange = _federation()
    probe = torch.randn(4, 1, 28, 28)
    res = clients[0].step(0, _loaders(0), exchange, TrainConfig(lr=0.05, batch_size=8), probe, explore=True)
    keys = chain_keys(res.chain)
    assert [k for c, k in exchange.fetched] == keys == [k for c, k, _ in exchange.returned]
    assert res.chain[-1].kind == "head"  # its own or a neighbour's
    assert {m.source for m in clients[0].zoo.modules} == {0, 1, 2}  # its candidates: its own and its neighbours' modules
    for (_, key, state), m in zip(exchange.returned, res.chain):
        assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in module_state(build_module(m)).items()}
    fixed = fixed_bytes((1, 28, 28), 8)
    assert res.cap == pytest.approx((peak_bytes(res.chain, (1, 28, 28), 8) - fixed) / (clients[0].budget - fixed))
    report = PolicyReport.from_json(res.report.to_json(), 1 << 20)  # what the server receives
    assert report.chain == [(m.source, m.position) for m in res.chain] and len(report.observations) == len(res.episode.steps)
    assert 0 <= report.accuracy <= 1 and math.isclose(sum(report.data_feature), 1.0, rel_tol=1e-5)
    out = clients[0].learn(res, None)
    assert out["exp"] == 0.0 and not out["critic_values"]


def test_a_client_switches_chains_only_for_a_gain_above_the_switch_cost_and_never_back() -> None:
    clients, _ = _federation()
    cl = clients[1]
    greedy = cl._choose(0, explore=False)[0]
    other = next(ep.metas for ep in (cl._choose(0, explore=True)[1] for _ in range(50)) if chain_keys(ep.metas) != chain_keys(greedy))
    tokens = tokens_for(cl.client, cl.log, 0)
    score = lambda chain: chain_log_prob(cl.agent.policy, cl.zoo, tokens, cl.data_feature, cl.budget, cl.client, chain)  # noqa: E731
    gain = score(greedy) - score(other)
    assert gain > 0
    for held, cost, keeps in ((0, gain + 1e-3, True), (0, gain - 1e-3, False), (0, math.inf, True),
                              (3, gain / 4 + 1e-3, True), (3, gain / 4 - 1e-3, False)):  # the cost grows with rounds held
        cl.settings, cl.chain, cl.held = replace(SETTINGS, switch_cost=cost), other, held
        assert chain_keys(cl._choose(0, explore=False)[0]) == chain_keys(other if keeps else greedy)
    cl.settings, cl.left = replace(SETTINGS, switch_cost=-math.inf), {tuple(chain_keys(greedy))}
    assert chain_keys(cl._choose(0, explore=False)[0]) == chain_keys(other)  # a chain once left is never taken again
    cl.settings, cl.left, cl.held = replace(SETTINGS, switch_cost=gain / 2 - 1e-3, switch_patience=3), set(), 1
    picks = [chain_keys(cl._choose(0, explore=False)[0]) for _ in range(3)]
    assert picks == [chain_keys(other), chain_keys(other), chain_keys(greedy)]  # the third round in a row switches
    cl.chain, cl.held, cl.pending = other, 2, (tuple(chain_keys(greedy)), 2)  # a round short of the cost starts over
    assert chain_keys(cl._choose(0, explore=False)[0]) == chain_keys(other) and cl.pending is None
    clients, exchange = _federation()
    cl = clients[1]
    cl.settings, cl.chain, cl.held = replace(SETTINGS, switch_cost=-math.inf), other, 4
    res = cl.step(1, _loaders(1), exchange, TrainConfig(lr=0.05, batch_size=8), torch.randn(4, 1, 28, 28), explore=False)
    assert res.changed and cl.left == {tuple(chain_keys(other))} and cl.held == 1  # the step keeps the books


def test_a_client_without_a_policy_trains_its_base_model_every_round() -> None:
    clients, exchange = _federation(assemble=False)
    for r in range(2):
        res = clients[2].step(r, _loaders(r), exchange, TrainConfig(lr=0.05, batch_size=8), torch.randn(4, 1, 28, 28), explore=False)
        assert chain_keys(res.chain) == [m.key for m in load_base("cnn-4").metas(2)] and not res.changed and res.report is None
    assert all(k.startswith("c2.") for _, k in exchange.fetched)


@functools.cache
def _stepped_client() -> tuple[JigsawClient, StepResult]:
    """Client 0 after a policy-phase step of round 3 (learning on it again and again is harmless)."""
    clients, exchange = _federation()
    res = clients[0].step(3, _loaders(1), exchange, TrainConfig(lr=0.05, batch_size=8), torch.randn(4, 1, 28, 28), explore=True)
    return clients[0], res


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_hostile_advice_is_refused_and_never_breaks_the_learning_step(data) -> None:
    """Advice from the wire: random bytes, mutated valid advice, advice for another client, round or episode."""
    client, res = _stepped_client()
    steps = len(res.episode.steps)
    valid = CriticAdvice(federation="fed", client=0, round=3, exp=0.1, values=[0.5] * steps).to_json()
    kind = data.draw(st.sampled_from(["bytes", "mutate", "fields"]))
    if kind == "bytes":
        payload = data.draw(st.binary(max_size=300))
    elif kind == "mutate":
        i = data.draw(st.integers(0, len(valid) - 1))
        payload = valid[:i] + data.draw(st.binary(min_size=1, max_size=8)) + valid[i + 1:]
    else:
        payload = CriticAdvice(federation="fed", client=data.draw(st.integers(0, 3)), round=data.draw(st.integers(0, 5)),
                               exp=data.draw(st.floats(-1, 1)), values=data.draw(st.none() | st.lists(
                                   st.floats(-10, 10), max_size=steps + 2))).to_json()
    try:
        advice = CriticAdvice.from_json(payload)
    except MessageError:
        return
    before = client.rejected
    out = client.learn(res, advice)
    fits = advice.client == 0 and advice.round == 3 and (advice.values is None or len(advice.values) == steps)
    assert client.rejected == before + (not fits) and math.isfinite(out["reward"])
    assert out["critic_values"] == (fits and advice.values is not None)


# -- budgets, base architectures, method names ---------------------------------------------------------

def test_each_device_gets_the_largest_base_model_its_budget_fits() -> None:
    bases = [load_base(n) for n in ("cnn-2", "cnn-3", "cnn-4", "cnn-6")]
    peaks = {b.name: peak_bytes(b.metas(0), b.input, 32) for b in bases}
    assert base_for_budget(bases, peaks["cnn-4"], 32).name == "cnn-4"
    assert base_for_budget(bases, peaks["cnn-6"] - 1, 32).name == "cnn-4"
    assert base_for_budget(bases, 1e12, 32).name == "cnn-6"
    with pytest.raises(ValueError, match="cnn-2, needs"):
        base_for_budget(bases, peaks["cnn-2"] - 1, 32)
    budgets = device_budgets(bases, 10, 32, 1.25, seed=3)
    fixed = fixed_bytes((1, 28, 28), 32)
    assert min(budgets) > peaks["cnn-2"] and max(budgets) < fixed + 1.25 * (peaks["cnn-6"] - fixed)
    assert sorted(budgets) == sorted(device_budgets(bases, 10, 32, 1.25, seed=4)) != budgets  # same spread, another order
    assert len({base_for_budget(bases, b, 32).name for b in budgets}) >= 3


def test_a_method_name_means_one_algorithm_across_commands() -> None:
    assert not set(METHODS) & set(METHOD_NAMES)
    with pytest.raises(ValueError, match="NeFL preset of `aggregator simulate`.*pt-heterofl"):
        get_method("heterofl")
    assert get_method("pt-fedrolex").rolling and not get_method("pt-heterofl").rolling


# -- every branch of the simulator, on real Fashion-MNIST -----------------------------------------------

@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_runs_its_phases_on_real_data(method: str) -> None:
    cfg = JigsawConfig(method=method, clients=3, rounds=2, policy_rounds=2, critic_warmup=1, max_samples_per_client=48,
                       test_per_client=30, val_samples=20, probe_samples=4, non_iid=1.0, eval_every=1)
    sim = JigsawSimulator(cfg)
    res = sim.run()
    m = get_method(method)
    phases = [r["phase"] for r in res.rounds]
    assert phases == (["policy"] * 2 if m.assemble else []) + ["train"] * 2
    assert all(0.0 <= a <= 1.0 for a in res.accuracy) and len(res.accuracy) == 3
    last = res.rounds[-1]
    assert len(last["peak_mib"]) == 3 and len(last["decision_seconds"]) == 3
    assert all(p * 2**20 <= b + 1 for p, b in zip(last["peak_mib"], sim.budgets))  # within each device's budget
    if m.family == "widths":
        assert last["widths"] == sim.fed.widths and "chain_changes" not in last
        return
    assert 0.0 <= last["chain_changes"] <= 1.0
    borrowed = any(not d.startswith(f"c{c}.") for c in range(3) for d in res.architectures[c])
    if not m.share:
        assert not borrowed
    if not m.assemble:
        chains = [[d.split(":")[0] for d in arch] for arch in res.architectures]
        if m.fixed == "base":
            assert chains[0] == [x.key for x in sim.bases[0].metas(0)]
        if m.fixed == "shared":  # the smallest base model, head included, for everyone
            assert chains[0] == chains[1] == chains[2] and len({k.split(".")[0] for k in chains[0]}) == 1
        if m.fixed == "shared-body":  # the same blocks for everyone, each client under its own head
            assert chains[0][:-1] == chains[1][:-1] == chains[2][:-1] and len({k.split(".")[0] for k in chains[0][:-1]}) == 1
            assert [chain[-1].split(".")[0] for chain in chains] == ["c0", "c1", "c2"]
        return
    policy_rows = res.rounds[:2]
    assert all(len(r["reward"]) == 3 for r in policy_rows)
    if m.coretune:  # the critic trains from the first round, its values count from the second
        assert [r["critic_warm"] for r in policy_rows] == [False, True]
    else:
        assert all("critic_loss" not in r for r in policy_rows)


@pytest.mark.parametrize("images", [450, 5])
def test_a_task_round_trains_on_full_batches_only_and_on_something_when_the_shard_is_small(images: int) -> None:
    """A last batch of 2 images (450 at batch 32) undid whole rounds in `make demo-fedjigsaw` (BatchNorm on 2
    images): every training batch is full when the shard holds one, and a shard smaller than a batch still trains."""
    info = DATASETS["fashion-mnist"]
    ds = ArrayDataset(torch.zeros(images, *info.shape, dtype=torch.uint8), torch.zeros(images, dtype=torch.long), info)
    idx = torch.arange(images)
    spec = ShardSpec(clients=1, seed=0, non_iid=0.1, max_samples_per_client=None, val_samples=1, test_per_client=1,
                     probe_samples=1, batch_size=32)
    shard = ClientShard(0, ClientData(idx, idx[:1], idx[:1], torch.ones(10)), ds, ds, spec)
    sizes = [len(y) for _, y in shard.task(3).train]
    assert sizes == ([32] * (images // 32) if images >= 32 else [images])


# -- Algorithm 2's schedule, the critic's inputs, shared heads and co-training ---------------------------

def test_the_critic_sees_only_what_existed_before_the_action() -> None:
    """h_t is the E_data the client had before the round and the tokens of the prefix it had assembled: the same
    whatever the round's training made of the chain and whatever it chose after step t; the new E_data (for
    Exp) becomes the next round's h_t."""
    reports = []
    for seed in (0, 1):  # the same chain, trained on different data: different models
        clients, exchange = _federation()
        before = clients[0].prior_feature.clone()
        res = clients[0].step(0, _loaders(seed), exchange, TrainConfig(lr=0.05, batch_size=8), torch.randn(4, 1, 28, 28),
                              explore=True)
        reports.append(res.report)
        for t, step in enumerate(res.episode.steps):
            prefix = [m for m in res.chain if m.kind != "head"][:t]
            assert step.state.shape[0] == len(prefix)  # only what was assembled before decision t
            assert res.report.observations[t] == pytest.approx(observation(before, step.state, SETTINGS.max_blocks).tolist())
        assert torch.allclose(clients[0].prior_feature, torch.tensor(res.report.data_feature))
    assert reports[0].chain == reports[1].chain and reports[0].observations == reports[1].observations
    assert reports[0].data_feature != reports[1].data_feature


def test_a_neighbours_head_can_be_chosen_and_is_scored_as_a_decision() -> None:
    clients, _ = _federation()  # CNN-2, 3, 4: every head reads the same 128 features
    cl = clients[0]
    tokens = tokens_for(cl.client, cl.log, 0)
    episodes = [assemble(cl.agent.policy, cl.zoo, tokens, cl.data_feature, cl.budget, 0, 1.0, cl.generator) for _ in range(60)]
    assert {ep.metas[-1].source for ep in episodes} == {0, 1, 2}
    for ep in episodes[:5]:
        assert len(ep.steps) == len(ep.metas) + 1  # blocks, STOP, the head
        want = float(log_probs(cl.agent.policy, ep).sum().detach())
        assert chain_log_prob(cl.agent.policy, cl.zoo, tokens, cl.data_feature, cl.budget, 0, ep.metas) == pytest.approx(want, abs=1e-4)


def test_the_co_training_credit_grows_with_overlap_and_with_scarce_data() -> None:
    chains = [[(0, 0), (0, 1)], [(0, 0), (0, 1)], [(2, 0), (2, 1)]]
    credit = co_training_credit(arch_features(chains), [40, 400, 40], weight=0.5, scarce_samples=100)
    assert credit[0] == pytest.approx(0.5 * 0.5)  # same chain as one of two others, full weight below 100 images
    assert credit[1] == pytest.approx(0.5 * 0.25 * 0.5)  # same overlap, 4x the scarce count: a quarter of it
    assert credit[2] == 0.0  # shares nothing
    assert co_training_credit(arch_features(chains), [40] * 3, weight=0.0, scarce_samples=100) == [0.0] * 3


def _small_sim(method: str, **kw) -> JigsawSimulator:
    cfg = {"clients": 3, "rounds": 1, "policy_rounds": 2, "critic_warmup": 1, "max_samples_per_client": 48,
           "test_per_client": 30, "val_samples": 30, "probe_samples": 16, "non_iid": 1.0, "eval_every": 1}
    return JigsawSimulator(JigsawConfig(method=method, **{**cfg, **kw}))


def test_the_policy_phase_trains_on_the_task_is_rewarded_on_held_out_task_data_and_keeps_the_modules() -> None:
    sim = _small_sim("fedjigsaw")
    fed = sim.fed
    asked = []
    task = sim.task_loaders
    sim.task_loaders = lambda c, r: asked.append((c, r)) or task(c, r)
    seen: list[StepResult] = []
    step = JigsawClient.step
    for cl in fed.clients:
        cl.step = lambda *a, _cl=cl, **k: seen.append(step(_cl, *a, **k)) or seen[-1]
    row = fed.policy_round(0, sim.train_cfg)
    assert asked == [(c, 0) for c in range(3)]  # every client trains on its task shard
    for c, res in enumerate(seen):
        val = sim.shards[c].task(0).val
        assert len(sim.data[c].val) == 30 and not set(sim.data[c].val.tolist()) & set(sim.data[c].train.tolist())
        assert res.accuracy == pytest.approx(evaluate(res.model, val)[0])  # scored on its held-out task images
        assert row["reward"][c] == pytest.approx(0.7 * res.accuracy + 0.3 * row["exp"][c] + 0.1 * res.cap + row["share"][c])
    store = {k: {n: v.clone() for n, v in st.items()} for k, st in fed.exchange.store.items()}
    fed.begin_model_training()
    assert all(torch.equal(store[k][n], v) for k, st in fed.exchange.store.items() for n, v in st.items())


def test_eq2_averages_every_copy_of_a_chain_all_clients_train() -> None:
    sim = _small_sim("shared-chain")
    fed = sim.fed
    copies: dict[str, list[dict]] = {}
    give_back = fed.exchange.give_back
    fed.exchange.give_back = lambda msg, st: copies.setdefault(f"c{msg.source}.m{msg.position}", []).append(st) or give_back(msg, st)
    row = fed.train_round(0, 0, sim.train_cfg, lambda c, m: None)
    chain = [m.key for m in fed.chain(0)]
    assert row["trainers_per_module"] == 3 and row["modules_co_trained"] == len(chain) == len(copies)
    for key in chain:
        assert len(copies[key]) == 3
        for name, value in fed.exchange.store[key].items():
            assert torch.allclose(value.float(), torch.stack([c[name].float() for c in copies[key]]).mean(0), atol=1e-6)


def test_e_data_reflects_each_clients_label_skew() -> None:
    """E_data, from the task-trained model on the shared probe images, is closer to the client's own label
    distribution than to any other client's: Exp sees data similarity (each client on a chain of its own choosing,
    without the common-chain prior: two rounds of one averaged chain leave every client's model close to the others')."""
    sim = _small_sim("fedjigsaw", local_epochs=3, non_iid=0.1, common_prior=0.0)
    for r in range(2):
        sim.fed.policy_round(r, sim.train_cfg)
    hist = torch.stack([d.histogram for d in sim.data])
    feats = torch.stack([cl.prior_feature for cl in sim.fed.clients])
    sim_matrix = torch.nn.functional.normalize(feats, dim=1) @ torch.nn.functional.normalize(hist, dim=1).T
    assert sim_matrix.argmax(1).tolist() == [0, 1, 2], sim_matrix


# -- the guard: a local path beside the chain, kept when the shared chain validates worse ------------------

@pytest.mark.parametrize("policy_rounds", [0, 2])
def test_the_local_path_is_local_only_training_bit_for_bit(policy_rounds: int) -> None:
    """With a policy phase or without, the guard's local path starts with model training from the base model's start
    and sees the batches a local-only client sees in each of its rounds, in the same order: the fallback is exactly
    what the client would have trained alone, round for round."""
    fed = _small_sim("fedjigsaw", policy_rounds=policy_rounds, rounds=2)
    alone = _small_sim("local-only", rounds=2)
    fed.run(), alone.run()
    for c in range(3):
        mine = fed.fed.clients[c].local
        assert mine is not None and alone.fed.clients[c].local is None  # no guard where nothing is shared
        theirs = {f"{j}.{k}": v for j, m in enumerate(alone.fed.chain(c)) for k, v in alone.fed.exchange.store[m.key].items()}
        assert set(mine) == set(theirs)
        assert all(torch.allclose(mine[k].float(), theirs[k].float(), atol=1e-6) for k in mine), c


def test_a_guarded_client_with_a_useless_chain_keeps_its_local_only_model() -> None:
    """A chain zeroed after the run (chance at best) is never kept: the client ends at its local-only model, and
    scores on its test set exactly what local-only training scores."""
    sim, alone = _small_sim("fedjigsaw", rounds=2), _small_sim("local-only", rounds=2)
    sim.run()
    alone_acc = alone.run().accuracy
    for c, (client, shard) in enumerate(zip(sim.fed.clients, sim.shards)):
        broken = sim.fed.model(c)
        for p in broken.parameters():
            p.data.zero_()
        kept = client.keep(broken, shard.val(), shard.own_train())
        assert client.kept_local and kept is not broken
        assert evaluate(kept, shard.local_test())[0] == alone_acc[c]


def test_the_guard_keeps_the_chain_only_when_it_validates_better_beyond_noise() -> None:
    sim = _small_sim("fedjigsaw", rounds=1)
    sim.run()
    client, shard = sim.fed.clients[0], sim.shards[0]
    same = client.local_model()  # a shared model that validates exactly as well: the local path keeps its place
    assert same is not None and client.keep(same, shard.val(), shard.own_train()) is not same and client.kept_local
    right, wrong = torch.ones(200, dtype=torch.bool), torch.zeros(200, dtype=torch.bool)
    assert not clearly_better(right, right, 1.0)  # a tie
    a, b = right.clone(), right.clone()
    a[:3], b[3:9] = False, False  # 6 wins against 3 losses: 3 < sqrt(9), chance
    assert not clearly_better(a, b, 1.0) and not clearly_better(b, a, 1.0)
    c = right.clone()
    c[:20] = False  # 20 wins, no loss: beyond sqrt(20)
    assert clearly_better(right, c, 1.0) and clearly_better(right, wrong, 1.0) and not clearly_better(wrong, right, 1.0)
    off = _small_sim("fedjigsaw", rounds=1, local_guard=False)
    assert all(cl.local is None and cl.local_model() is None for cl in off.fed.clients)


def _train_curves(result: JigsawResult) -> list[list[float]]:
    return [r["accuracy"] for r in result.rounds if r["phase"] == "train"]


def test_an_honest_run_does_not_fall_below_local_only() -> None:
    """Label-skewed clients (Dirichlet 0.1), chains decoded from an untrained policy: in every round every client
    scores at or above its local-only accuracy (its local path is that training, and a shared chain is kept only
    when it validates better), where without the guard clients fall far below it."""
    kw = {"non_iid": 0.1, "rounds": 2, "policy_rounds": 0, "test_per_client": 100, "val_samples": 60}
    alone = _train_curves(_small_sim("local-only", **kw).run())
    guarded = _train_curves(_small_sim("fedjigsaw", **kw).run())
    assert all(g >= a for gs, als in zip(guarded, alone) for g, a in zip(gs, als)), (guarded, alone)
    unguarded = _train_curves(_small_sim("fedjigsaw", local_guard=False, **kw).run())
    assert any(u < a - 0.1 for us, als in zip(unguarded, alone) for u, a in zip(us, als)), (unguarded, alone)


def test_policies_and_the_critic_are_checkpointed_and_a_zero_policy_lr_learns_nothing(tmp_path) -> None:
    learned = _small_sim("fedjigsaw", out=str(tmp_path / "learned"), rounds=1)
    frozen = _small_sim("fedjigsaw", out=str(tmp_path / "frozen"), rounds=1, policy_lr=0.0)
    start = {k: v.clone() for k, v in frozen.fed.policies().items()}
    assert start.keys() == learned.fed.policies().keys()
    assert any(k.startswith("critic/") for k in start) and {k.split("/")[0] for k in start} >= {"c0", "c1", "c2"}
    learned.run()
    assert [r["phase"] for r in frozen.run().rounds] == ["policy", "policy", "train"]
    saved = {name: load_file(tmp_path / name / "checkpoint" / POLICY_FILE) for name in ("learned", "frozen")}
    assert all(torch.equal(saved["learned"][k], v) for k, v in learned.fed.policies().items())
    clients = [k for k in start if not k.startswith("critic/")]
    assert all(torch.equal(saved["frozen"][k], start[k]) for k in clients)  # the policy phase ran; the policies stayed
    assert not all(torch.equal(saved["learned"][k], start[k]) for k in clients)  # same seed, learning moved them
