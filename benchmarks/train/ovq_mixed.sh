#!/usr/bin/env bash
# OVQ fine-tuned at a real budget (recipes/ovq-finetune.yaml, >= 20M tokens of the mixed text of linearize_mixed.sh:
# essays, a book, Python source) on one GPU, with its reference: the same LoRA stage on the unpatched model. Then
# perplexity on the held-out code and book at 4k and S-NIAH-1/2 in held-out essays, each model in its own process.
# Run from the repository root on the GPU machine with the model at $MODEL (benchmarks/README.md, "Running on a GPU")
# and the raw text in $SRC (pg_essays/, books/tinyshakespeare.txt):
#   LONGCTX_COMMIT=<sha> bash benchmarks/train/ovq_mixed.sh train OUT VARIANT...   # concurrently, -> $RUN/VARIANT/model
#   LONGCTX_COMMIT=<sha> bash benchmarks/train/ovq_mixed.sh eval OUT VARIANT...    # concurrently, -> OUT/ovq-mixed-eval-*.tgz
# VARIANT: all (OVQ on every layer), hybrid (OVQ on even layers, a 256-token sliding window on the others, as the
# OVQ paper's PG19 runs), lora-none (the reference: unpatched, LoRA only); eval also takes base (the unpatched
# model, no fine-tune). The finetune stage: $FT_STEPS steps of $FT_BATCH x $FT_SEQ tokens (616 x 8 x 4096 = 20.2M),
# stopped at $FT_MAX_S seconds if it has not finished (the result JSON says how many tokens it saw).
set -euo pipefail
STEP=${1:?usage: $0 train|eval OUT VARIANT...}
OUT=${2:?usage: $0 train|eval OUT VARIANT...}
shift 2
[ $# -gt 0 ] || { echo "name at least one variant: all, hybrid, lora-none (eval: also base)" >&2; exit 2; }
for v in "$@"; do
  case $STEP:$v in
    train:all | train:hybrid | train:lora-none | eval:all | eval:hybrid | eval:lora-none | eval:base) ;;
    *) echo "unknown step or variant: $STEP $v (train: all, hybrid, lora-none; eval: those and base)" >&2; exit 2 ;;
  esac
done
MODEL=${MODEL:-/tmp/smollm2.gguf}
SRC=${SRC:-.device-data}
W=${W:-/tmp/mixed}
RUN=${RUN:-/tmp/ovq-mixed}
DEV=${DEV:-$(python3 -c 'from benchmarks.shared import device_token; print(device_token())')}
FT_SEQ=${FT_SEQ:-4096}
FT_BATCH=${FT_BATCH:-8}
FT_STEPS=${FT_STEPS:-616}
FT_MAX_S=${FT_MAX_S:-470}
FT_ACCUM=${FT_ACCUM:-1}        # sequences a step = FT_BATCH x FT_ACCUM (a larger model: a smaller batch, accumulated)
EVAL_CONTEXT=${EVAL_CONTEXT:-4k} EVAL_WINDOWS=${EVAL_WINDOWS:-8}        # perplexity's lengths and windows
NIAH_LENGTHS=${NIAH_LENGTHS:-2k,4k} NIAH_SAMPLES=${NIAH_SAMPLES:-4}     # S-NIAH's lengths, haystacks a depth (5 depths)
CAL_MAX_S=${CAL_MAX_S:-30}
EVAL_MAX_S=${EVAL_MAX_S:-420}
NAME=${NAME:-smollm2-135m-ovq-mixed}
mkdir -p "$OUT/finetune" "$RUN"
. "$(dirname "$0")/train_text.sh"
split_text

if [ "$STEP" = train ]; then
  ft=(--set "stages.finetune.steps=$FT_STEPS" --set "stages.finetune.batch_size=$FT_BATCH"
      --set "stages.finetune.seq_len=$FT_SEQ" --set "stages.finetune.max_time_s=$FT_MAX_S"
      --set "stages.finetune.grad_accum=$FT_ACCUM"
      --set stages.finetune.warmup=30 --set stages.finetune.eval_every=200 --set stages.finetune.save_every=100000)
  cal=(--set "stages.calibrate.max_time_s=$CAL_MAX_S" --set stages.calibrate.save_every=100000)
  pids=()
  for v in "$@"; do
    case $v in
      all) extra=("${cal[@]}") ;;
      hybrid) extra=("${cal[@]}" "${OVQ_HYBRID[@]}") ;;
      lora-none) extra=(--set method=null --set 'method_config={}' --set "$(lora_only_stage)") ;;
    esac
    python3 -m longctx_patch.cli.main finetune recipes/ovq-finetune.yaml --model "$MODEL" --text "$W/train" -q "${extra[@]}" "${ft[@]}" \
      --output "$RUN/$v" --results "$OUT/finetune/$NAME-$v-$DEV.json" > "$RUN/$v.log" 2>&1 &
    pids+=($!)
  done
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  for v in "$@"; do tail -n 6 "$RUN/$v.log"; done
  exit $rc
fi

# eval: perplexity on the two held-out kinds at EVAL_CONTEXT (4k, 8 windows), S-NIAH-1/2 at NIAH_LENGTHS (2k and 4k,
# 20 haystacks per length)
E=$(mktemp -d /tmp/ovq-mixed-eval.XXXX) && mkdir -p "$E/ppl" "$E/niah"  # this call's files only
export OMP_NUM_THREADS=2
pids=()
for v in "$@"; do
  if [ "$v" = base ]; then m=$MODEL; else m=$RUN/$v/model; fi
  [ "$v" = base ] || [ -e "$m" ] || { echo "no model for $v at $m (run the train step first)" >&2; exit 2; }  # base: a path or an alias
  for kind in code book; do
    timeout "$EVAL_MAX_S" python3 -m longctx_patch.cli.main eval ppl --model "$m" --no-progress --method none --no-baseline \
      --text "$W/heldout-$kind" --context "$EVAL_CONTEXT" --windows "$EVAL_WINDOWS" --out-dir "$E/ppl" --name "$NAME-$v-heldout-$kind-$DEV" \
      > "$E/ppl-$v-$kind.log" 2>&1 &
    pids+=($!)
  done
  timeout "$EVAL_MAX_S" python3 -m longctx_patch.cli.main eval niah --model "$m" --no-progress --method none --tasks s-niah-1,s-niah-2 \
    --lengths "$NIAH_LENGTHS" --samples "$NIAH_SAMPLES" --depths 0,0.25,0.5,0.75,1 --haystack "$W/heldout-essays" --out-dir "$E/niah" \
    --name "$NAME-$v-$DEV" > "$E/niah-$v.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
(cd "$E" && tar czf "$OUT/ovq-mixed-eval-$(echo "$@" | tr ' ' '-').tgz" ppl niah ./*.log)
tail -n 4 "$E"/*.log
exit $rc
