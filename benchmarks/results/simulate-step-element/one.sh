#!/bin/bash
# one.sh NAME SETTING(iid|dir) SEED STEP_ELEMENT(0|1) [ATTACK]
name=$1; setting=$2; seed=$3; se=$4; attack=$5
cd /work/wt-se
args=(--profile resnet8-fmnist-w --dataset fashion-mnist --clients 10 --per-round 10 --rounds 10 --seed $seed
      --max-samples-per-client 150 --batch-size 16 --eval-every 0 --final-eval-samples 1000 --threads 1 --out /tmp/se-sim/$name)
[ "$setting" = dir ] && args+=(--non-iid 0.5)
[ "$se" != 0 ] && args+=(--step-element $se)
[ -n "$attack" ] && args+=(--attack $attack --attackers 0.2)
start=$(date +%s); l0=$(cut -d' ' -f1 /proc/loadavg)
PYTHONPATH=$PWD OMP_NUM_THREADS=1 /work/main/.venv/bin/python -c 'from aggregator.cli import app; app()' simulate "${args[@]}" > /tmp/se-sim/$name.log 2>&1
rc=$?
echo "$name rc=$rc wall=$(( $(date +%s) - start )) load=$l0/$(cut -d' ' -f1 /proc/loadavg)" >> /tmp/se-sim/done.txt
