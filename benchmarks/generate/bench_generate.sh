#!/usr/bin/env bash
# generate() speed of every method on the 1B-shaped model, one process per method (a kernel crash ends only its
# own), results under OUT_DIR; set LONGCTX_COMMIT to the commit the tree came from.
#
#   BATCHES=1,16 CONTEXTS=16k,32k bash benchmarks/generate/bench_generate.sh OUT_DIR [METHOD ...]
#   CALLS=64,256: the generate() calls of each cell (new tokens), each timed from its first decode step
#   PREFILL_CHUNK=8192: the prompt in chunks (peak memory of the decode state); NAME_SUFFIX names the files
#   PER_METHOD_S=300 bounds each method's process; CELLS=16x32k,1x64k runs those pairs instead of the product
set -uo pipefail
out=$1; shift
methods=("$@")
[ ${#methods[@]} -gt 0 ] || methods=(none exact sliding-window lolcats lola ovq muse)
for m in "${methods[@]}"; do
  extra=()
  [ "$m" = none ] && extra=(--static)
  echo "+ $m"
  timeout "${PER_METHOD_S:-900}" python3 -m benchmarks.generate.bench_generate --method "$m" --batches "${BATCHES:-1,16}" \
      --contexts "${CONTEXTS:-16k,32k}" --calls "${CALLS:-64,256}" ${CELLS:+--cells "$CELLS"} \
      ${PREFILL_CHUNK:+--prefill-chunk "$PREFILL_CHUNK"} ${NAME_SUFFIX:+--name "llama-3.2-1b-shaped-generate-$m-$NAME_SUFFIX"} --out-dir "$out" "${extra[@]}" \
      || echo "! $m exited with $?"
done
