#!/usr/bin/env bash
# The Python wheels the GPU image lacks for the Qwen2.5-Coder linearization (docs/training-data.md, "Run plan"),
# downloaded here into .whl/ (git-ignored) for Python 3.12 on x86-64 Linux, to be carried to the GPU machine:
#   bash benchmarks/train/device_wheels.sh            # -> .whl/gguf-0.19.0-py3-none-any.whl (~0.1 MB)
# gguf reads the GGUF file (the model's dequantisation, and the tokenizer if read from the GGUF). Its requirements
# (numpy, pyyaml, requests, tqdm) and everything else longctx-patch imports in these runs (torch, transformers,
# accelerate, safetensors, peft, tokenizers, click, pyyaml, tqdm, matplotlib) are in the image's package list;
# `datasets` is not, and is not needed (only `longctx finetune --dataset` imports it; the runs read --text folders).
# On the GPU machine, at the start of a command whose run carries .whl:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
WHL=${WHL:-.whl}
WHEELS=${WHEELS:-gguf==0.19.0}
mkdir -p "$WHL"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$WHL" $WHEELS
ls -l "$WHL"
du -sh "$WHL"
