#!/usr/bin/env bash
# The generation targets on one H200 in two device calls (each under 10 minutes), one process per method:
#   part a: decode-graph equality for ovq; generate() speed at batch 16 x 32k and batch 1 x 64k of plain
#           transformers (sdpa, and its static cache compiled), exact and ovq;
#   part b: decode-graph equality for exact and sliding-window; the same speed cells for lolcats, lola and
#           sliding-window; the sliding-window prefill kernels (bench_window); peak memory of lola and ovq from 16k
#           to 128k at batch 4 with the prompt fed in 8k chunks, and batch 64 x 32k.
# Decode is timed past each method's graph captures (--decode-base: 81 for lola/lolcats, whose 64 keys are captured
# in the first 65 steps; 8 for exact/ovq/sliding-window, one graph; 1 for plain transformers).
#
#   LONGCTX_COMMIT=<sha> bash evals/device/generate_targets.sh a OUT_DIR
set -uo pipefail
part=$1; out=$2
mkdir -p "$out"
sp() {  # method, decode base, per-method seconds: generate_speed at the two target cells
  CELLS=16x32k,1x64k DECODE_TOKENS=64 DECODE_BASE=$2 PER_METHOD_S=$3 NAME_SUFFIX=targets-h200 \
    bash evals/device/generate_speed.sh "$out" "$1"
}
case "$part" in
  a)
    timeout 60 python3 -m evals.device.decode_graphs_check --methods ovq --dtypes bfloat16 --prompt 2000 --new 160 \
      --out "$out" || echo "! decode_graphs_check exited with $?"
    sp none 1 280
    sp exact 8 110
    sp ovq 8 110
    ;;
  b)
    timeout 90 python3 -m evals.device.decode_graphs_check --methods exact,sliding-window --dtypes bfloat16 \
      --prompt 2000 --new 160 --out "$out/check-b" || echo "! decode_graphs_check exited with $?"
    sp lolcats 81 100
    sp lola 81 100
    sp sliding-window 8 80
    timeout 70 python3 -m evals.bench.bench_window --lengths 16k,64k,128k --window 256 \
      --variants banded,triton,cudnn-full-causal \
      --out "$out/window-256-h200.json" || echo "! bench_window exited with $?"
    for m in lola ovq; do
      CELLS=4x16k,4x32k,4x64k,4x128k,64x32k PREFILL_CHUNK=8192 DECODE_TOKENS=8 DECODE_BASE=8 PER_METHOD_S=70 \
        NAME_SUFFIX=memory-h200 bash evals/device/generate_speed.sh "$out" "$m"
    done
    ;;
  *) echo "part a or b" >&2; exit 2 ;;
esac
