#!/usr/bin/env bash
# Fine-tune SmolLM2-135M-Instruct patched with OVQ (recipes/ovq-finetune.yaml) on one GPU, every layer and the
# paper's hybrid (OVQ on even layers, sliding window 256 on odd ones), and evaluate before/after. Run from the
# repository root on the GPU machine, after the model is assembled at $MODEL (evals/README.md, "Running on a GPU"):
#   evals/device/ovq_smollm2.sh text    # training text -> $TEXT (evals/device/train_text.sh)
#   evals/device/ovq_smollm2.sh train   # both fine-tunes, concurrently -> $RUN/all, $RUN/hybrid (+ train JSONs in $OUT/finetune)
#   evals/device/ovq_smollm2.sh eval    # perplexity + NIAH: unpatched, sliding-window, ovq before and after
#   evals/device/ovq_smollm2.sh refs    # the hybrid again, and the references: the same LoRA fine-tune of the
#                                       # unpatched model and of sliding-window 256 (-> $RUN/{hybrid,lora-none,lora-sw256})
#   evals/device/ovq_smollm2.sh eval-refs  # perplexity + NIAH of those three
# Data: $DATA/train (training text) and $DATA/heldout (essays never trained on: haystack and perplexity text).
set -euo pipefail
STEP=${1:?usage: $0 text|train|eval|refs|eval-refs}
MODEL=${MODEL:-/tmp/smollm2.gguf}
DATA=${DATA:-.device-data}
RUN=${RUN:-/tmp/ovq}
OUT=${OUT:-evals/results}  # result JSONs go to $OUT/<task>/ as in evals/results (evals/README.md, results)
DEV=${DEV:-$(python3 -c 'from evals.shared import device_token; print(device_token())')}
. "$(dirname "$0")/train_text.sh"
CAL_MAX_S=${CAL_MAX_S:-45}
FT_STEPS=${FT_STEPS:-400}
FT_MAX_S=${FT_MAX_S:-240}
CONTEXTS=${CONTEXTS:-4k}
LENGTHS=${LENGTHS:-2k,4k}
DEPTHS=${DEPTHS:-0.25,0.5,0.75}
SAMPLES=${SAMPLES:-3}
EVAL_MAX_S=${EVAL_MAX_S:-480}

if [ "$STEP" = text ]; then  # built before the trainings start, so that concurrent runs share it
  build_train_text force
  exit 0
fi

if [ "$STEP" = train ]; then
  common=(--model "$MODEL" --text "$TEXT" -q
          --set stages.calibrate.max_time_s="$CAL_MAX_S" --set stages.calibrate.save_every=100000
          --set stages.finetune.steps="$FT_STEPS" --set stages.finetune.max_time_s="$FT_MAX_S"
          --set stages.finetune.eval_every=100 --set stages.finetune.save_every=100000)
  python3 -m cli.main finetune recipes/ovq-finetune.yaml "${common[@]}" --output "$RUN/all" \
    --results "$OUT/finetune/smollm2-135m-ovq-finetune-$DEV.json" > "$RUN-all.log" 2>&1 &
  p1=$!
  python3 -m cli.main finetune recipes/ovq-finetune.yaml "${common[@]}" --output "$RUN/hybrid" \
    "${OVQ_HYBRID[@]}" \
    --results "$OUT/finetune/smollm2-135m-ovq-finetune-hybrid-$DEV.json" > "$RUN-hybrid.log" 2>&1 &
  p2=$!
  rc=0
  wait $p1 || rc=1
  wait $p2 || rc=1
  tail -n 15 "$RUN-all.log" "$RUN-hybrid.log"
  exit $rc
fi

