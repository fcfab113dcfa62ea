"""Training text: reading (`--text FILE|DIR`, `--dataset NAME`), tokenisation, packing, batch order.

Documents are tokenised one by one, each ended with the tokenizer's EOS token, concatenated into one
stream and cut into fixed-length chunks (the remainder is dropped). The last `eval_fraction` of the chunks
is held out for evaluation. Batches are drawn from a seeded permutation of the chunks per epoch, so the
batch of any micro-step is known without replaying the earlier ones (exact resume) and is identical on
every process (each process takes its own slice of the global batch).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch

from ..errors import ConfigError
from ..texts import read_text, text_files

TOKENIZE_BATCH = 64  # documents per tokenizer call (tokenize_documents)


def read_text_documents(path: str | os.PathLike) -> list[str]:
    docs = []
    for f in text_files(path):
        text = read_text(f)
        if text.strip():
            docs.append(text)
    if not docs:
        raise ConfigError(f"--text {str(path)!r}: the files are empty")
    return docs


def read_dataset_documents(name: str, split: str = "train", field: str = "text") -> list[str]:
    """Rows of a local Hugging Face dataset: a `save_to_disk` folder, a folder of data files, or a cached name."""
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is a dependency
        raise ConfigError("--dataset needs the `datasets` package: pip install datasets") from e
    p = Path(name).expanduser()
    try:
        if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists() or (p / "state.json").exists()):
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ConfigError(f"--dataset {name!r}: no split {split!r}; splits: {', '.join(ds)}")
                ds = ds[split]
        elif p.is_file():
            fmt = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}.get(p.suffix.lower())
            if fmt is None:
                raise ConfigError(f"--dataset {name!r}: unknown file type; use .jsonl, .json, .csv, .parquet or .txt")
            ds = datasets.load_dataset(fmt, data_files=str(p), split=split if split == "train" else "train")
        else:
            ds = datasets.load_dataset(str(p) if p.exists() else name, split=split)
    except ConfigError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ValueError ...)
        raise ConfigError(
            f"--dataset {name!r} (split {split!r}) could not be loaded: {type(e).__name__}: {e}. "
            "Pass a local dataset folder (datasets' save_to_disk), a .jsonl/.csv/.parquet file, or a name cached locally"
        ) from None
    if field not in ds.column_names:
        raise ConfigError(f"--dataset {name!r}: no column {field!r}; pass --field with one of: {', '.join(ds.column_names)}")
    docs = [t for t in ds[field] if isinstance(t, str) and t.strip()]
    if not docs:
        raise ConfigError(f"--dataset {name!r}: column {field!r} holds no text")
    return docs


def tokenize_documents(
    docs: Iterable[str], tokenizer, *, add_eos: bool = True, max_tokens: int | None = None
) -> torch.Tensor:
    """Concatenated token ids of all documents, 1-D int64. Stops once `max_tokens` are collected. Documents are
    tokenised `TOKENIZE_BATCH` at a time: a fast tokenizer encodes a batch on all cores (the same ids as one document
    at a time; 12M tokens of code and prose take seconds on a 16-core host instead of minutes)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if add_eos and eos is None:
        raise ConfigError("the tokenizer has no EOS token; set data.add_eos=false")
    parts: list[torch.Tensor] = []
    total = 0
    old_max = getattr(tokenizer, "model_max_length", None)
    try:
        if old_max is not None:
            tokenizer.model_max_length = int(1e30)  # documents longer than the model's context are fine here
        it = iter(docs)
        while max_tokens is None or total < max_tokens:
            batch = list(itertools.islice(it, TOKENIZE_BATCH))
            if not batch:
                break
            for ids in tokenizer(batch, add_special_tokens=True)["input_ids"]:
                if add_eos and (not ids or ids[-1] != eos):
                    ids = list(ids) + [eos]
                t = torch.tensor(ids, dtype=torch.long)
                parts.append(t)
                total += t.numel()
                if max_tokens is not None and total >= max_tokens:
                    break
    finally:
        if old_max is not None:
            tokenizer.model_max_length = old_max
    if not parts:
        return torch.zeros(0, dtype=torch.long)
    ids = torch.cat(parts)
    return ids[:max_tokens] if max_tokens is not None else ids


