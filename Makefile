# One entry point for people and CI: `make test` builds everything it needs on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
# Flower's pins (typer<0.21) cannot share an environment with the broker's (amqtt): its own venv
FLOWER_VENV ?= .venv-flower
FLOWER_PY := $(FLOWER_VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: env env-flower wheel system-deps test test-extended test-all test-under-load test-fast demo demo-fedjigsaw bench-systems bench-ingest bench-scale bench-observability bench-accuracy bench-fedjigsaw bench-robust bench-attacks-serve bench-control-plane bench-flower bench-sim lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[full,test,dp]'
	touch $@

env: $(VENV)/.installed  ## virtual environment with the full kit (torch 2.14.1 / torchvision 0.29.1) and the test tools

$(FLOWER_VENV)/.installed: pyproject.toml
	test -x $(FLOWER_PY) || python3 -m venv $(FLOWER_VENV)
	$(FLOWER_PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(FLOWER_PY) -m pip install -q -e '.[flower,test]'
	touch $@

env-flower: $(FLOWER_VENV)/.installed  ## .venv-flower: the kit's training side with Flower 1.42 and its simulation engine (docs/flower.md)

wheel: env  ## dist/nefl_edge-*.whl to copy to devices: `pip install` it there (small), or with [full] to train
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w dist .

system-deps:  ## Fashion-MNIST, mosquitto and chromium (dashboard browser test) from Debian (apt-get, as root)
	scripts/install-system-deps.sh

test: env env-flower system-deps  ## unit tests and a few end-to-end runs (about 12 minutes on 2 cores), then the Flower tests in .venv-flower (about 2 minutes)
	$(PY) -m pytest -q --durations=15 -m "not extended" $(PYTEST_ARGS)  # the slowest tests listed: the suite must stay fast
	$(FLOWER_PY) -c 'import flwr'  # tests/integration/test_flower.py skips without Flower; here it must run
	$(FLOWER_PY) -m pytest -q -rs tests/integration/test_flower.py $(PYTEST_ARGS)

test-extended: env system-deps  ## the longer end-to-end runs `make test` leaves out (about 16 minutes on 2 cores)
	$(PY) -m pytest -q --durations=15 -m extended $(PYTEST_ARGS)

test-all: test test-extended  ## everything: what CI runs (about 30 minutes on 2 cores)

test-under-load: env env-flower system-deps  ## `make test-all` with two busy-loop processes beside it: the suite must hold on a loaded machine
	scripts/with-busy-loops.sh $(MAKE) --no-print-directory test-all

test-fast: env  ## unit tests only (skips the end-to-end runs marked slow)
	@echo 'test-fast: deselecting tests marked slow (MQTT federations and attacks, wheel installs, long simulations and exports); `make test` runs a few of them, `make test-all` every one'
	$(PY) -m pytest -q -m "not slow" -rs $(PYTEST_ARGS)

demo: env system-deps  ## embedded broker + aggregator + 5 edge clients on Fashion-MNIST, then export + adaptive inference
	PYTHON=$(abspath $(PY)) scripts/demo.sh

demo-fedjigsaw: env system-deps  ## FedJigsaw over MQTT: coordinator + embedded broker + 4 devices on Fashion-MNIST shards, each device's accuracy against training alone
	PYTHON=$(abspath $(PY)) scripts/demo_fedjigsaw.sh

bench-systems: env system-deps  ## aggregation, client, wire, trust-check and inference costs against their baselines -> docs/benchmarks.md
	$(PY) benchmarks/bench_systems.py

bench-ingest: env system-deps  ## where a worker's CPU goes per MiB ingested (profile), MQTT clients' receive paths, hashes, a device's upload -> docs/benchmarks.md
	$(PY) -m pip install -q -e '.[full,test,dp,bench]'
	$(PY) benchmarks/bench_ingest.py

bench-scale: env system-deps  ## fleet load test: mosquitto + aggregator workers/relay + simulated devices -> docs/benchmarks.md, docs/img/scale.png
	$(PY) -m pip install -q -e '.[full,test,dp,bench]'
	$(PY) benchmarks/bench_scale.py

bench-observability: env system-deps  ## round time with and without --http, metrics/dashboard costs, dashboard screenshot -> docs/operations.md
	$(PY) benchmarks/bench_observability.py

bench-accuracy: env system-deps  ## NeFL vs FjORD/HeteroFL/DepthFL and ablations on Fashion-MNIST (about an hour), the same 8 methods at 60 rounds over 3 seeds (about 2 h), then ViT-tiny/MobileNetV2/ResNet-20 ladders (about 45 min); resumable -> docs/results.md
	$(PY) -m pip install -q -e '.[full,test,dp,bench]'
	$(PY) benchmarks/bench_accuracy.py
	$(PY) benchmarks/bench_accuracy.py --rounds 60 --seeds 3 --out benchmarks/results/accuracy-60r-3s --section long-3s
	$(PY) benchmarks/bench_accuracy.py --families

bench-sim: env system-deps  ## the simulator's rounds per second and time outside training: main's code vs this tree's one-by-one and --batch-clients paths on one seeded run (about 6 minutes on 2 cores; DEVICE=cuda on a GPU), the paper protocol's estimated time -> docs/benchmarks.md
	$(PY) benchmarks/bench_sim.py --device $(or $(DEVICE),cpu)

bench-fedjigsaw: env system-deps  ## FedJigsaw vs local training, HeteroFL/FedRolex and its ablations on Fashion-MNIST: the small-data sweep (40 images a client, about an hour on 2 free cores), then the default budget (about 4 h), resumable -> docs/fedjigsaw.md
	$(PY) -m pip install -q -e '.[full,test,dp,bench]'
	$(PY) benchmarks/bench_fedjigsaw.py --small
	$(PY) benchmarks/bench_fedjigsaw.py

bench-robust: env system-deps  ## every aggregation rule against issue 20 and issue 41 poisoning attacks at 0-30% attackers, IID and Dir(0.5), seeds 0-2, and its cost -> docs/security.md
	$(PY) benchmarks/bench_robust.py

bench-attacks-serve: env system-deps  ## issue 20 and issue 41 attacks over `aggregator serve` with real processes on mosquitto -> docs/security.md
	$(PY) benchmarks/bench_attacks_serve.py

bench-control-plane: env system-deps  ## issue 21's control-plane attacks (forged workers, floods, replays) with real processes -> docs/security.md
	$(PY) benchmarks/bench_control_plane.py

bench-flower: env-flower system-deps  ## rounds per minute of 100 clients / 10 a round on `flwr run` (1, 2, 4 workers) against `aggregator simulate` -> docs/flower.md
	$(FLOWER_PY) benchmarks/bench_flower.py

lint: env  ## pyflakes-level checks (unused imports, undefined names) with ruff
	$(PY) -m ruff check --select F,E9 --line-length 130 nefl aggregator edge_client export tests benchmarks

clean:
	rm -rf $(VENV) $(FLOWER_VENV) runs .pytest_cache build dist
