"""Text given as a file or a folder: which files are read, and the one rule for what is text. Used by `longctx
finetune --text`, the evaluations' `--text` and `--haystack` (perplexity, attention studies, needles, RULER) and
`longctx generate --prompt-file`.

The rule (`binary_reason`): a file is text when its first BINARY_PROBE bytes hold no NUL byte and decode as UTF-8 (a
character cut by the probe's end does not count). An explicit file that is not text is refused with a ConfigError
naming the option and the file; a folder's files that are not text are skipped. Past the probe a stray invalid byte
reads as U+FFFD.
"""

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
BINARY_PROBE = 8192  # bytes of a file that decide whether it is text


def binary_reason(path: str | os.PathLike) -> str | None:
    """Why `path` is not text by the rule of this module ('a NUL byte at offset 12', 'bytes that are not UTF-8 at
    offset 3'), or None when it is text."""
    with open(path, "rb") as f:
        head = f.read(BINARY_PROBE)
    nul = head.find(b"\x00")
    if nul >= 0:
        return f"a NUL byte at offset {nul}"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        cut = e.reason == "unexpected end of data" and len(head) == BINARY_PROBE  # a character across the probe's end
        if not cut:
            return f"bytes that are not UTF-8 at offset {e.start}"
    return None


def _not_text(option: str, path, reason: str) -> ConfigError:
    return ConfigError(f"{option} {str(path)!r}: {path} is not text ({reason}); pass a UTF-8 text file, or a folder of "
                       "them (a folder's binary files are skipped)")


def read_text(path: str | os.PathLike, option: str = "--text") -> str:
    """The text of one file, by the rule of this module: a ConfigError naming `option` and the file when it is not
    text or cannot be read."""
    try:
        reason = binary_reason(path)
        if reason is not None:
            raise _not_text(option, path, reason)
        return Path(path).read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        raise ConfigError(f"{option} {str(path)!r}: cannot be read ({e.strerror or e}); pass a readable text file") from None


def text_files(path: str | os.PathLike, *, option: str = "--text", skip_meta: bool = False) -> list[Path]:
    """The file itself (refused when it is not text), or every text file under the folder (recursively, sorted;
    hidden entries, `__pycache__`, files that are not text and suffixes outside TEXT_SUFFIXES skipped; with
    `skip_meta`, also files named LICENSE*, SOURCE*, README*). A ConfigError names `option` when there is nothing to
    read."""
    p = Path(path).expanduser()
    if p.is_file():
        try:
            reason = binary_reason(p)
        except OSError as e:
            raise ConfigError(f"{option} {str(path)!r}: cannot be read ({e.strerror or e}); pass a readable text "
                              "file") from None
        if reason is not None:
            raise _not_text(option, path, reason)
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
            try:
                if binary_reason(f) is not None:
                    continue
            except OSError:  # unreadable: skipped like any file that is not text
                continue
            files.append(f)
    if not files:
        raise ConfigError(f"{option} {str(path)!r}: the folder holds no text files (suffixes such as .txt, .md, .py)")
    return files
