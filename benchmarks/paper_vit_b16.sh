#!/usr/bin/env bash
# The paper's pretrained-ViT protocol (NeFL, Table "NeFL with three submodels ... pre-trained with ImageNet-1k"):
# ViT-B/16 initialised from ImageNet-1k weights, 3 submodels gamma = 0.5 / 0.75 / 1 (profiles/vit-b16-cifar10-d.toml,
# the paper's NeFL-D block sets, and -w for widthwise scaling), 10 clients all participating every round,
# 100 rounds, E = 1, lr 0.03, CIFAR-10 (resized to 224x224 inside the model), IID and Dirichlet(0.5).
# The paper's figures to compare with (worst / avg top-1 %, the paper's, not measured here):
#   IID 93.02 / 95.95   non-IID 87.56 / 93.50
# Schedule: the paper's cosine decay with 500 warmup steps, per round here (a task carries one lr): about
# 156 steps a round (5,000 images per client / batch 32), so 500 steps = --warmup-rounds 3.
#
# Usage: WEIGHTS=vit_b_16.pth benchmarks/paper_vit_b16.sh [extra `aggregator simulate` options, e.g. --seed 1]
# Env: WEIGHTS (required: torchvision's vit_b_16 state dict, fetched on a connected machine, see
#      docs/architectures.md), AGGREGATOR (default: aggregator on PATH), OUT (default runs/paper-vit-b16),
#      DEVICE (default cuda; `aggregator simulate` stops with a one-line error if torch sees no GPU).
# Each run is 100 rounds x 10 clients x 1 epoch of ViT-B/16 at 224x224 (about 5,000 images per client):
# hours on one GPU. Results (metrics.jsonl every 10 rounds, the final checkpoint) land in $OUT/<ladder>-<setting>.
set -euo pipefail

: "${WEIGHTS:?set WEIGHTS to the torchvision vit_b_16 state dict (.pth or .safetensors), see docs/architectures.md}"
AGGREGATOR=${AGGREGATOR:-aggregator}
OUT=${OUT:-runs/paper-vit-b16}
DEVICE=${DEVICE:-cuda}

for ladder in d w; do
    for setting in iid dirichlet-0.5; do
        skew=()
        if [ "$setting" != iid ]; then skew=(--non-iid 0.5); fi
        "$AGGREGATOR" simulate --profile "vit-b16-cifar10-$ladder" --dataset cifar10 --init-from "$WEIGHTS" \
            --clients 10 --per-round 10 --rounds 100 --local-epochs 1 --batch-size 32 --lr 0.03 \
            --lr-schedule cosine --warmup-rounds 3 \
            --eval-every 10 --device "$DEVICE" --out "$OUT/$ladder-$setting" "${skew[@]}" "$@"
    done
done
