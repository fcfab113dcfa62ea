#!/usr/bin/env bash
# Throughput sweep of the fine-tune trainer (benchmarks/train/bench_train_throughput.py) on one GPU: SmolLM2-135M-shaped,
# random weights, lolcats, 4096-token sequences; the attention-transfer and LoRA stages of recipes/linearize.yaml
# at several batch sizes and options (rows with --profile also profile one step: its kernels by kind). Each configuration
# runs in its own process under `timeout` (an OOM or a crash ends only its own); configurations that would not finish
# before DEADLINE seconds are skipped. Run from the repository root:
#   LONGCTX_COMMIT=<commit> bash benchmarks/train/bench_train_throughput.sh OUT
# Writes OUT/finetune/train-throughput-<device>.json (every row), OUT/train-throughput/*.json (one per
# configuration) and OUT/train-throughput.log.
set -uo pipefail
OUT=${1:?usage: $0 OUT}
SEQ=${SEQ:-4096}
DEADLINE=${DEADLINE:-450}   # seconds for the whole sweep (a device call ends at 600)
STEPS=${STEPS:-5}
DEV=$(python3 -c 'from benchmarks.shared import device_token; print(device_token())')
W="$OUT/train-throughput" && mkdir -p "$W" "$OUT/finetune"
LOG="$OUT/train-throughput.log"
: > "$LOG"
start=$(date +%s)

# name | seconds | options   (most telling first: the deadline cuts from the end)
CONFIGS=(
  "transfer-b16|80|--stages transfer --batch 16 --profile"
  "transfer-b16-recompute-attention|60|--stages transfer --batch 16 --attention-checkpointing on"
  "lora-b16|90|--stages lora --batch 16 --profile"
  "transfer-b16-fp32-frozen|60|--stages transfer --batch 16 --frozen-dtype keep"
  "lora-b16-fp32-frozen|70|--stages lora --batch 16 --frozen-dtype keep"
  "transfer-b32|70|--stages transfer --batch 32"
  "lora-b8|70|--stages lora --batch 8"
  "lora-b16-gc|70|--stages lora --batch 16 --grad-checkpointing"
  "transfer-b64|80|--stages transfer --batch 64"
  "lora-b32-gc|80|--stages lora --batch 32 --grad-checkpointing"
  "transfer-b16-compile|150|--stages transfer --batch 16 --compile"
  "lora-b16-gc-compile|150|--stages lora --batch 16 --grad-checkpointing --compile"
  "lora-b8-model-loss|60|--stages lora --batch 8 --no-fused-loss"
)
rc=0
for c in "${CONFIGS[@]}"; do
  IFS='|' read -r name secs opts <<< "$c"
  left=$(( DEADLINE - ($(date +%s) - start) ))
  if [ "$left" -lt "$secs" ]; then
    echo "== $name: skipped ($left s left, needs $secs)" | tee -a "$LOG"
    continue
  fi
  echo "== $name: $opts" | tee -a "$LOG"
  # shellcheck disable=SC2086
  timeout "$secs" python3 -m benchmarks.train.bench_train_throughput --seq "$SEQ" --steps "$STEPS" $opts \
    --out "$W/$name.json" >> "$LOG" 2>&1
  r=$?
  if [ "$r" -ne 0 ]; then echo "== $name: exit $r" | tee -a "$LOG"; rc=1; else grep -h '^{' "$LOG" | tail -n 1 | cut -c1-400; fi
done
python3 -m benchmarks.train.bench_train_throughput --merge "$W" --out "$OUT/finetune/train-throughput-$DEV.json" >> "$LOG" 2>&1 || rc=1
echo "sweep: $(( $(date +%s) - start )) s"
exit $rc
