"""Perplexity on long text, and loss by position bucket (does the model use far context?).

The text (files, a folder of text files, or a `datasets` dataset) is tokenised, the documents are
joined with the EOS token into one stream, and the stream is cut into non-overlapping windows of each
`--context` length. Every window is scored in one forward pass without a cache; the loss of each
predicted token is put into one of `buckets` equal-width position buckets. The same windows are scored
by every method, so their numbers compare directly.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from ..errors import ConfigError
from ..texts import read_text, text_files
from .common import RESULTS_DEFAULT, output_dir, MethodRun, applied, begin_run, default_name, format_table, load_model, pyplot, size_label, write_result

LOSS_CHUNK = 1024  # tokens per chunk of the output projection (keeps [chunk, vocab] logits small)


def load_texts(
    text: str | Path | Sequence[str | Path] | None = None,
    dataset: str | None = None,
    split: str = "test",
    field: str = "text",
    max_docs: int | None = None,
    option: str = "--text",
) -> list[str]:
    """Documents from `text` (a file, a folder of text files read as `texts.text_files` reads it, without the
    folder's LICENSE / README notes, or a list of those) or from a dataset. `option` names the source in errors."""
    if (text is None) == (dataset is None):
        raise ConfigError("give exactly one text source: --text FILE|DIR or --dataset NAME (with --split, --field)")
    docs: list[str] = []
    if text is not None:
        sources = [text] if isinstance(text, (str, Path)) else list(text)
        for src in sources:
            docs += [read_text(f, option) for f in text_files(src, option=option, skip_meta=True)]
    else:
        docs = _dataset_texts(dataset, split, field, max_docs)
    docs = [d for d in docs if d.strip()]
    if max_docs is not None:
        docs = docs[:max_docs]
    if not docs:
        raise ConfigError("the text source holds no text")
    return docs


def _dataset_texts(name: str, split: str, field: str, max_docs: int | None) -> list[str]:
    try:
        import datasets
    except ImportError:  # pragma: no cover - a declared dependency
        raise ConfigError("--dataset needs the datasets package: pip install datasets") from None
    try:
        p = Path(name)
        saved = ("dataset_dict.json", "dataset_info.json", "state.json")
        if p.is_dir() and any((p / f).exists() for f in saved):
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ConfigError(f"dataset {name} has no split {split!r}; splits: {', '.join(ds)}")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(name, split=split)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"could not load dataset {name!r} split {split!r} ({msg}); check the name and split, or pass --text FILE|DIR"
        ) from None
    if field not in ds.column_names:
        raise ConfigError(f"dataset {name} has no field {field!r}; fields: {', '.join(ds.column_names)}; use --field")
    n = len(ds) if max_docs is None else min(len(ds), max_docs)
    return [str(ds[i][field]) for i in range(n)]


def token_stream(tokenizer, docs: Sequence[str]) -> list[int]:
    """All documents tokenised and joined by EOS (BOS in front when the tokenizer has one)."""
    ids: list[int] = []
    if tokenizer.bos_token_id is not None:
        ids.append(tokenizer.bos_token_id)
    for i, d in enumerate(docs):
        if i and tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        ids += tokenizer(d, add_special_tokens=False)["input_ids"]
    return ids


