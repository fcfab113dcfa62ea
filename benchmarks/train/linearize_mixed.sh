#!/usr/bin/env bash
# Linearize SmolLM2-135M-Instruct on mixed text (essays, a book, Python source) at 4k sequences on one GPU, then
# measure it on held-out text of two kinds that are not essays (Python modules never trained on, the last tenth of
# the book) and on S-NIAH-1 in held-out essays. Run from the repository root on the GPU machine with the model at
# $MODEL (see benchmarks/README.md, "Running on a GPU") and the raw text carried in $SRC (pg_essays/ and books/tinyshakespeare.txt):
#   LONGCTX_COMMIT=<sha> bash benchmarks/train/linearize_mixed.sh train OUT   # -> $RUN, asset in $RUN/assets
#   LONGCTX_COMMIT=<sha> bash benchmarks/train/linearize_mixed.sh eval OUT    # perplexity + S-NIAH, every method
#   LONGCTX_COMMIT=<sha> bash benchmarks/train/linearize_mixed.sh extend OUT  # recipes/linearize-extend.yaml at $EXTEND_SEQ
#     on the trained run's maps (the LoRA stays merged); the asset in $RUN/assets is replaced by the extended one
# A run too long for one job: EXTRA="--stop-after transfer" for the first, EXTRA="--resume" for the second.
# The split: `split_text` in train_text.sh.
set -euo pipefail
STEP=${1:?usage: $0 train|eval OUT}
OUT=${2:?usage: $0 train|eval OUT}
MODEL=${MODEL:-/tmp/smollm2.gguf}
SRC=${SRC:-.device-data}
W=${W:-/tmp/mixed}
RUN=${RUN:-/tmp/linearize-mixed}
DEV=${DEV:-$(python3 -c 'from benchmarks.shared import device_token; print(device_token())')}
SEQ=${SEQ:-4096}
TRANSFER_BATCH=${TRANSFER_BATCH:-16}
LORA_BATCH=${LORA_BATCH:-16}
TRANSFER_STEPS=${TRANSFER_STEPS:-300}   # 300 x 16 x 4096 = 19.7M tokens
LORA_STEPS=${LORA_STEPS:-300}
TRANSFER_MAX_S=${TRANSFER_MAX_S:-150}
LORA_MAX_S=${LORA_MAX_S:-240}
EVAL_MAX_S=${EVAL_MAX_S:-400}
NAME=${NAME:-smollm2-135m-linearize-mixed}
export LONGCTX_ASSET_PATH=$RUN/assets
mkdir -p "$OUT"
. "$(dirname "$0")/train_text.sh"  # split_text: the mixed text's training and held-out folders in $W


if [ "$STEP" = extend ]; then  # the attention transfer again at $EXTEND_SEQ tokens, from the trained run
  split_text
  EXT=${EXT:-$RUN-extend}
  python3 -m longctx_patch.cli.main finetune recipes/linearize-extend.yaml --model "$MODEL" --text "$W/train" --output "$EXT" -q \
    --set method_config.checkpoint="$RUN/trainable" --set "stages.0.seq_len=${EXTEND_SEQ:-8192}" \
    --set "stages.0.batch_size=${EXTEND_BATCH:-8}" --set "stages.0.steps=${EXTEND_STEPS:-150}" \
    --set "stages.0.max_time_s=${EXTEND_MAX_S:-240}" --set stages.0.eval_every=50 --set stages.0.save_every=100000 \
    --results "$OUT/finetune/$NAME-extend-$DEV.json" ${EXTRA:-}
  # the extension trains the maps with the run's LoRA merged and frozen: the asset takes the run's adapter as it was
  cp -r "$RUN/trainable/adapter" "$EXT/trainable/adapter"
  write_run_asset "$EXT" "SmolLM2-135M-Instruct linearized on mixed text, transfer extended to ${EXTEND_SEQ:-8192} tokens"
  rm -rf "$RUN/assets" && mkdir -p "$RUN/assets" && cp -r "$EXT/assets/." "$RUN/assets/"
  (cd "$RUN/assets" && tar cf "$OUT/asset-extended.tar" .)
  exit 0
fi

if [ "$STEP" = train ]; then  # linearize_smollm2.sh's train step on this text, at $SEQ tokens
  split_text
  TEXT="$W/train" MODEL="$MODEL" RUN="$RUN" OUT="$OUT" NAME="$NAME" DEV="$DEV" TRANSFER_STEPS="$TRANSFER_STEPS" \
    LORA_STEPS="$LORA_STEPS" TRANSFER_MAX_S="$TRANSFER_MAX_S" LORA_MAX_S="$LORA_MAX_S" \
    EXTRA="--set stages.transfer.seq_len=$SEQ --set stages.lora.seq_len=$SEQ \
      --set stages.transfer.batch_size=$TRANSFER_BATCH --set stages.lora.batch_size=$LORA_BATCH \
      --set stages.transfer.warmup=10 --set stages.lora.warmup=10 \
      --set stages.transfer.eval_every=100 --set stages.lora.eval_every=100 ${EXTRA:-}" \
    bash "$(dirname "$0")/linearize_smollm2.sh" train
  exit 0
fi

# eval: each method in its own process; perplexity on the two held-out kinds, S-NIAH-1 in held-out essays
split_text
E=/tmp/mixed-eval && mkdir -p "$E/ppl" "$E/niah"
export OMP_NUM_THREADS=2
M="--model $MODEL --no-progress"
METHODS=(none lolcats 'lola(window=64,sparse_cache=64)' 'lola(window=128,sparse_cache=128)'
         'lola(window=256,sparse_cache=256)')
pm=(); for m in "${METHODS[@]}"; do pm+=(--method "$m"); done
pids=()
for kind in code book; do
  timeout "$EVAL_MAX_S" python3 -m longctx_patch.cli.main eval ppl $M "${pm[@]}" --text "$W/heldout-$kind" --context 4k,8k \
    --windows 8 --out-dir "$E/ppl" --name "$NAME-heldout-$kind-$DEV" > "$E/ppl-$kind.log" 2>&1 &
  pids+=($!)
done
for meth in "${METHODS[@]}"; do
  tag=$(echo "$meth" | tr -c 'a-z0-9\n' '-' | sed 's/-*$//')
  timeout "$EVAL_MAX_S" python3 -m longctx_patch.cli.main eval niah $M --method "$meth" --tasks s-niah-1,s-niah-2 --lengths 2k,4k,8k \
    --samples 4 --depths 0,0.25,0.5,0.75,1 --haystack "$W/heldout-essays" --out-dir "$E/niah" \
    --name "$NAME-$tag-$DEV" > "$E/niah-$tag.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
(cd "$E" && tar czf "$OUT/linearize-mixed-eval.tgz" ppl niah ./*.log)
tail -n 8 "$E"/*.log
exit $rc
