#!/usr/bin/env bash
# recipes/linearize.yaml on SmolLM2-135M-Instruct three ways on one machine with (at least) two GPUs: one
# process on one GPU, DDP over two, FSDP2 over two; the same recipe and global batch, fixed step counts (no
# time caps, so tokens/s compare). Then each run's weights are evaluated the same way (perplexity and
# S-NIAH), and a summary JSON compares throughput and quality. Run from the repository root after the model
# is assembled at $MODEL (benchmarks/README.md, "Running on a GPU"):
#   benchmarks/train/multigpu_linearize.sh
# On a CPU (a smoke run of the script itself): NPROC=2 CPU=1 TRANSFER_STEPS=2 LORA_STEPS=2 SEQ=128 BATCH=2 \
#   CONTEXTS=512 LENGTHS=512 SAMPLES=1 MODEL=smollm2-135m DATA=... benchmarks/train/multigpu_linearize.sh
set -euo pipefail
MODEL=${MODEL:-/tmp/smollm2.gguf}
DATA=${DATA:-.device-data}
RUN=${RUN:-/tmp/multigpu}
OUT=${OUT:-benchmarks/results}  # the summary goes to $OUT/multigpu/ as in benchmarks/results (benchmarks/README.md, results)
DEV=${DEV:-$(python3 -c 'from benchmarks.shared import device_token; print(device_token())')}
. "$(dirname "$0")/train_text.sh"
NPROC=${NPROC:-2}
CPU=${CPU:-0}
TRANSFER_STEPS=${TRANSFER_STEPS:-300}
LORA_STEPS=${LORA_STEPS:-150}
SEQ=${SEQ:-1024}
BATCH=${BATCH:-8}
CONTEXTS=${CONTEXTS:-2k,4k}
LENGTHS=${LENGTHS:-2k,4k}
SAMPLES=${SAMPLES:-2}
MODES=${MODES:-single ddp fsdp}
EVAL=${EVAL:-1}   # 0: throughput only (no perplexity or NIAH of the trained weights)
# the summary covers these (default MODES); a mode whose results are already in $RUN is not run again, so the
# modes can be split over several calls on one warm machine: MODES="single ddp", then MODES=fsdp SUMMARY_MODES=...
SUMMARY_MODES=${SUMMARY_MODES:-$MODES}
NAME=${NAME:-multigpu-linearize-smollm2-135m}  # the runs' files in $RUN
SUMMARY=${SUMMARY:-$OUT/multigpu/linearize-smollm2-135m-${DEV}x${NPROC:-2}.json}

build_train_text
mkdir -p "$RUN" "$(dirname "$SUMMARY")"
recipe_args=(recipes/linearize.yaml --model "$MODEL" --text "$TEXT" -q
  --set stages.transfer.steps="$TRANSFER_STEPS" --set stages.lora.steps="$LORA_STEPS"
  --set stages.transfer.seq_len="$SEQ" --set stages.lora.seq_len="$SEQ"
  --set stages.transfer.batch_size="$BATCH" --set stages.lora.batch_size="$BATCH"
  --set stages.transfer.save_every=100000 --set stages.lora.save_every=100000
  --set stages.transfer.eval_every=100000 --set stages.lora.eval_every=100000)
