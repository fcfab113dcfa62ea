"""The training and held-out text for linearizing a real model (issue 52), and the tooling that builds it.

    python -m benchmarks.data.build_corpus --help

sources.json   the prose sources: package, version, file, sha256, licence, what is taken, measured tokens
tokens.py      the tokenizer (a cached tokenizer.json, a .gguf, or the embedded Qwen packages) and token counts
pycode.py      Python sources of an installed environment: the selection rules, vendored/generated skips, hashes
prose.py       prose from package archives: fetch by name and version, extract, pack compressed pieces
corpus.py      documents, deduplication (files and repeated blocks), the held-out/training split, writing, checks
build_corpus.py  the command line

docs/training-data.md says how the corpus is made, what it holds and how it reaches the GPU machine.
"""
