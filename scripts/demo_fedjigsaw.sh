#!/usr/bin/env bash
# FedJigsaw on real processes: a coordinator (`aggregator jigsaw-serve`, with its embedded MQTT broker) and four
# devices (`edge-client jigsaw`) on Fashion-MNIST shards. Each device's memory budget gives it another base
# architecture; the devices assemble models from each other's modules, train them and return them to their
# sources. Then the same shards train alone (`aggregator jigsaw --method local-only`, the simulator, which an MQTT
# run reproduces: tests/test_jigsaw_mqtt.py) and each device's accuracy is printed against training alone.
#
#   scripts/demo_fedjigsaw.sh            (or: make demo-fedjigsaw)
#   ROUNDS=20 POLICY_ROUNDS=6 SAMPLES=1000 scripts/demo_fedjigsaw.sh     bigger run
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
ROUNDS=${ROUNDS:-6}
POLICY_ROUNDS=${POLICY_ROUNDS:-2}
SAMPLES=${SAMPLES:-500}          # task images per device
ARCHS=${ARCHS:-cnn-2,cnn-3,cnn-4,cnn-6}
OUT=${OUT:-runs/demo-fedjigsaw}
# shellcheck source=scripts/demo-common.sh
source scripts/demo-common.sh
COMMON=(--archs "$ARCHS" --rounds "$ROUNDS" --max-samples-per-client "$SAMPLES" --test-per-client 500 --proxy-samples 80)

echo "== coordinator (embedded broker on 127.0.0.1:$PORT): $POLICY_ROUNDS policy + $ROUNDS model-training rounds; logs in $OUT/logs"
aggregator jigsaw-serve --devices 4 --embedded-port "$PORT" --federation demo-jigsaw --policy-rounds "$POLICY_ROUNDS" \
    --critic-warmup 1 "${COMMON[@]}" --out "$OUT/mqtt" > >(tee "$OUT/logs/coordinator.log") 2>&1 &
COORD=$!
PIDS+=("$COORD")

# the simulator's budgets for 4 devices: each device's own budget picks its base architecture
BUDGETS=$("$PYTHON" -c "
from nefl.jigsaw.shards import device_budgets
from nefl.jigsaw.zoo import load_base
from nefl.jigsaw.sim import JigsawConfig as C
print(' '.join(str(int(b)) for b in device_budgets([load_base(a) for a in '$ARCHS'.split(',')], 4, C.batch_size, C.budget_headroom, C.seed)))")
i=0
for budget in $BUDGETS; do
    edge_client jigsaw --broker "mqtt://127.0.0.1:$PORT" --federation demo-jigsaw --client-id "device-$i" \
        --memory-budget "$budget" --threads 1 > "$OUT/logs/device-$i.log" 2>&1 &
    PIDS+=("$!")
    i=$((i + 1))
done
wait "$COORD"

echo "== the same four shards, each device training alone (the simulator's local-only)"
aggregator jigsaw --method local-only --clients 4 "${COMMON[@]}" --policy-rounds 0 --eval-every 0 --threads 1 \
    --out "$OUT/alone" > "$OUT/logs/alone.log" 2>&1

"$PYTHON" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
mqtt = json.loads((out / "mqtt" / "final.json").read_text())["accuracy"]
alone = [json.loads(l) for l in (out / "alone" / "metrics.jsonl").read_text().splitlines()][-1]["accuracy"]
rows = [json.loads(l) for l in (out / "mqtt" / "metrics.jsonl").read_text().splitlines()]
train = [r for r in rows if r["phase"] == "train"]
print(f"{'device':<10} {'FedJigsaw over MQTT':>20} {'training alone':>15}")
for i, a in enumerate(alone):
    got = mqtt.get(f"device-{i}")
    print(f"device-{i:<3} {('%.2f%%' % (100 * got)) if got is not None else 'n/a':>20} {100 * a:>14.2f}%")
moved = sum(r["bytes_per_device"] for r in train) / len(train)
whole = sum(r["whole_model_bytes_per_device"] for r in train) / len(train)
sent = sum(v for r in train for k, v in r["bytes"].items() if k.endswith("_out")) / len(train)
print(f"per model-training round: {moved / 1e3:.0f} kB sent and received by each device (modules it borrows and lends, "
      f"trained copies, fetches) against {whole / 1e3:.0f} kB to download and upload its whole model; "
      f"{sent / 1e3:.0f} kB crossed the broker in all against {len(alone) * whole / 1e3:.0f} kB of whole models")
PY
