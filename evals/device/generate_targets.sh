#!/usr/bin/env bash
# The generation targets on one H200 in two device calls (each under 10 minutes), one process per method:
#   part a: decode-graph equality for ovq; generate() speed at batch 16 x 32k and batch 1 x 64k of plain
#           transformers (sdpa, and its static cache compiled), exact and ovq;
#   part b: decode-graph equality for exact and sliding-window; the same speed cells for lolcats, lola and
#           sliding-window; the sliding-window prefill kernels (bench_window); peak memory of lola and ovq from 16k
#           to 128k at batch 4 with the prompt fed in 8k chunks, and batch 64 x 32k.
# Decode is timed past each method's graph captures (--decode-base: 81 for lola/lolcats, whose 64 keys are captured
# in the first 65 steps; 8 for exact/ovq/sliding-window, one graph; 1 for plain transformers).
#   part c: an eager per-kernel profile of lola/lolcats at batch 16 x 32k; lola's feature cache on and off; exact,
#           lolcats and ovq at batch 1 x 64k over 384 decode tokens (64 were within the prefill's jitter);
#   part d: peak memory of lola, ovq, lolcats at batch 4 x 16k/64k/128k and 64 x 32k; the static-cache row.
#   part e: the cells not yet timed inside one generate() call: batch 1 x 64k for plain transformers (and its
#           static cache compiled, with batch 16 x 32k), exact, lolcats, lola and ovq; ovq and sliding-window at
#           batch 16 x 32k.
#   part f: the fused model ops on CUDA (evals.device.fused_ops_check: same tokens, score differences, ms per step
#           with and without), and the replayed step's anatomy of lolcats at batch 16 x 32k with and without them.
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
  c)  # where a batch-16 decode step goes (eager profile), the feature cache, and batch 1 x 64k with 384 tokens
    timeout 150 python3 -m evals.bench.model_decode_profile --methods lola,lolcats --batch 16 --context 32k \
      --steps 8 --profile-steps 2 --out "$out/profile-b16-32k.json" || echo "! model_decode_profile exited with $?"
    for fc in true false; do
      timeout 110 python3 -m evals.bench.generate_speed --method lola --config "{\"feature_cache\": $fc}" \
        --cells 16x32k --decode-tokens 384 --decode-base 81 --name "llama-3.2-1b-shaped-generate-lola-fc-$fc-h200" \
        --out-dir "$out" || echo "! lola feature_cache=$fc exited with $?"
    done
    for m in exact lolcats ovq; do
      base=8; [ "$m" = lolcats ] && base=81
      CELLS=1x64k DECODE_TOKENS=384 DECODE_BASE=$base PER_METHOD_S=80 NAME_SUFFIX=b1-64k-384-h200 \
        bash evals/device/generate_speed.sh "$out" "$m"
    done
    ;;
  d)  # peak memory of the constant-state methods 16k -> 128k (batch 4, prompt in 8k chunks) and batch 64 x 32k;
      # plain transformers with its static cache compiled at batch 16 x 32k
    for m in lola ovq lolcats; do
      CELLS=4x16k,4x64k,4x128k,64x32k PREFILL_CHUNK=8192 DECODE_TOKENS=8 DECODE_BASE=8 PER_METHOD_S=140 \
        NAME_SUFFIX=memory-h200 bash evals/device/generate_speed.sh "$out" "$m"
    done
    CELLS=16x32k DECODE_TOKENS=64 DECODE_BASE=1 PER_METHOD_S=150 NAME_SUFFIX=static-h200 \
      bash evals/device/generate_speed.sh "$out" none
    ;;
  e)
    one() {  # method, cells, decode base, seconds
      CELLS=$2 DECODE_TOKENS=256 DECODE_BASE=$3 PER_METHOD_S=$4 NAME_SUFFIX=in-call-h200 \
        bash evals/device/generate_speed.sh "$out" "$1"
    }
    one none 1x64k,16x32k 1 200
    one exact 1x64k 8 60
    one lolcats 1x64k 81 60
    one lola 1x64k 81 70
    one ovq 1x64k,16x32k 8 90
    one sliding-window 16x32k 8 70
    ;;
  f)
    timeout 240 python3 -m evals.device.fused_ops_check --methods exact,lolcats,lola --dtypes bfloat16,float32 \
      --out "$out/fused-ops-check-h200.json" || echo "! fused_ops_check exited with $?"
    for f in "" --fused-ops; do
      timeout 120 python3 -m evals.bench.decode_step_anatomy --method lolcats --batch 16 --context 32k $f \
        --out "$out/anatomy-lolcats-b16${f:+-fused}-h200.json" || echo "! anatomy $f exited with $?"
    done
    ;;
  *) echo "part a, b, c, d, e or f" >&2; exit 2 ;;
esac
