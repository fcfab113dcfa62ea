#!/usr/bin/env bash
# Linearize SmolLM2-135M-Instruct on one GPU (recipes/linearize.yaml) and evaluate it. Two steps, run from the
# repository root on the GPU machine, after the model is assembled at $MODEL (see benchmarks/README.md, "Running on a GPU"):
#   benchmarks/train/linearize_smollm2.sh train   # attention transfer + LoRA -> $RUN, asset -> $RUN/asset
#   benchmarks/train/linearize_smollm2.sh eval    # NIAH + perplexity: unpatched, sliding-window, lolcats, lola
# Data (a git-ignored folder copied beside the repository): $DATA/train (essays + Shakespeare) and
# $DATA/heldout (essays never trained on: the NIAH haystack and the perplexity text); $STDLIB adds every
# other top-level module of the Python standard library to the training text.
set -euo pipefail
STEP=${1:?usage: $0 train|eval}
MODEL=${MODEL:-/tmp/smollm2.gguf}
DATA=${DATA:-.device-data}
RUN=${RUN:-/tmp/linearize}
OUT=${OUT:-benchmarks/results}  # result JSONs go to $OUT/<task>/ as in benchmarks/results (benchmarks/README.md, results)
NAME=${NAME:-smollm2-135m-linearize}  # the finetune record: $OUT/finetune/$NAME-<device>.json
DEV=${DEV:-$(python3 -c 'from benchmarks.shared import device_token; print(device_token())')}
. "$(dirname "$0")/train_text.sh"
TRANSFER_STEPS=${TRANSFER_STEPS:-1200}
LORA_STEPS=${LORA_STEPS:-600}
TRANSFER_MAX_S=${TRANSFER_MAX_S:-240}
LORA_MAX_S=${LORA_MAX_S:-150}
SAMPLES=${SAMPLES:-2}
LENGTHS=${LENGTHS:-1k,2k,4k,8k}
DEPTHS=${DEPTHS:-0,0.25,0.5,0.75,1}
CONTEXTS=${CONTEXTS:-2k,4k,8k}
TASKS=${TASKS:-s-niah-1,s-niah-2,mk-niah}
EVAL_MAX_S=${EVAL_MAX_S:-560}  # each evaluation process is stopped after this long (a device call ends at 600 s)
EXTRA=${EXTRA:-}  # more finetune options, e.g. --set stages.transfer.batch_size=2
export LONGCTX_ASSET_PATH=$RUN/assets

if [ "$STEP" = train ]; then
  build_train_text
  python3 -m longctx_patch.cli.main finetune recipes/linearize.yaml --model "$MODEL" --text "$TEXT" --output "$RUN" -q \
    --set stages.transfer.steps="$TRANSFER_STEPS" --set stages.transfer.max_time_s="$TRANSFER_MAX_S" \
    --set stages.transfer.eval_every=200 --set stages.transfer.save_every=100000 \
    --set stages.lora.steps="$LORA_STEPS" --set stages.lora.max_time_s="$LORA_MAX_S" \
    --set stages.lora.eval_every=200 --set stages.lora.save_every=100000 \
    --set output.lolcats_export=true --results "$OUT/finetune/$NAME-$DEV.json" $EXTRA
  write_run_asset "$RUN" "SmolLM2-135M-Instruct linearized with recipes/linearize.yaml"
  # the asset folder as one tar (a device call returns at most 8 files, none from deep folders)
  mkdir -p "$OUT" && (cd "$RUN"/assets && tar cf "$OUT/asset.tar" .)
  cp "$RUN"/trainable/lolcats/model.pt "$OUT/lolcats-model.pt" 2>/dev/null || true
  exit 0
fi

# eval: every method in its own process (the small model leaves the GPU idle between launches), each with
# few CPU threads (16 cores shared); results to a work folder, then the JSONs plus one tar of logs and plots
# to $OUT (a device call returns at most 8 files).
METHODS=(none 'sliding-window(window=256)' lolcats 'lola(window=64,sparse_cache=64)'
         'lola(window=128,sparse_cache=128)' 'lola(window=256,sparse_cache=256)')
W=/tmp/linearize-eval && mkdir -p "$W/niah" "$W/ppl"
export OMP_NUM_THREADS=2
M="--model $MODEL --no-progress"
pids=()
for meth in "${METHODS[@]}"; do
  tag=$(echo "$meth" | tr -c 'a-z0-9\n' '-' | sed 's/-*$//')
  timeout "$EVAL_MAX_S" python3 -m longctx_patch.cli.main eval niah $M --method "$meth" --tasks "$TASKS" --lengths "$LENGTHS" \
    --samples "$SAMPLES" --depths "$DEPTHS" --haystack "$DATA/heldout" --out-dir "$W/niah" \
    --name "smollm2-135m-linearized-$tag-$DEV" > "$W/niah-linearized-$tag.log" 2>&1 &
  pids+=($!)
done
ppl_methods=()
for meth in "${METHODS[@]}"; do ppl_methods+=(--method "$meth"); done
timeout "$EVAL_MAX_S" python3 -m longctx_patch.cli.main eval ppl $M "${ppl_methods[@]}" --text "$DATA/heldout" --context "$CONTEXTS" --windows 4 \
  --out-dir "$W/ppl" --name "smollm2-135m-linearized-$DEV" > "$W/ppl-linearized.log" 2>&1 &
pids+=($!)
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
mkdir -p "$OUT/niah" "$OUT/ppl" && (cd "$W" && tar cf "$OUT/linearize-eval-logs-plots.tar" ./*.log ./*/*.png 2>/dev/null
  cp niah/*.json "$OUT/niah/" 2>/dev/null; cp ppl/*.json "$OUT/ppl/" 2>/dev/null)
tail -n 12 "$W"/*.log
exit $rc
