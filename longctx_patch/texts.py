"""A text source given as a file or a folder: which files are read. One rule for `longctx finetune --text` and the
evaluations' `--text` (perplexity, attention studies)."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError

# Files under a folder that are read as text; anything else is skipped silently.
TEXT_SUFFIXES = {
    ".txt", ".md", ".rst", ".tex", ".py", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java", ".js",
    ".ts", ".sh", ".toml", ".yaml", ".yml", ".json", ".jsonl", ".csv", ".html", ".xml", ".org", "",
}
# a folder's notes about itself, not its text (skipped where asked: evaluations)
META_NAMES = ("LICENSE", "SOURCE", "README")


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096)
    return b"\x00" in head


def text_files(path: str | os.PathLike, *, option: str = "--text", skip_meta: bool = False) -> list[Path]:
    """The file itself, or every text file under the folder (recursively, sorted; hidden entries, `__pycache__`,
    binary files and suffixes outside TEXT_SUFFIXES skipped; with `skip_meta`, also files named LICENSE*, SOURCE*,
    README*). A ConfigError names `option` when there is nothing to read."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise ConfigError(f"{option} {str(path)!r}: no such file or directory; pass a text file or a folder of text files")
    files = []
    for root, dirs, names in os.walk(p):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for n in sorted(names):
            f = Path(root) / n
            if n.startswith(".") or f.suffix.lower() not in TEXT_SUFFIXES or not f.is_file():
                continue
            if skip_meta and n.upper().startswith(META_NAMES):
                continue
            if _looks_binary(f):
                continue
            files.append(f)
    if not files:
        raise ConfigError(f"{option} {str(path)!r}: the folder holds no text files (suffixes such as .txt, .md, .py)")
    return files