def windows(stream: Sequence[int], context: int, max_windows: int) -> list[list[int]]:
    n = min(len(stream) // context, max_windows)
    return [list(stream[i * context : (i + 1) * context]) for i in range(n)]


def token_losses(model, input_ids) -> "torch.Tensor":  # noqa: F821
    """Per-token negative log-likelihood `[S - 1]` (fp32) of one sequence `[1, S]`, without a cache.

    The output projection runs in chunks of LOSS_CHUNK positions so that no `[S, vocab]` logits exist.
    """
    import torch
    import torch.nn.functional as F

    from ..architectures import base_model

    decoder = base_model(model)
    head = model.get_output_embeddings()
    with torch.no_grad():
        hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state[0]
        targets = input_ids[0, 1:]
        out = []
        for a in range(0, hidden.shape[0] - 1, LOSS_CHUNK):
            b = min(a + LOSS_CHUNK, hidden.shape[0] - 1)
            logits = head(hidden[a:b]).float()
            out.append(F.cross_entropy(logits, targets[a:b], reduction="none"))
    return torch.cat(out)


def run_ppl(
    model,
    methods: Sequence[MethodRun],
    docs: Sequence[str],
    *,
    contexts: Sequence[int] = (2048, 8192),
    max_windows: int = 4,
    buckets: int = 8,
    out_dir=RESULTS_DEFAULT,
    name: str | None = None,
    model_name: str | None = None,
    source: str = "",
    command: str | None = None,
    progress: bool = True,
    echo=print,
) -> dict[str, Any]:
    """Perplexity and loss by position for every method at every context; writes `<name>.json` + `.png`."""
    import torch
    from ..progress import progress_iter

    if buckets < 1:
        raise ConfigError(f"--buckets must be >= 1 (got {buckets})")
    if max_windows < 1:
        raise ConfigError(f"--windows must be >= 1 (got {max_windows})")
    model_name = begin_run(model, model_name)
    mdl, tok = load_model(model)
    stream = token_stream(tok, docs)
    per_ctx = {C: windows(stream, C, max_windows) for C in contexts}
    short = [C for C, w in per_ctx.items() if not w]
    if short:
        raise ConfigError(
            f"the text has {len(stream)} tokens, fewer than the context {size_label(max(short))}; give more text or a shorter --context"
        )
    device = next(mdl.parameters()).device
    labels = [r.label for r in methods]
    ppl: dict[str, dict[str, float]] = {}
    nll: dict[str, dict[str, float]] = {}
    by_pos: dict[str, dict[str, Any]] = {}
    was_training = mdl.training
    mdl.eval()
    try:
        for run in methods:
            ppl[run.label], nll[run.label], by_pos[run.label] = {}, {}, {}
            with applied(mdl, run):
                for C, wins in per_ctx.items():
                    edges = [round(i * C / buckets) for i in range(buckets + 1)]
                    sums = torch.zeros(buckets, dtype=torch.float64)
                    counts = torch.zeros(buckets, dtype=torch.float64)
                    bucket_of = torch.bucketize(torch.arange(1, C), torch.tensor(edges[1:-1]), right=True)
                    for w in progress_iter(wins, f"ppl {run.label} {size_label(C)}", enabled=progress, unit="windows"):
                        losses = token_losses(mdl, torch.tensor([w], device=device)).double().cpu()
                        sums.index_add_(0, bucket_of, losses)
                        counts.index_add_(0, bucket_of, torch.ones_like(losses))
                    mean = (sums.sum() / counts.sum()).item()
                    nll[run.label][size_label(C)] = round(mean, 5)
                    ppl[run.label][size_label(C)] = round(math.exp(mean), 4)
                    by_pos[run.label][size_label(C)] = {
                        "edges": edges,
                        "loss": [round((s / c).item(), 5) if c > 0 else None for s, c in zip(sums, counts)],
                        "tokens": [int(c) for c in counts],
                    }
    finally:
        mdl.train(was_training)

    ref = next((r.label for r in methods if r.reference), None)
    figures: dict[str, Any] = {
        "text": source,
        "stream_tokens": len(stream),
        "contexts": list(contexts),
        "windows": {size_label(C): len(w) for C, w in per_ctx.items()},
        "buckets": buckets,
        "ppl": ppl,
        "nll": nll,
        "loss_by_position": by_pos,
        "reference": ref,
    }
    if ref is not None:
        figures["nll_delta_vs_reference"] = {
            lab: {c: round(nll[lab][c] - nll[ref][c], 5) for c in nll[lab]} for lab in labels if lab != ref
        }
    echo(ppl_table(figures, labels, contexts))
    result = {"figures": figures}
    out_dir = output_dir(out_dir, "ppl")
    if out_dir is not None:
        stem = name or default_name("ppl", model_name, methods)
        path = write_result(Path(out_dir) / f"{stem}.json", task="ppl", model=model_name, runs=methods, figures=figures, command=command)
        png = plot_loss_by_position(figures, labels, contexts, Path(out_dir) / f"{stem}.png")
        echo(f"wrote {path} and {png}")
        result.update({"json": str(path), "png": str(png)})
    return result


def ppl_table(figures, labels, contexts) -> str:
    ref = figures.get("reference")
    header = ["method"] + [f"ppl@{size_label(C)}" for C in contexts]
    if ref is not None:
        header += [f"dNLL@{size_label(C)}" for C in contexts]
    rows = []
    for lab in labels:
        row = [lab] + [figures["ppl"][lab][size_label(C)] for C in contexts]
        if ref is not None:
            row += [0.0 if lab == ref else figures["nll_delta_vs_reference"][lab][size_label(C)] for C in contexts]
        rows.append(row)
    return format_table(header, rows)


def plot_loss_by_position(figures, labels, contexts, path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.2 * len(contexts), 3.4), squeeze=False)
    for ax, C in zip(axes[0], contexts):
        for lab in labels:
            d = figures["loss_by_position"][lab][size_label(C)]
            mids = [(a + b) / 2 for a, b in zip(d["edges"][:-1], d["edges"][1:])]
            ax.plot(mids, d["loss"], marker="o", ms=3, label=lab)
        ax.set_title(f"context {size_label(C)}", fontsize=9)
        ax.set_xlabel("position (tokens)")
        ax.set_ylabel("mean loss (nats)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["load_texts", "token_stream", "windows", "token_losses", "run_ppl", "plot_loss_by_position"]
