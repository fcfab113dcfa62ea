#!/usr/bin/env bash
# kvpress's presses beside this project's constant-memory methods on the same RULER samples (docs/peers.md):
# Qwen2.5-Coder-0.5B-Instruct, bf16, one GPU, 4k and 16k, matched decode-state fractions.
#
#   PART=setup   bash benchmarks/quality/bench_peers_kvpress.sh GGUF OUT   # model, samples, kvpress env, self-check (~3 min)
#   PART=kvpress bash benchmarks/quality/bench_peers_kvpress.sh GGUF OUT   # presses; exit 3 = more left: call again
#   PART=ours    bash benchmarks/quality/bench_peers_kvpress.sh GGUF OUT   # our methods; exit 3 = more left: call again
#   PART=plot    bash benchmarks/quality/bench_peers_kvpress.sh GGUF OUT   # OUT/peers-qwen2.5-coder-0.5b.{json,png}
#
# Each call stops starting work after BUDGET_S seconds (default 480) so that no command passes 10 minutes; a call
# again goes on where the last one stopped (finished cells are skipped). OUT must come back between calls: keep it in
# the git-ignored .device-data/peers (name it in `carry`) and send it back at the end of each call as one file
# (`tar czf $OUT/peers.tgz -C .device-data peers`: $OUT returns 8 files at most). The samples at
# 4k and the presses already answered there on a CPU (docs/peers.md, "Measured") are in that folder on the machine
# that ran them: a call with them skips those cells and answers the same prompts. The plot (PART=plot) is committed
# as benchmarks/results/peers/peers-qwen2.5-coder-0.5b-<device>.{json,png}; the raw files stay out of the repository.
#
# The model: the GGUF (491 MB) travels as numbered pieces cut by ../shared/tools/qwen-coder-parts.sh on the CPU
# machine (see its header: one piece a device call, `cat .device-model/qwen/NN/piece >> /tmp/qwen.gguf`, then the
# sha256 check); PART=setup dequantises it once to /tmp/qwen (longctx_patch.models.dequantise_gguf, tied embedding).
# /tmp lasts only while the machine stays warm: when it was handed back, PART=setup (and the pieces) again.
#
# Wheels: `bash benchmarks/quality/build_peers_wheels.sh` fills .peers-whl (on a machine with PyPI access).
# Environments: ours is the image's python3 (torch 2.11, transformers 5.17) with the repository on PYTHONPATH and
# gguf from .peers-whl. kvpress 0.5.5 pins transformers < 5.3 (on 5.17 every press fails: KeyError
# 'cache_position'), so it runs with PYTHONPATH=/tmp/kvp: the wheels of .peers-whl (kvpress, transformers 5.2.0,
# tokenizers 0.22.2, datasets and what kvpress imports that the image lacks) installed there with --no-deps, which
# shadow the image's transformers and tokenizers; the image's torch is used. Never installed into the image itself.
#
# Tasks: TASKS (default niah_single_1,niah_single_2: the S-NIAH targets of issue 52); TASKS=all for the RULER
# average. SAMPLES a (task, length) cell (default 20). Expected time on the H200 (estimates, not measured: ~0.6 s a
# sample for the presses, 16k prefill and ~30 greedy tokens in kvpress's Python loop, KVzip's reconstruction passes
# on top; ~0.5 s for ours): setup ~3 min; with the default tasks 80 samples a configuration: kvpress 26 cells
# (baseline + 5 presses x 5 fractions) ~25 min in 3-4 calls, ours 16 configurations ~15 min in 2-3 calls, plot
# seconds. TASKS=all (11 tasks) multiplies both by 5.5.
#
# LONGCTX_COMMIT: the commit the tree came from (recorded in every result).
set -euo pipefail
gguf=${1:?GGUF path}; out=${2:?output folder}
part=${PART:?PART=setup|kvpress|ours|plot}
budget=${BUDGET_S:-480}
tasks=${TASKS:-niah_single_1,niah_single_2}; samples=${SAMPLES:-20}
lengths=(4096 16384)
fractions=${FRACTIONS:-0.05,0.1,0.15,0.25,0.5}
presses=${PRESSES:-streaming_llm,snapkv,expected_attention,kvzip,knorm}
model=/tmp/qwen
start=$(date +%s)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LONGCTX_COMMIT=${LONGCTX_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$out"
ours_py() { PYTHONPATH="$PWD:/tmp/gguf-whl" python3 "$@"; }
kvp_py() { PYTHONPATH=/tmp/kvp python3 "$@"; }
left() { [ $(( $(date +%s) - start )) -lt "$budget" ]; }

case $part in
setup)
  python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))'
  rm -rf /tmp/kvp /tmp/gguf-whl
  python3 -m pip install -q --no-index --no-deps --target /tmp/gguf-whl .peers-whl/gguf-*.whl
  python3 -m pip install -q --no-index --no-deps --target /tmp/kvp $(ls .peers-whl/*.whl | grep -v /gguf-)
  [ -f "$model/config.json" ] || ours_py -c "import sys; from pathlib import Path; from longctx_patch.models import \
dequantise_gguf; dequantise_gguf(Path(sys.argv[1]), Path(sys.argv[2]), tie_embeddings=True)" "$gguf" "$model"
  for L in "${lengths[@]}"; do
    [ -f "$out/samples-$L.jsonl" ] || ours_py -m longctx_patch.cli.main eval ruler --model "$model" --haystack stdlib \
        --tasks "$tasks" --lengths "$L" --samples "$samples" --seed 0 --export-samples "$out/samples-$L.jsonl"
  done
  kvp_py benchmarks/quality/bench_peers_kvpress.py --self-check --device cuda
  ;;
kvpress)
  rc=0
  for L in "${lengths[@]}"; do
    rest=$(( budget - ($(date +%s) - start) ))
    [ "$rest" -gt 30 ] || { rc=3; break; }
    kvp_py benchmarks/quality/bench_peers_kvpress.py --model "$model" --samples "$out/samples-$L.jsonl" \
        --out "$out/kvpress-$L.jsonl" --presses "$presses" --fractions "$fractions" --baseline \
        --device cuda --dtype bfloat16 --max-seconds "$rest" || { r=$?; [ $r = 3 ] && rc=3 || exit $r; }
  done
  [ $rc = 0 ] && echo "kvpress: finished" || echo "kvpress: more left, call again"
  exit $rc
  ;;
ours)
  # matched fractions: sliding-window windows at 5-50% of 4k and of 16k; lola (window 256) and ovq sweeps; their
  # fractions are measured (state_bytes) whatever the length. LOLA_CHECKPOINT: linearized weights for lola
  # (default auto: none ships for this model yet, so fresh feature maps)
  configs=("none")
  for w in 205 410 614 1024 2048 819 1638 2458 4096 8192; do configs+=("sliding-window(window=$w)"); done
  for n in 64 256 1024 2048; do configs+=("lola(window=256,sparse_cache=$n,checkpoint=${LOLA_CHECKPOINT:-auto})"); done
  for n in 128 256 512 1024 2048; do configs+=("ovq(max_centroids=$n)"); done
  rc=0
  for L in "${lengths[@]}"; do
    for c in "${configs[@]}"; do
      name="ours-$L-$(echo "$c" | tr -c 'A-Za-z0-9=.,-' '_')"
      [ -f "$out/$name.json" ] && continue
      left || { rc=3; break 2; }
      ours_py -m longctx_patch.cli.main eval ruler --model "$model" --samples-file "$out/samples-$L.jsonl" --method "$c" \
          --device cuda --dtype bfloat16 --out-dir "$out" --name "$name" --no-progress 2>&1 | tail -4 \
          || echo "! $c at $L failed"
    done
  done
  [ $rc = 0 ] && echo "ours: finished" || echo "ours: more left, call again"
  exit $rc
  ;;
plot)
  args=()
  for L in "${lengths[@]}"; do args+=(--samples "$out/samples-$L.jsonl" --kvpress "$out/kvpress-$L.jsonl"); done
  ours_py -m benchmarks.quality.plot_peers "${args[@]}" --ours "$out/ours-*.json" --out "$out/peers-qwen2.5-coder-0.5b" \
      --model qwen2.5-coder-0.5b-instruct
  ;;
*) echo "PART=setup|kvpress|ours|plot" >&2; exit 2 ;;
esac
