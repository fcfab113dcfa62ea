"""In-context recall (ICR): multi-query associative recall (MQAR, Zoology style), "basic" and "positional".

Token layout of the vocabulary (``IcrConfig``): ``0`` pad / filler, ``1`` FIRST, ``2`` SECOND (positional
selectors), keys ``[KEY0, KEY0 + num_keys)``, values ``[VAL0, VAL0 + num_values)``, filler noise
``[NOISE0, NOISE0 + num_noise)``.

basic
    Context: ``P`` key/value pairs ``k_1 v_1 ... k_P v_P`` with distinct keys. Then the rest of the sequence
    is filler noise into which queries ``k_i v_i`` are inserted (every key queried once, random order, random
    places). The model reads ``k_i`` and must predict ``v_i``: the label sits at the query key's position
    (next-token prediction), every other position is ignored (``-100``).
positional
    Context: ``P`` pair slots holding ``P // 2`` distinct keys, each key twice with two different values, in
    random order. Queries are ``SEL k_i v`` with ``SEL`` FIRST or SECOND: the answer is the value the key had
    at its first (or second) occurrence, so it depends on *where* the key occurred.

The number of pairs scales with the length: ``P = max(4, length // tokens_per_pair)`` (``tokens_per_pair``
16 by default: 32 pairs at 512, 256 at 4k, 512 at 8k). Generation is deterministic under a seed
(a ``torch.Generator`` on the CPU).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from ...errors import ConfigError

IGNORE = -100
PAD, FIRST, SECOND = 0, 1, 2
VARIANTS = ("basic", "positional")


@dataclass
class IcrConfig:
    variant: str = "basic"
    num_keys: int = 1024
    num_values: int = 1024
    num_noise: int = 64
    tokens_per_pair: int = 16  # P = length // tokens_per_pair
    queries_per_pair: float = 1.0  # fraction of the keys (basic) / of the (key, occurrence) slots (positional) queried

    def validate(self) -> "IcrConfig":
        if self.variant not in VARIANTS:
            raise ConfigError(f"ICR variant {self.variant!r} is unknown; choose from: {', '.join(VARIANTS)}")
        for name in ("num_keys", "num_values", "num_noise", "tokens_per_pair"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ICR {name} must be >= 1, got {getattr(self, name)}")
        if self.tokens_per_pair < 6:
            raise ConfigError(f"ICR tokens_per_pair must be >= 6 (room for the context and the queries), got {self.tokens_per_pair}")
        if not 0 < self.queries_per_pair <= 1:
            raise ConfigError(f"ICR queries_per_pair must be in (0, 1], got {self.queries_per_pair}")
        if self.variant == "positional" and self.num_values < 2:
            raise ConfigError("positional ICR needs num_values >= 2 (two different values per key)")
        return self

    # vocabulary layout
    @property
    def key0(self) -> int:
        return 3

    @property
    def val0(self) -> int:
        return 3 + self.num_keys

    @property
    def noise0(self) -> int:
        return 3 + self.num_keys + self.num_values

    @property
    def vocab_size(self) -> int:
        return self.noise0 + self.num_noise

    def num_pairs(self, length: int) -> int:
        p = max(4, length // self.tokens_per_pair)
        if self.variant == "positional":
            p -= p % 2
        return p

    def check_length(self, length: int) -> None:
        p = self.num_pairs(length)
        distinct = p if self.variant == "basic" else p // 2
        if distinct > self.num_keys:
            raise ConfigError(
                f"ICR at length {length} needs {distinct} distinct keys but num_keys is {self.num_keys}; "
                f"raise num_keys or tokens_per_pair")
        n_q = self.num_queries(length)
        qlen = 2 if self.variant == "basic" else 3
        if 2 * p + qlen * n_q > length:
            raise ConfigError(f"ICR length {length} is too short for {p} pairs and {n_q} queries; raise tokens_per_pair")

    def num_queries(self, length: int) -> int:
        p = self.num_pairs(length)
        return max(1, int(round(self.queries_per_pair * p)))


def _sample_one(cfg: IcrConfig, length: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    P = cfg.num_pairs(length)
    n_q = cfg.num_queries(length)
    ids = torch.randint(cfg.noise0, cfg.noise0 + cfg.num_noise, (length,), generator=g)
    labels = torch.full((length,), IGNORE, dtype=torch.long)
    if cfg.variant == "basic":
        keys = torch.randperm(cfg.num_keys, generator=g)[:P] + cfg.key0
        vals = torch.randint(0, cfg.num_values, (P,), generator=g) + cfg.val0
        ids[0:2 * P:2] = keys
        ids[1:2 * P:2] = vals
        asked = torch.randperm(P, generator=g)[:n_q]
        blocks = torch.stack([keys[asked], vals[asked]], 1)                      # [n_q, 2]
    else:
        n_k = P // 2
        keys = torch.randperm(cfg.num_keys, generator=g)[:n_k] + cfg.key0
        # two different values per key: v2 = v1 + shift (mod num_values), shift in [1, num_values)
        v1 = torch.randint(0, cfg.num_values, (n_k,), generator=g)
        shift = torch.randint(1, cfg.num_values, (n_k,), generator=g)
        v2 = (v1 + shift) % cfg.num_values
        order = torch.randperm(P, generator=g)  # the 2 n_k (key, occurrence) items in slot order
        slot_key = torch.cat([torch.arange(n_k), torch.arange(n_k)])[order]
        # slots grouped by key, in increasing slot order: the earlier slot of a key holds its first value
        by_key = torch.argsort(slot_key * P + torch.arange(P))
        slot_val = torch.empty(P, dtype=torch.long)
        slot_val[by_key[0::2]] = v1
        slot_val[by_key[1::2]] = v2
        ids[0:2 * P:2] = keys[slot_key]
        ids[1:2 * P:2] = slot_val + cfg.val0
        asked = torch.randperm(P, generator=g)[:n_q]  # (key, occurrence) items: item j < n_k first, else second
        kidx, second = asked % n_k, asked >= n_k
        sel = torch.where(second, torch.tensor(SECOND), torch.tensor(FIRST))
        blocks = torch.stack([sel, keys[kidx], torch.where(second, v2[kidx], v1[kidx]) + cfg.val0], 1)  # [n_q, 3]
    qlen = blocks.shape[1]
    # place the query blocks at random, non-overlapping places of the tail (stars and bars)
    free = length - 2 * P - qlen * n_q  # filler tokens in the tail
    picks = torch.sort(torch.randperm(free + n_q, generator=g)[:n_q]).values
    starts = 2 * P + picks + torch.arange(n_q) * (qlen - 1)
    pos = starts[:, None] + torch.arange(qlen)[None, :]
    ids[pos.flatten()] = blocks.flatten()
    labels[starts + qlen - 2] = blocks[:, -1]  # predicted when reading the key, i.e. the token before the answer
    return ids, labels


def generate_icr(cfg: IcrConfig, length: int, batch: int, seed: int) -> dict[str, torch.Tensor]:
    """``{"input_ids": [batch, length], "labels": [batch, length]}`` (labels -100 except at query keys).

    ``labels[b, t]`` is the answer token, which is also ``input_ids[b, t + 1]``.
    Deterministic: the same (config, length, batch, seed) gives the same tensors.
    """
    cfg.validate()
    cfg.check_length(length)
    g = torch.Generator().manual_seed(int(seed))
    ids, labels = zip(*(_sample_one(cfg, length, g) for _ in range(batch)))
    return {"input_ids": torch.stack(ids), "labels": torch.stack(labels)}


def recover_answers(cfg: IcrConfig, input_ids: torch.Tensor) -> torch.Tensor:
    """Recomputes the labels of one sequence ``[L]`` from its tokens alone (used by the tests).

    Reads the ``P`` context pairs, then finds every query (a key token after the context, preceded by a
    selector in the positional variant) and looks its answer up in the context.
    """
    L = input_ids.shape[0]
    P = cfg.num_pairs(L)
    ids = input_ids.tolist()
    first: dict[int, int] = {}
    second: dict[int, int] = {}
    for i in range(P):
        k, v = ids[2 * i], ids[2 * i + 1]
        if k in first:
            second[k] = v
        else:
            first[k] = v
    out = torch.full((L,), IGNORE, dtype=torch.long)
    for t in range(2 * P, L - 1):
        k = ids[t]
        if not cfg.key0 <= k < cfg.val0:
            continue
        if cfg.variant == "basic":
            out[t] = first[k]
        else:
            out[t] = second[k] if ids[t - 1] == SECOND else first[k]
    return out


# ------------------------------------------------------------------------------------------------- task
@dataclass
class IcrTask:
    """The ICR task as the trainer in :mod:`.train` sees it."""

    config: IcrConfig = field(default_factory=IcrConfig)
    name: str = "icr"

    def __post_init__(self):
        self.config.validate()

    # model interface
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    feat_dim: int = 0

    @property
    def out_dim(self) -> int:
        return self.config.vocab_size

    def check_lengths(self, lengths: Sequence[int]) -> None:
        for L in lengths:
            self.config.check_length(L)

    def sample(self, length: int, batch: int, seed: int) -> dict[str, torch.Tensor]:
        return generate_icr(self.config, length, batch, seed)

    @staticmethod
    def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"tokens": batch["input_ids"]}

    @staticmethod
    def loss(out: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]
        return torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)

    @staticmethod
    def metric_sums(out: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        labels = batch["labels"]
        m = labels != IGNORE
        correct = (out.argmax(-1) == labels) & m
        return {"correct": float(correct.sum()), "count": float(m.sum())}

    @staticmethod
    def finish(sums: dict[str, float]) -> dict[str, Any]:
        return {"accuracy": sums["correct"] / max(sums["count"], 1.0), "answers": int(sums["count"])}

    primary = "accuracy"
    higher_is_better = True

    def describe(self) -> dict[str, Any]:
        return {"task": self.name, **asdict(self.config)}


__all__ = ["IcrConfig", "IcrTask", "generate_icr", "recover_answers", "IGNORE", "VARIANTS"]