def text_record(ids: torch.Tensor, source: str | None, documents: int) -> dict:
    """What a stage read, for its log and for --resume's check: the text source as given, its documents, tokens and
    the sha256 of the token stream (int64, native byte order). Two runs that read the same text with the same
    tokenizer give the same record; another folder, another tokenizer or changed files give another sha256."""
    import hashlib

    flat = ids.detach().to("cpu", torch.int64).contiguous()
    return {"source": source, "documents": int(documents), "tokens": int(flat.numel()),
            "sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest()}


def pack(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[N, seq_len] chunks of a 1-D token stream; the incomplete tail is dropped."""
    n = ids.numel() // seq_len
    return ids[: n * seq_len].view(n, seq_len)


@dataclass
class PackedData:
    """Train and held-out chunks of one sequence length."""

    train: torch.Tensor  # [N, seq_len]
    eval: torch.Tensor  # [M, seq_len]

    @property
    def seq_len(self) -> int:
        return self.train.shape[1]


def split_chunks(chunks: torch.Tensor, eval_fraction: float) -> PackedData:
    n = chunks.shape[0]
    n_eval = int(round(n * eval_fraction)) if eval_fraction > 0 else 0
    if eval_fraction > 0 and n_eval == 0 and n >= 2:
        n_eval = 1
    return PackedData(train=chunks[: n - n_eval], eval=chunks[n - n_eval :])


def make_packed(ids: torch.Tensor, seq_len: int, eval_fraction: float, min_train: int = 1) -> PackedData:
    chunks = pack(ids, seq_len)
    data = split_chunks(chunks, eval_fraction)
    if data.train.shape[0] < min_train:
        raise ConfigError(
            f"the text gives {ids.numel()} tokens = {chunks.shape[0]} chunks of seq_len {seq_len} "
            f"({data.train.shape[0]} for training after holding out {data.eval.shape[0]}); need at least {min_train}: "
            "give more text, or lower seq_len / batch_size / data.eval_fraction with --set"
        )
    return data


class BatchOrder:
    """Which chunks form global micro-batch `m`: positions m*B .. m*B+B-1 of an endless stream of per-epoch
    permutations (seeded by `seed` and the epoch number)."""

    def __init__(self, n_chunks: int, batch_size: int, seed: int):
        if n_chunks < 1:
            raise ConfigError("no training chunks; give more text")
        self.n = n_chunks
        self.batch_size = batch_size
        self.seed = seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.n, generator=g)
            for old in [e for e in self._perms if e < epoch - 1]:
                del self._perms[old]
        return self._perms[epoch]

    def indices(self, micro_step: int) -> list[int]:
        out = []
        for pos in range(micro_step * self.batch_size, (micro_step + 1) * self.batch_size):
            epoch, i = divmod(pos, self.n)
            out.append(int(self._perm(epoch)[i]))
        return out

    def epoch_of(self, micro_step: int) -> float:
        return micro_step * self.batch_size / self.n


def local_slice(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This process's rows of a global batch (contiguous blocks; B must be divisible by the world size)."""
    B = batch.shape[0]
    if B % world:
        raise ConfigError(f"batch_size {B} is not divisible by the {world} processes; set a multiple of {world}")
    per = B // world
    return batch[rank * per : (rank + 1) * per]


def load_documents(text: str | None, dataset: str | None, split: str, field: str) -> list[str]:
    if text and dataset:
        raise ConfigError("give one text source: --text or --dataset, not both")
    if text:
        return read_text_documents(text)
    if dataset:
        return read_dataset_documents(dataset, split, field)
    raise ConfigError("no training text; pass --text FILE|DIR or --dataset NAME (or set data.text in the recipe)")


__all__: Sequence[str] = [
    "BatchOrder",
    "PackedData",
    "load_documents",
    "local_slice",
    "make_packed",
    "pack",
    "read_dataset_documents",
    "read_text_documents",
    "split_chunks",
    "text_files",
    "text_record",
    "tokenize_documents",
]
