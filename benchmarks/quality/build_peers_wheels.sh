#!/usr/bin/env bash
# Fetches into .peers-whl/ (git-ignored) the wheels that benchmarks/quality/bench_peers_kvpress.sh installs on the GPU
# machine (Python 3.12, x86-64; it has no internet): kvpress 0.5.5 and the transformers it supports (5.2.0) with what
# they import that the GPU image lacks, and gguf for reading the model there. Run it on a machine with PyPI access,
# in the repository's root, then name .peers-whl in the device call's carry list (about 15 MiB).
#
#   bash benchmarks/quality/build_peers_wheels.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.peers-whl/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null \
  || echo '/.peers-whl/' >> "$(git rev-parse --git-common-dir)/info/exclude"
rm -rf .peers-whl && mkdir -p .peers-whl
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .peers-whl "$@"
}
get kvpress==0.5.5 transformers==5.2.0 tokenizers==0.22.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  cachetools==5.5.2 termcolor==3.3.0 gguf==0.19.0
# fire 0.6.0 is published as a source archive only: build its (pure-Python) wheel here
python3 -m pip wheel -q --no-deps --no-build-isolation -w .peers-whl fire==0.6.0 \
  || python3 -m pip wheel -q --no-deps -w .peers-whl fire==0.6.0
ls .peers-whl && du -sh .peers-whl
