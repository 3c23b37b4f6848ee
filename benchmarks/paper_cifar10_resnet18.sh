#!/usr/bin/env bash
# The paper's CIFAR-10 ResNet18 protocol (NeFL, Table "CIFAR-10, ResNet18, IID"), one run per method:
# 5 submodels gamma = 0.2..1.0 (profiles/resnet18-cifar10-wd.toml; each baseline derives its own ladder
# from those target sizes), 100 clients in five equal tiers, 10 per round, 500 rounds, E = 5, batch 32,
# SGD lr 0.1 without momentum or weight decay, lr x0.1 at 1/2 and 3/4 of the rounds, IID.
# The paper's figures to compare with (worst / avg top-1 %, the paper's, not measured here):
#   NeFL 86.86 / 87.88   FjORD 85.12 / 87.32   HeteroFL 80.62 / 84.26   DepthFL 64.80 / 82.44
#
# Usage: benchmarks/paper_cifar10_resnet18.sh [extra `aggregator simulate` options, e.g. --seed 1 or --non-iid 0.5]
# Env: AGGREGATOR (default: aggregator on PATH), OUT (default runs/paper-cifar10-resnet18),
#      DEVICE (default cuda; `aggregator simulate` stops with a one-line error if torch sees no GPU).
# Needs torch with CUDA. CIFAR-10 is downloaded by torchvision into the data root on first use (or pass
# --data-root to an existing copy). Each method is 500 rounds x 10 clients x 5 local epochs; results
# (metrics.jsonl with per-submodel accuracy every 50 rounds, the final checkpoint) land in $OUT/<method>.
set -euo pipefail

AGGREGATOR=${AGGREGATOR:-aggregator}
OUT=${OUT:-runs/paper-cifar10-resnet18}
DEVICE=${DEVICE:-cuda}

for method in nefl fjord heterofl depthfl; do
    "$AGGREGATOR" simulate --profile resnet18-cifar10-wd --dataset cifar10 \
        --clients 100 --per-round 10 --rounds 500 --local-epochs 5 --batch-size 32 --lr 0.1 \
        --method "$method" --eval-every 50 --device "$DEVICE" --out "$OUT/$method" "$@"
done