if [ "$STEP" = refs ]; then  # recipe as in the file (512-token chunks), three fine-tunes at once
  common=(--model "$MODEL" --text "$TEXT" -q
          --set stages.calibrate.max_time_s="$CAL_MAX_S" --set stages.calibrate.save_every=100000
          --set stages.finetune.steps="$FT_STEPS" --set stages.finetune.max_time_s="$FT_MAX_S"
          --set stages.finetune.eval_every=100 --set stages.finetune.save_every=100000)
  # the references: only the recipe's LoRA stage (same rank, lr, steps, data), no OVQ temperatures
  lora_only=(--set "$(lora_only_stage)" --set stages.finetune.steps="$FT_STEPS" --set stages.finetune.max_time_s="$FT_MAX_S"
             --set stages.finetune.eval_every=100 --set stages.finetune.save_every=100000)
  python3 -m cli.main finetune recipes/ovq-finetune.yaml "${common[@]}" --output "$RUN/hybrid" \
    "${OVQ_HYBRID[@]}" \
    --results "$OUT/finetune/smollm2-135m-ovq-finetune-hybrid-chunk512-$DEV.json" > "$RUN-hybrid.log" 2>&1 &
  p1=$!
  python3 -m cli.main finetune recipes/ovq-finetune.yaml --model "$MODEL" --text "$TEXT" -q --set method=none \
    --set 'method_config={}' "${lora_only[@]}" --output "$RUN/lora-none" \
    --results "$OUT/finetune/smollm2-135m-lora-unpatched-$DEV.json" > "$RUN-lora-none.log" 2>&1 &
  p2=$!
  python3 -m cli.main finetune recipes/ovq-finetune.yaml --model "$MODEL" --text "$TEXT" -q --set method=sliding-window \
    --set 'method_config={window: 256}' "${lora_only[@]}" --output "$RUN/lora-sw256" \
    --results "$OUT/finetune/smollm2-135m-lora-sw256-$DEV.json" > "$RUN-lora-sw256.log" 2>&1 &
  p3=$!
  rc=0
  for p in $p1 $p2 $p3; do wait "$p" || rc=1; done
  tail -n 6 "$RUN-hybrid.log" "$RUN-lora-none.log" "$RUN-lora-sw256.log"
  exit $rc
fi

# eval: each model in its own process with few CPU threads; the JSONs (in ppl/ and niah/, as in evals/results),
# logs and plots as one tar in $OUT
W=/tmp/ovq-eval && mkdir -p "$W/ppl" "$W/niah"
export OMP_NUM_THREADS=2
EP=(--no-progress --out-dir "$W/ppl")
EN=(--no-progress --out-dir "$W/niah")
pids=()
t() { timeout "$EVAL_MAX_S" "$@"; }
if [ "$STEP" = eval-refs ]; then
  VARIANTS="hybrid lora-none lora-sw256"
else
  VARIANTS="all hybrid"
  t python3 -m cli.main eval ppl --model "$MODEL" "${EP[@]}" --method none --method 'sliding-window(window=256)' --method ovq \
    --text "$DATA/heldout" --context "$CONTEXTS" --windows 4 \
    --name "smollm2-135m-ovq-before-$DEV" > "$W/ppl-ovq-before.log" 2>&1 &
  pids+=($!)
fi
for v in $VARIANTS; do
  t python3 -m cli.main eval ppl --model "$RUN/$v/model" "${EP[@]}" --method none --no-baseline --text "$DATA/heldout" \
    --context "$CONTEXTS" --windows 4 --name "smollm2-135m-ovq-finetuned-$v-$DEV" > "$W/ppl-ovq-finetuned-$v.log" 2>&1 &
  pids+=($!)
  t python3 -m cli.main eval niah --model "$RUN/$v/model" "${EN[@]}" --method none --tasks s-niah-1,s-niah-2 \
    --lengths "$LENGTHS" --depths "$DEPTHS" --samples "$SAMPLES" --haystack "$DATA/heldout" \
    --name "smollm2-135m-ovq-finetuned-$v-$DEV" > "$W/niah-ovq-finetuned-$v.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
mkdir -p "$OUT" && (cd "$W" && tar cf "$OUT/ovq-eval.tar" ./ppl ./niah ./*.log 2>/dev/null || true)
tail -n 8 "$W"/*.log
exit $rc