env_prefix=()
if [ "$CPU" = 1 ]; then env_prefix=(env CUDA_VISIBLE_DEVICES=); fi
for mode in $MODES; do
  if [ -f "$RUN/$NAME-$mode-niah.json" ] || { [ "$EVAL" != 1 ] && [ -f "$RUN/$NAME-$mode-train.json" ]; }; then echo "== $mode: done before, kept"; continue; fi
  rm -rf "${RUN:?}/$mode"
  case $mode in
    single) launch=(python3 -m longctx_patch.cli.main finetune);
            if [ "$CPU" != 1 ]; then env_prefix_mode=(env CUDA_VISIBLE_DEVICES=0); else env_prefix_mode=("${env_prefix[@]}"); fi ;;
    ddp)    # --multi_gpu also on CPU (with CUDA_VISIBLE_DEVICES= it runs on gloo); without it accelerate starts one process
            launch=(accelerate launch --multi_gpu --num_processes "$NPROC" --main_process_port 29511 -m longctx_patch.cli.finetune_cmd)
            env_prefix_mode=("${env_prefix[@]}") ;;
    fsdp)   launch=(accelerate launch --use_fsdp --fsdp_version 2 --num_processes "$NPROC" --main_process_port 29512
                    --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer
                    --fsdp_reshard_after_forward true -m longctx_patch.cli.finetune_cmd)
            env_prefix_mode=("${env_prefix[@]}") ;;
    *) echo "unknown mode $mode (single, ddp, fsdp)" >&2; exit 2 ;;
  esac
  echo "== $mode: ${launch[*]}"
  t0=$(date +%s)
  ${env_prefix_mode[@]+"${env_prefix_mode[@]}"} "${launch[@]}" "${recipe_args[@]}" --output "$RUN/$mode" \
    --results "$RUN/$NAME-$mode-train.json" > "$RUN/$mode.log" 2>&1 || { tail -n 30 "$RUN/$mode.log"; exit 1; }
  echo "$mode: $(( $(date +%s) - t0 )) s"
  if [ "$EVAL" != 1 ]; then continue; fi
  # the run as an asset folder, so that the evaluation loads exactly these weights (checkpoint=auto)
  write_run_asset "$RUN/$mode" "multi-GPU comparison run ($mode)"
  LONGCTX_ASSET_PATH="$RUN/$mode/assets" python3 -m longctx_patch.cli.main eval ppl --model "$MODEL" --method lolcats \
    --method 'lola(window=256,sparse_cache=256)' --no-baseline --text "$DATA/heldout" --context "$CONTEXTS" --windows 4 \
    --no-progress --out-dir "$RUN" --name "$NAME-$mode-ppl" > "$RUN/$mode-ppl.log" 2>&1
  LONGCTX_ASSET_PATH="$RUN/$mode/assets" python3 -m longctx_patch.cli.main eval niah --model "$MODEL" --method lolcats \
    --tasks s-niah-1 --lengths "$LENGTHS" --depths 0.25,0.5,0.75 --samples "$SAMPLES" --haystack "$DATA/heldout" \
    --no-progress --out-dir "$RUN" --name "$NAME-$mode-niah" > "$RUN/$mode-niah.log" 2>&1
done

python3 - "$RUN" "$SUMMARY" "$NAME" $SUMMARY_MODES <<'PY'
import json, os, sys
from longctx_patch.provenance import git_commit
run, summary, name, modes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
res = {"task": "multigpu-linearize", "commit": git_commit(), "command": "benchmarks/train/multigpu_linearize.sh (" +
       " ".join(f"{k}={os.environ[k]}" for k in ("NPROC", "TRANSFER_STEPS", "LORA_STEPS", "SEQ", "BATCH", "MODES", "EVAL")
                if k in os.environ) + ")", "runs": {}}
for m in modes:
    tr = json.load(open(f"{run}/{name}-{m}-train.json"))
    evaluated = os.path.exists(f"{run}/{name}-{m}-niah.json")
    ppl = json.load(open(f"{run}/{name}-{m}-ppl.json")) if evaluated else {"ppl": None}
    niah = json.load(open(f"{run}/{name}-{m}-niah.json")) if evaluated else {"accuracy": None}
    # the host's GPUs in provenance.device_description's spelling ("2 x NVIDIA H200"); a run's own says "N x" or not
    res.setdefault("device", f"{os.environ.get('NPROC', '2')} x {tr['device'].split(' x ', 1)[-1]}")
    res.setdefault("date", tr["date"])
    res["runs"][m] = {
        "world_size": tr.get("world_size"), "parallel": tr.get("parallel"),
        "stages": {s["name"]: {k: s.get(k) for k in ("steps_done", "tokens", "time_s", "tokens_per_s",
                                                        "steady_tokens_per_s", "peak_memory_gib", "first_loss",
                                                        "final_loss")} for s in tr["stages"]},
        "ppl": ppl["ppl"], "niah": niah["accuracy"],
    }
base = res["runs"].get("single")
if base:
    for m, r in res["runs"].items():
        for key in ("tokens_per_s", "steady_tokens_per_s"):
            r[key + "_vs_single"] = {st: (r["stages"][st][key] / base["stages"][st][key]) for st in r["stages"]
                                     if base["stages"].get(st, {}).get(key) and r["stages"][st].get(key)}
json.dump(res, open(summary, "w"), indent=1)
print(json.dumps({m: {"tokens/s": {k: round(v["tokens_per_s"] or 0) for k, v in r["stages"].items()},
                      "steady tokens/s": {k: round(v["steady_tokens_per_s"] or 0) for k, v in r["stages"].items()},
                      "ppl": r["ppl"],
                      "niah": r["niah"]} for m, r in res["runs"].items()}, indent=1))
PY
