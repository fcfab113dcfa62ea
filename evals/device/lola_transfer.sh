#!/usr/bin/env bash
# Attention transfer with LoLA's sparse cache in place, continuing the packaged linearized SmolLM2: the model is
# patched with `lola` (window $W, sparse cache $S) loading the packaged weights (feature maps, window factors, and
# its LoRA merged), and only the feature maps and window factors train, against exact softmax attention on the
# same q/k/v, at each learning rate of $LRS concurrently. Each run becomes an asset folder (its maps + the
# packaged LoRA adapter, unchanged) and is evaluated on NIAH and perplexity beside the packaged weights.
# Run from the repository root on the GPU machine, after the model is assembled at $MODEL (evals/README.md):
#   evals/device/lola_transfer.sh train   # -> $RUN/lr<LR>/ (finetune output + assets/), train JSONs in $OUT/finetune
#   evals/device/lola_transfer.sh eval    # NIAH + perplexity per run and for the packaged weights -> $OUT/{niah,ppl}/
# Data: $DATA/train (training text, see train_text.sh) and $DATA/heldout (haystack and perplexity text).
set -euo pipefail
STEP=${1:?usage: $0 train|eval}
MODEL=${MODEL:-/tmp/smollm2.gguf}
DATA=${DATA:-.device-data}
RUN=${RUN:-/tmp/lola-transfer}
OUT=${OUT:-evals/results}  # result JSONs go to $OUT/<task>/ as in evals/results (evals/README.md, results)
DEV=${DEV:-$(python3 -c 'from evals.shared import device_token; print(device_token())')}
. "$(dirname "$0")/train_text.sh"
W=${W:-256}
S=${S:-256}
CHUNK=${CHUNK:-64}  # the eviction chunk while training (the inference default). The run of 2026-11-30 used 256 and
# backend=torch: then training went through the PyTorch chunk loop (15.5 s a step at 2 x 4096 with 64-token chunks)
# and `auto` wrongly took the Triton kernels; lola now trains through its sparse sets (kernels/lola/training.py)
LRS=${LRS:-3e-3 1e-2}
STEPS=${STEPS:-400}
MAX_S=${MAX_S:-270}
SEQ=${SEQ:-4096}
BATCH=${BATCH:-2}
TASKS=${TASKS:-s-niah-1,s-niah-2}
LENGTHS=${LENGTHS:-2k,4k}
DEPTHS=${DEPTHS:-0.25,0.5,0.75}
SAMPLES=${SAMPLES:-3}
CONTEXT=${CONTEXT:-4k}
WINDOWS=${WINDOWS:-4}
EVAL_MAX_S=${EVAL_MAX_S:-240}
PACKAGED=longctx_patch/assets/smollm2-135m-instruct-lolcats
unset LONGCTX_ASSET_PATH  # checkpoint=auto must find the packaged weights while training

if [ "$STEP" = train ]; then
  build_train_text
  pids=()
  for lr in $LRS; do
    stage="{name: transfer, objective: attention_transfer, trainable: [method], lr: $lr, weight_decay: 0.0,
            steps: $STEPS, max_time_s: $MAX_S, batch_size: $BATCH, seq_len: $SEQ, warmup: 20, schedule: cosine,
            min_lr_ratio: 0.1, max_grad_norm: 1.0, log_every: 10, eval_every: 100, eval_batches: 4,
            save_every: 100000}"
    python3 -m cli.main finetune recipes/linearize.yaml --model "$MODEL" --text "$TEXT" --output "$RUN/lr$lr" -q \
      --set method=lola --set method_config.checkpoint=auto --set method_config.window="$W" \
      --set method_config.sparse_cache="$S" --set method_config.chunk="$CHUNK" --set "stages=[$stage]" \
      --results "$OUT/finetune/smollm2-135m-lola-transfer-lr$lr-$DEV.json" > "$RUN-lr$lr.log" 2>&1 &
    pids+=($!)
  done
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  for lr in $LRS; do
    tail -n 6 "$RUN-lr$lr.log"
    mkdir -p "$RUN/lr$lr/trainable/adapter"
    cp "$PACKAGED"/adapter/* "$RUN/lr$lr/trainable/adapter/"
    write_run_asset "$RUN/lr$lr" "SmolLM2-135M-Instruct linearized (the packaged weights), then attention transfer as lola (window $W, sparse cache $S, chunk $CHUNK) at lr $lr on $SEQ-token sequences; the packaged LoRA adapter kept. float16."
  done
  exit $rc
fi

# eval: per weights (packaged, then each run) and method, one process (the small model leaves the GPU idle
# between launches), few CPU threads each; JSONs to $OUT, logs into one tar.
export OMP_NUM_THREADS=2
Wk=/tmp/lola-transfer-eval && mkdir -p "$Wk"
METHODS=("lola(window=$W,sparse_cache=$S)" "lolcats(window=$W)")
pids=()
for lr in packaged $LRS; do
  if [ "$lr" = packaged ]; then assets=""; else assets="$RUN/lr$lr/assets"; fi
  for meth in "${METHODS[@]}"; do
    tag=$(echo "$meth" | tr -c 'a-z0-9\n' '-' | sed 's/-*$//')
    LONGCTX_ASSET_PATH=$assets timeout "$EVAL_MAX_S" python3 -m cli.main eval niah --model "$MODEL" --no-progress \
      --out-dir "$OUT/niah" --method "$meth" --tasks "$TASKS" --lengths "$LENGTHS" --depths "$DEPTHS" --samples "$SAMPLES" \
      --haystack "$DATA/heldout" --name "smollm2-135m-lola-transfer-$lr-$tag-$DEV" > "$Wk/niah-$lr-$tag.log" 2>&1 &
    pids+=($!)
  done
  LONGCTX_ASSET_PATH=$assets timeout "$EVAL_MAX_S" python3 -m cli.main eval ppl --model "$MODEL" --no-progress \
    --out-dir "$OUT/ppl" --method "${METHODS[0]}" --method "${METHODS[1]}" --text "$DATA/heldout" --context "$CONTEXT" --windows "$WINDOWS" \
    --name "smollm2-135m-lola-transfer-$lr-$DEV" > "$Wk/ppl-$lr.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
(cd "$Wk" && tar cf "$OUT/lola-transfer-eval-logs.tar" ./*.log)
tail -n 4 "$Wk"/*.log
exit $rc
