"""In-context learning (ICL): linear regression with several hidden functions in one long sequence.

Per sequence, ``F`` weight vectors ``w_1 .. w_F`` (``dim`` entries, i.i.d. N(0, 1/dim)) are drawn afresh;
the sequence is cut into segments of ``segment`` examples, each segment drawn from one function chosen at
random. An example is two positions: an *x token* (function tag, ``x`` ~ N(0, I)) at which the model predicts
``y = w_f . x + noise``, then a *y token* (tag, ``y``) that reveals the answer. The tag says which function an
example belongs to, but not the weights: the model must learn ``w_f`` in context from the earlier examples
of the same tag (scattered over the whole sequence), so the task mixes recall (find the tag's examples) and
regression. ``Var(y) = 1``: predicting 0 scores 1.0, a perfect learner approaches ``noise**2``.

Inputs per position: ``tags [B, L]`` (long, ``0..F-1``, a learned embedding) and ``feats [B, L, dim + 2]``
(``[x, 0, 1]`` on x tokens, ``[0, y, 0]`` on y tokens, ``x`` and ``0`` of width ``dim``). Targets and a mask select
the x tokens; ``fn`` and ``shots`` (how many earlier examples of the same function the sequence holds) index
the per-function error curve.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from ...errors import ConfigError

MAX_FUNCTIONS = 128


@dataclass
class IclConfig:
    num_functions: int = 16  # F, up to 128
    dim: int = 8
    segment: int = 4  # examples per segment (a segment uses one function)
    noise: float = 0.0
    shot_bins: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64)  # left edges of the shot bins of the curve
    learned_shots: int = 0  # 0 = 2 * dim: a function counts as learned when its error after this many shots...
    learned_threshold: float = 0.2  # ...is below this (normalised MSE; 1.0 = predicting 0)

    def validate(self) -> "IclConfig":
        if not 1 <= self.num_functions <= MAX_FUNCTIONS:
            raise ConfigError(f"ICL num_functions must be in 1..{MAX_FUNCTIONS}, got {self.num_functions}")
        if self.dim < 1 or self.segment < 1:
            raise ConfigError(f"ICL dim and segment must be >= 1, got dim={self.dim}, segment={self.segment}")
        if self.noise < 0:
            raise ConfigError(f"ICL noise must be >= 0, got {self.noise}")
        return self

    @property
    def feat_dim(self) -> int:
        return self.dim + 2

    @property
    def min_shots(self) -> int:
        return self.learned_shots or 2 * self.dim


def generate_icl(cfg: IclConfig, length: int, batch: int, seed: int) -> dict[str, torch.Tensor]:
    """One batch of multi-function regression sequences of ``length`` positions (``length // 2`` examples).

    Returns ``tags [B, L]``, ``feats [B, L, dim + 2]`` (x token: ``[x, 0, 1]``; y token: ``[0.., y, 0]``),
    ``target [B, L]`` (y at x tokens, 0 elsewhere), ``mask [B, L]`` (True at x tokens), ``fn [B, L]``
    (function index, -1 at y tokens), ``shots [B, L]`` (earlier examples of the same function, -1 at y
    tokens) and ``weights [B, F, dim]``. Deterministic under ``seed``.
    """
    cfg.validate()
    if length < 2:
        raise ConfigError(f"ICL length must be >= 2 (one example is two positions), got {length}")
    g = torch.Generator().manual_seed(int(seed))
    B, F, d = batch, cfg.num_functions, cfg.dim
    n_ex = length // 2
    n_seg = -(-n_ex // cfg.segment)
    w = torch.randn(B, F, d, generator=g) / d ** 0.5
    seg_fn = torch.randint(0, F, (B, n_seg), generator=g)
    ex_fn = seg_fn.repeat_interleave(cfg.segment, dim=1)[:, :n_ex]               # [B, n_ex]
    x = torch.randn(B, n_ex, d, generator=g)
    y = (x * w.gather(1, ex_fn[..., None].expand(B, n_ex, d))).sum(-1)
    if cfg.noise > 0:
        y = y + cfg.noise * torch.randn(B, n_ex, generator=g)
    onehot = torch.nn.functional.one_hot(ex_fn, F)
    ex_shots = (onehot.cumsum(1) - onehot).gather(2, ex_fn[..., None]).squeeze(-1)  # earlier examples of f
    L = length
    tags = torch.zeros(B, L, dtype=torch.long)
    feats = torch.zeros(B, L, d + 2)
    target = torch.zeros(B, L)
    mask = torch.zeros(B, L, dtype=torch.bool)
    fn = torch.full((B, L), -1, dtype=torch.long)
    shots = torch.full((B, L), -1, dtype=torch.long)
    xs, ys = slice(0, 2 * n_ex, 2), slice(1, 2 * n_ex, 2)
    tags[:, xs] = ex_fn
    tags[:, ys] = ex_fn
    feats[:, xs, :d] = x
    feats[:, xs, d + 1] = 1.0
    feats[:, ys, d] = y
    target[:, xs] = y
    mask[:, xs] = True
    fn[:, xs] = ex_fn
    shots[:, xs] = ex_shots
    return {"tags": tags, "feats": feats, "target": target, "mask": mask, "fn": fn, "shots": shots, "weights": w}


def least_squares_error(batch: dict[str, torch.Tensor], cfg: IclConfig, ridge: float = 1e-3) -> torch.Tensor:
    """Per-x-token squared error of the ideal in-context learner: ridge regression on the earlier examples
    of the same function (``[B, L]``, 0 off the x tokens). A reference curve for the tables and a check that
    the answers are recoverable from the sequence."""
    tags, feats, mask = batch["tags"], batch["feats"], batch["mask"]
    d = cfg.dim
    B, L = tags.shape
    err = torch.zeros(B, L, dtype=torch.float64)
    for b in range(B):
        seen_x: dict[int, list] = {}
        seen_y: dict[int, list] = {}
        for t in range(0, L - 1, 2):
            if not bool(mask[b, t]):
                continue
            f = int(tags[b, t])
            x = feats[b, t, :d].double()
            xs, ys = seen_x.setdefault(f, []), seen_y.setdefault(f, [])
            if xs:
                X = torch.stack(xs)
                Y = torch.tensor(ys, dtype=torch.float64)
                A = X.T @ X + ridge * torch.eye(d, dtype=torch.float64)
                w_hat = torch.linalg.solve(A, X.T @ Y)
                pred = float(x @ w_hat)
            else:
                pred = 0.0
            y = float(feats[b, t + 1, d])
            err[b, t] = (pred - y) ** 2
            xs.append(x)
            ys.append(y)
    return err


@dataclass
class IclTask:
    """The ICL task as the trainer in :mod:`.train` sees it."""

    config: IclConfig = field(default_factory=IclConfig)
    name: str = "icl"

    def __post_init__(self):
        self.config.validate()
        self.config.shot_bins = tuple(int(s) for s in self.config.shot_bins)

    @property
    def vocab_size(self) -> int:
        return MAX_FUNCTIONS

    @property
    def feat_dim(self) -> int:
        return self.config.feat_dim

    out_dim: int = 1

    def check_lengths(self, lengths: Sequence[int]) -> None:
        for L in lengths:
            if L < 2:
                raise ConfigError(f"ICL length must be >= 2, got {L}")

    def sample(self, length: int, batch: int, seed: int) -> dict[str, torch.Tensor]:
        return generate_icl(self.config, length, batch, seed)

    @staticmethod
    def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"tokens": batch["tags"], "feats": batch["feats"]}

    @staticmethod
    def loss(out: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        pred = out[..., 0].float()
        m = batch["mask"]
        return ((pred - batch["target"]) ** 2)[m].mean()

    def metric_sums(self, out: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        pred = out[..., 0].float()
        m = batch["mask"]
        se = ((pred - batch["target"]) ** 2).masked_fill(~m, 0.0)
        cfg = self.config
        sums: dict[str, float] = {"se": float(se.sum()), "count": float(m.sum())}
        edges = list(cfg.shot_bins)
        shots = batch["shots"]
        for i, lo in enumerate(edges):
            hi = edges[i + 1] if i + 1 < len(edges) else None
            sel = m & (shots >= lo) & ((shots < hi) if hi is not None else True)
            sums[f"bin{i}_se"] = float(se[sel].sum())
            sums[f"bin{i}_n"] = float(sel.sum())
        late = m & (shots >= cfg.min_shots)
        fn = batch["fn"].clamp_min(0)
        F = cfg.num_functions
        per_se = torch.zeros(F, dtype=torch.float64, device=se.device).index_add_(0, fn[late], se[late].double())
        per_n = torch.zeros(F, dtype=torch.float64, device=se.device).index_add_(
            0, fn[late], torch.ones_like(se[late], dtype=torch.float64))
        per_se, per_n = per_se.cpu(), per_n.cpu()
        for f in range(F):
            sums[f"fn{f}_se"] = float(per_se[f])
            sums[f"fn{f}_n"] = float(per_n[f])
        return sums

    def finish(self, sums: dict[str, float]) -> dict[str, Any]:
        cfg = self.config
        curve = []
        for i, lo in enumerate(cfg.shot_bins):
            n = sums.get(f"bin{i}_n", 0.0)
            curve.append({"shots_from": lo, "mse": (sums[f"bin{i}_se"] / n) if n else None, "n": int(n)})
        per_fn = []
        for f in range(cfg.num_functions):
            n = sums.get(f"fn{f}_n", 0.0)
            per_fn.append((sums[f"fn{f}_se"] / n) if n else None)
        measured = [e for e in per_fn if e is not None]
        learned = sum(1 for e in measured if e < cfg.learned_threshold)
        return {
            "mse": sums["se"] / max(sums["count"], 1.0),
            "mse_by_shots": curve,
            "mse_per_function": per_fn,
            "functions_learned": learned,
            "functions_measured": len(measured),
            "learned_fraction": learned / len(measured) if measured else None,
        }

    primary = "mse"
    higher_is_better = False

    def describe(self) -> dict[str, Any]:
        return {"task": self.name, **asdict(self.config)}


__all__ = ["IclConfig", "IclTask", "generate_icl", "least_squares_error", "MAX_FUNCTIONS"]
