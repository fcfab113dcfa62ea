#!/usr/bin/env bash
# MuSe on Qwen2.5-Coder-0.5B-Instruct (32k context) on one GPU: attention error per layer at 16k and 32k, perplexity on
# the Python standard library's source, RULER at 32k paired with the unpatched model, and the matched-sparsity
# comparison at 32k; the cells default against far_field=tilted-cells. docs/PERFORMANCE.md, "MuSe on a model trained
# for 32k", holds what it gave.
#
#   bash benchmarks/quality/muse_qwen.sh GGUF OUT_DIR ESSAYS_DIR [PARTS]
#   PARTS (default fidelity,ppl,ruler,matched): any of them, comma-separated (one device call runs 10 minutes:
#   fidelity + ppl + matched fit one, ruler another)
#
# GGUF: the model file (assembled on the GPU machine from the pieces ../shared/tools/qwen-coder-parts.sh cuts);
# ESSAYS_DIR: a folder holding pg_essays/ (the fidelity text); set LONGCTX_COMMIT to the commit the tree came from.
set -uo pipefail
if [ $# -lt 3 ]; then
  echo "usage: bash benchmarks/quality/muse_qwen.sh GGUF OUT_DIR ESSAYS_DIR [fidelity,ppl,ruler,matched]" >&2; exit 2
fi
gguf=$1; out=$2; essays=$3; parts=${4:-fidelity,ppl,ruler,matched}
export PYTHONPATH=${PYTHONPATH:-.} TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
has() { case ",$parts," in *",$1,"*) return 0;; *) return 1;; esac; }
M=/tmp/qwen2.5-coder-0.5b-hf  # dequantised once, the embedding tied again, as load_model("qwen2.5-coder-0.5b") does
[ -f $M/config.json ] || python3 -c "import sys; from pathlib import Path; from longctx_patch.models import \
dequantise_gguf; dequantise_gguf(Path(sys.argv[1]), Path(sys.argv[2]), tie_embeddings=True)" "$gguf" "$M" 2>&1 | tail -1
mkdir -p "$out/muse" "$out/ppl" "$out/ruler" /tmp/stdlib-text
C='{"far_field":"cells"'; T='{"far_field":"tilted-cells"'
quiet() { grep -v -i 'warn\|Loading\|it/s' | tail -"${1:-12}"; }
fid=(python3 -m benchmarks.quality.bench_muse_fidelity --device cuda --backend auto --model "$M" --data "$essays" --dtype bfloat16)
if has fidelity; then
  timeout 220 "${fid[@]}" --seq-len 32768 --out "$out/muse/fidelity-qwen2.5-coder-0.5b-32k-bf16-h200.json" \
    --grid "[$C},$T},$T,\"q_clusters\":64},$C,\"topk_blocks\":4,\"peak_blocks\":4},$T,\"topk_blocks\":4,\"peak_blocks\":4},$C,\"topk_blocks\":20,\"peak_blocks\":20}]" 2>&1 | quiet 14
  timeout 150 "${fid[@]}" --seq-len 16384 --out "$out/muse/fidelity-qwen2.5-coder-0.5b-16k-bf16-h200.json" \
    --grid "[$C},$T},$C,\"topk_blocks\":6,\"peak_blocks\":6},$C,\"topk_blocks\":4,\"peak_blocks\":4},$C,\"topk_blocks\":2,\"peak_blocks\":2},$C,\"block_size\":128,\"topk_blocks\":8,\"peak_blocks\":8},$C,\"block_size\":128,\"topk_blocks\":4,\"peak_blocks\":4},$T,\"topk_blocks\":4,\"peak_blocks\":4}]" 2>&1 | quiet 14
fi
if has matched; then
  timeout 150 "${fid[@]}" --seq-len 32768 --matched 4096 --out "$out/muse/fidelity-matched-qwen2.5-coder-0.5b-32k-bf16-h200.json" 2>&1 | quiet 6
  X='{"far_field":"tilted-cells","block_size":256,"k_clusters":8,"topk_blocks":7,"peak_blocks":7,"sink_blocks":1,"local_blocks":1'
  timeout 120 "${fid[@]}" --seq-len 32768 --grid "[$X}, $X,\"q_clusters\":1024}]" \
    --out "$out/muse/fidelity-matched-tilted-cells-qwen2.5-coder-0.5b-32k-bf16-h200.json" 2>&1 | quiet 4
fi
if has ppl || has ruler; then
  python3 - > /tmp/stdlib-text/stdlib.txt <<'PY'
import glob, os
for p in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
    print(open(p, encoding="utf-8", errors="replace").read())
PY
fi
common=(--model "$M" --device cuda --dtype bfloat16 --no-progress)
if has ppl; then
  timeout 180 python3 -m longctx_patch.cli.main eval ppl "${common[@]}" --method none --method muse --method 'muse(far_field=tilted-cells)' \
    --text /tmp/stdlib-text --context 16k,32k --windows 8 --out-dir "$out/ppl" \
    --name qwen2.5-coder-0.5b-stdlib-muse-16k-32k-h200 2>&1 | quiet 8
fi
if has ruler; then  # one run per far field, each paired with the unpatched model on the same prompts
  for m in muse 'muse(far_field=tilted-cells)'; do
    name=qwen2.5-coder-0.5b-stdlib-muse-paired-32k-h200
    [ "$m" = muse ] || name=qwen2.5-coder-0.5b-stdlib-muse-tilted-cells-paired-32k-h200
    timeout 290 python3 -m longctx_patch.cli.main eval ruler "${common[@]}" --method none --method "$m" --haystack stdlib \
      --lengths 32k --tasks all --samples 5 --seed 0 --out-dir "$out/ruler" --name "$name" 2>&1 | quiet 3
  done
fi
