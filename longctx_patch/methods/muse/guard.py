"""MuSe's run-time guard: each long prefill measures its own error per head and runs the heads over budget exactly.

MuSe's error is not spread evenly: on Qwen2.5-Coder-0.5B at 32k the cells defaults err 1-4% in most layers and
15-35% in a few, from a few heads whose far attention needs individual keys (docs/muse.md, sections 7 and 9). A
fixed budget cannot know which heads those are on a given text and length, so the guard measures them in the call
(docs/muse.md, section 10):

1. *Sample.* In each batch row, among the A rows MuSe approximates (queries whose earlier keys are not all attended
   exactly: from `first_approximated(config)` tokens after the row's first real token on), `guard_rows` query rows:
   per head the quarter with the largest MuSe output (a take-all stratum: a head's error sits mostly in a few rows of
   large output), and the rest stratified over the A rows, one per stratum of equal width at a fixed low-discrepancy
   offset (the golden-ratio sequence: the positions inside a block vary), standing for the head's other rows
   (`sampled_rows`). A <= guard_rows: every row. Positions count the row's real tokens only, so a padded row samples
   what the prompt alone samples; nothing random is drawn (torch's RNG state is untouched) and the same call samples
   the same rows.
2. *Measure.* Exact causal attention for those rows against all their keys on the call's own q, k, v (in the
   call's dtype with fp32 accumulation: what the head made exact would compute; `guard_rows` x S per head, about 1%
   of MuSe's key work at 32k; `exact_rows`, on CUDA the split-key decode kernels), compared with MuSe's output for
   the same rows. A
   head's estimated error is the weighted ratio `sqrt(sum_i w_i |o_i - o*_i|^2 / sum_i w_i |o*_i|^2)` (w_i: 1 for a
   top row, else the rows its stratum stands for): the relative L2 error of the head's output over the approximated
   rows (its whole-call error, which the early exact rows dilute, is at most this).
3. *Act.* Every (batch row, head) whose estimate exceeds `guard_error` gets exact attention for this call
   (`with_exact_heads`, the machinery of a calibration's `exact_heads`); the other heads keep MuSe's output
   untouched. Heads already exact (`exact_heads`) are not measured.

Nothing of a call is kept on the module or the model: its decisions live in the call (what is kept, shared by all
calls, is the sample's constant positions and weights per length on the device, so that an unpadded call copies
nothing from the host and reads nothing back but its decisions). `guard_log()` records what the
guard did in the current thread (or asyncio task) as `GuardCall`s, for a user who wants to see it.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from ...kernels.decode.ops import decode_kernel_supported, launch_masked_few_query
from ...kernels.muse.support import guard_kernels_missing
from .heads import with_exact_heads

GUARD_ERROR = 0.1  # guard_error's default (docs/muse.md, section 10: why)
GUARD_ROWS = 64  # guard_rows' default
TOP_SHARE = 4  # a quarter of the sampled rows are each head's rows of largest MuSe output (sampled_rows)
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # the offsets' low-discrepancy step


# --------------------------------------------------------------------------------------------- what is sampled
def first_approximated(config) -> int:
    """The first token (counted from a row's first real token) whose query MuSe does not attend exactly to every
    earlier key under `config` (a MuseConfig): a query of block n attends its own block and `local_blocks` before it
    exactly, and the cells plans also the `sink_blocks` first ones and `topk_blocks + peak_blocks` retrieved ones
    (the tilted design `topk_blocks` per query cluster), so block n approximates once it has more earlier blocks
    than those."""
    L = config.get("block_size")
    if config.far_field == "tilted":
        exact = config.local_blocks + config.get("topk_blocks")
    else:
        exact = config.sink_blocks + config.local_blocks + config.get("topk_blocks") + config.get("peak_blocks")
    return (exact + 1) * L


def sample_ranks(n_real: int, first: int, rows: int) -> tuple[list[int], list[int]]:
    """(ranks, weights): the query rows the guard samples in a row of `n_real` real tokens, as ranks among them
    (0 = the first real token), and each one's stratum width. The approximated ranks [first, n_real) are cut into
    `rows` strata of equal width (to one token); stratum i is sampled at the fraction frac(0.5 + i * 0.618...) of
    its width. Fewer approximated ranks than `rows`: every one, weight 1. None: ([], [])."""
    a = n_real - first
    if a <= 0 or rows <= 0:
        return [], []
    if a <= rows:
        return list(range(first, n_real)), [1] * a
    ranks, weights = [], []
    for i in range(rows):
        lo, hi = first + (i * a) // rows, first + ((i + 1) * a) // rows
        u = (0.5 + i * _GOLDEN) % 1.0
        ranks.append(lo + min(int(u * (hi - lo)), hi - lo - 1))
        weights.append(hi - lo)
    return ranks, weights


# --------------------------------------------------------------------------------------------- the record
@dataclass
class GuardCall:
    """What the guard did in one MuSe call (one layer, one group of batch rows).

    layer: the module's layer index (None at the op level); rows: the batch rows of the call (in the forward's
    batch); tokens: the call's length; budget: guard_error; sampled: per row, the query rows measured (0 where the
    row has none approximated); errors: per row, the estimated error of each query head (None for a head not
    measured: exact already, or nothing approximated); exact: the (batch row, head) pairs given exact attention."""

    layer: int | None
    rows: list[int]
    tokens: int
    budget: float
    sampled: list[int]
    errors: list[list[float | None]]
    exact: list[tuple[int, int]] = field(default_factory=list)

    @property
    def heads(self) -> int:
        return len(self.errors[0]) if self.errors else 0


@dataclass
class GuardLog:
    """The GuardCalls of the MuSe calls run inside `guard_log()`, in order."""

    calls: list[GuardCall] = field(default_factory=list)

    def exact_heads(self) -> dict[int | None, list[int]]:
        """{layer: the heads given exact attention in some row}, layers with none left out."""
        out: dict[int | None, set[int]] = {}
        for c in self.calls:
            for _, h in c.exact:
                out.setdefault(c.layer, set()).add(h)
        return {layer: sorted(h) for layer, h in out.items()}

    def measured(self) -> int:
        """The (call, row, head) estimates taken."""
        return sum(e is not None for c in self.calls for row in c.errors for e in row)

    def worst(self) -> tuple[float, int | None, int] | None:
        """(the largest estimated error, its layer, its head), or None when nothing was measured."""
        best = None
        for c in self.calls:
            for row in c.errors:
                for h, e in enumerate(row):
                    if e is not None and (best is None or e > best[0]):
                        best = (e, c.layer, h)
        return best

    def summary(self) -> str:
        """One line: how many head estimates, how many over the budget made exact and where, the worst estimate."""
        if not self.calls:
            return "muse guard: no MuSe call (every layer ran exact attention: the prefill is too short)"
        n = self.measured()
        if n == 0:
            return (f"muse guard: {len(self.calls)} MuSe calls, nothing measured (no query row past the exact "
                    "blocks, or the guard is off)")
        exact = sum(len(c.exact) for c in self.calls)
        budget = self.calls[0].budget
        w = self.worst()
        where = "; ".join(f"layer {layer}: heads {','.join(map(str, h))}" for layer, h in sorted(
            self.exact_heads().items(), key=lambda x: -1 if x[0] is None else x[0]))
        return (f"muse guard: {exact} of {n} head estimates over {100 * budget:g}% made exact"
                + (f" ({where})" if where else "") + f"; worst estimate {100 * w[0]:.1f}% (layer {w[1]}, head {w[2]})")

    def table(self) -> str:
        """Per call: layer, rows, tokens, rows sampled, mean and worst head estimate, heads made exact."""
        head = ["layer", "rows", "tokens", "sampled", "mean", "worst", "exact (row:head)"]
        lines = []
        for c in self.calls:
            es = [e for row in c.errors for e in row if e is not None]
            lines.append([str(c.layer), ",".join(map(str, c.rows)), str(c.tokens), ",".join(map(str, c.sampled)),
                          f"{100 * sum(es) / len(es):.2f}%" if es else "-", f"{100 * max(es):.2f}%" if es else "-",
                          " ".join(f"{r}:{h}" for r, h in c.exact) or "-"])
        widths = [max(len(r[i]) for r in [head, *lines]) for i in range(len(head))]
        return "\n".join("  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in [head, *lines])


_LOG: ContextVar[GuardLog | None] = ContextVar("longctx_patch_muse_guard_log", default=None)


@contextmanager
def guard_log():
    """Record what MuSe's guard does in the calls made inside the block, in this thread or asyncio task only
    (a ContextVar: other threads serving the same model record nothing here). Yields the GuardLog.

        with guard_log() as log:
            model(ids)
        print(log.summary())
    """
    log = GuardLog()
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


# --------------------------------------------------------------------------------------------- the guard
# Small constant tensors of the per-call path (a call's sample positions and weights, a mask of the measured heads),
# made on the host once per key and kept on the device: a call then copies nothing from the host and waits for
# nothing. Keyed also on the device and, on CUDA, the current stream, so that a tensor is only read on the stream its
# copy was queued on (the copy is ordered before every read, and the caching allocator's reuse of its memory once it
# is dropped after every read). Shared by the threads of a server (a lock around the table), bounded: the least
# recently used entry goes first.
_CONSTANTS_KEPT = 64
_constants: OrderedDict = OrderedDict()
_constants_lock = threading.Lock()


def _to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor on `dev`: on CUDA through pinned memory, queued without waiting for the device."""
    if dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)


def _constants_on(key: tuple, dev: torch.device, make) -> tuple[torch.Tensor, ...]:
    """The host tensors `make()` returns for `key`, on `dev` (and this thread's current CUDA stream): made and copied
    on the first call, then the kept ones. Read-only: callers never write them."""
    full = (key, dev, torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else None)
    with _constants_lock:
        hit = _constants.get(full)
        if hit is not None:
            _constants.move_to_end(full)
            return hit
    made = tuple(_to_device(t, dev) for t in make())
    with _constants_lock:  # another thread may have made the same meanwhile: equal values, either is kept
        _constants[full] = made
        _constants.move_to_end(full)
        while len(_constants) > _CONSTANTS_KEPT:
            _constants.popitem(last=False)
    return made


def kept_stratified(n_real: int, first: int, rows: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_ranks(n_real, first, rows)` on `dev`: (ranks long [r], weights fp32 [r]), kept (`_constants_on`)."""
    def make():
        ranks, weights = sample_ranks(n_real, first, rows)
        return torch.tensor(ranks, dtype=torch.long), torch.tensor(weights, dtype=torch.float32)

    return _constants_on(("stratified", n_real, first, rows), dev, make)


def top_rows(rows: int) -> int:
    """Of `rows` sampled rows, how many are each head's approximated rows of largest MuSe output norm (the rest
    stratified)."""
    return rows // TOP_SHARE


def _row_norms(o) -> torch.Tensor:
    """|o_t| per row and head in fp32, [B, Hq, S], read from o [B, S, Hq, D] in its own dtype (no fp32 copy of o)."""
    return torch.linalg.vector_norm(o.detach().transpose(1, 2), dim=-1, dtype=torch.float32)


def sampled_rows(o, km, first: int, rows: int):
    """The sample of a call: (positions [B, Hq, m] long, weights [B, Hq, m] fp32, per-row counts), m the most rows a
    batch row samples, or (None, None, counts) when no row has an approximated row. o [B, S, Hq, D] is MuSe's output.

    Per batch row, among its approximated rows (ranks >= first among its real tokens: key_mask True, all S without
    one), of A rows: all of them (weight 1) when A <= rows; else, per head, the `top_rows(rows)` rows of largest
    |o_t| (weight 1: a take-all stratum, since a few rows of large output carry much of a head's error and of its
    norm), and `rows - top_rows(rows)` rows stratified over all A (`sample_ranks`, shared by the heads) standing for
    the other rows: a stratified row that is one of the head's top rows is dropped and the rest scaled to count
    A - top rows. Padding's weight is 0.

    Without a key mask nothing is read back or copied from the host: the stratified rows are kept on the device per
    length (`kept_stratified`; the returned tensors may be views of them: read-only). With one, the rows' real lengths
    are read once (the counts and the sample's width depend on them) and the sample is copied in one piece."""
    if km is None:
        return _sampled_unpadded(o, first, rows)
    B, S, Hq, D = o.shape
    dev = o.device
    n_real = km.sum(1).tolist()  # a padded call's host read: its rows' real lengths
    A = [max(0, n - first) for n in n_real]
    if max(A, default=0) == 0:
        return None, None, [0] * B
    top = top_rows(rows)
    tops = [0 if a <= rows else top for a in A]
    per_row = [sample_ranks(n, first, rows if t == 0 else rows - t) for n, t in zip(n_real, tops)]
    ms, k = max(len(r) for r, _ in per_row), max(tops)
    host = torch.tensor([r + [first] * (ms - len(r)) + w + [0] * (ms - len(w)) + [t, a - t]
                         for (r, w), t, a in zip(per_row, tops, A)], dtype=torch.long)
    packed = _to_device(host, dev)  # [B, 2 ms + 2]: ranks, weights, top rows, the rows they stand for
    ranks, w = packed[:, :ms], packed[:, ms:2 * ms].float()
    cum = km.to(torch.int32).cumsum(1)
    pos = torch.searchsorted(cum, (ranks + 1).to(torch.int32)).clamp_(max=S - 1)
    pos, w = pos[:, None, :].expand(B, Hq, ms), w[:, None, :].expand(B, Hq, ms)
    if k:
        approx = (cum - 1 >= first) & km
        norms = _row_norms(o).masked_fill(~approx[:, None, :], -1.0)  # [B, Hq, S]
        best = norms.topk(k, dim=-1).indices  # [B, Hq, k]
        has = (packed[:, 2 * ms] > 0)[:, None, None]
        taken = (pos[..., None] == best[:, :, None, :]).any(-1) & has  # a stratified row among the top rows
        w = w.masked_fill(taken, 0.0)
        rest = packed[:, 2 * ms + 1, None].float()
        w = w * torch.where(has[..., 0], rest / w.sum(-1).clamp_min(1.0), 1.0)[..., None]
        pos = torch.cat([pos, best], -1)
        w = torch.cat([w, has.float().expand(B, Hq, k)], -1)
    return pos, w, [len(r) + t for (r, _), t in zip(per_row, tops)]


def _unpadded_plan(S: int, first: int, rows: int, dev: torch.device):
    """An unpadded call's sample at length S: (A approximated rows, t top rows per head, the kept stratified ranks
    and weights of the other rows - t), or None when no row is approximated."""
    A = S - first
    if A <= 0:
        return None
    t = 0 if A <= rows else top_rows(rows)
    return (A, t, *kept_stratified(S, first, rows - t, dev))


def _sampled_unpadded(o, first: int, rows: int):
    """`sampled_rows` without a key mask: every batch row has all S tokens real, so one sample serves them all."""
    B, S, Hq, D = o.shape
    plan = _unpadded_plan(S, first, rows, o.device)
    if plan is None:
        return None, None, [0] * B
    A, t, ranks, weights = plan
    ms = ranks.shape[0]
    pos, w = ranks.expand(B, Hq, ms), weights.expand(B, Hq, ms)
    if t:
        best = _row_norms(o[:, first:]).topk(t, dim=-1).indices.add_(first)  # [B, Hq, t]
        taken = (pos[..., None] == best[:, :, None, :]).any(-1)  # a stratified row among the top rows
        w = w.masked_fill(taken, 0.0)
        w = w * torch.div(float(A - t), w.sum(-1).clamp_min(1.0))[..., None]
        pos = torch.cat([pos, best], -1)
        w = torch.cat([w, w.new_ones(B, Hq, t)], -1)
    return pos, w, [ms + t] * B


_MASK_BYTES = 256 << 20  # exact_rows' masks at most this large at once: larger batches go by groups of batch rows


def exact_rows(q, k, v, pos, km, *, scale: float, native: bool = False) -> torch.Tensor:
    """Exact causal attention of the query rows `pos` [B, Hq, m] (columns of q, per query head) against their keys:
    key j for row t when j <= t (and key_mask[b, j]), computed as a head made exact computes it (in the inputs'
    dtype, fp32 accumulation), the result rounded to the inputs' dtype. q [B, Hq, S, D], k/v [B, Hkv, S, D]
    -> [B, Hq, m, D] fp32 (a row with no key, at a padded position: 0).

    Where the split-key Triton kernels run (CUDA; `kernels.decode`), those: a kv group's G x m rows read its keys
    once, the keys split over the GPU's SMs (m rows alone would give SDPA's kernels a few programs each walking every
    key). Elsewhere SDPA with one boolean mask [B, Hkv, G m, S] for the causal limit and the padding (groups of batch
    rows of at most 256 MiB of mask). native: the same values as a [B, Hq, m, D] view in the kernels' dtype where
    they ran (no fp32 copy: for the guard's kernels, which read any dtype)."""
    B, Hq, S, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G, m = Hq // Hkv, pos.shape[2]
    qs = q.gather(2, pos[..., None].expand(B, Hq, m, D))
    if decode_kernel_supported(qs, k, v) is None:
        out = launch_masked_few_query(qs, k, v, scale=scale, key_mask=km, positions=pos).transpose(1, 2)
        if not native:
            out = out.float()
        if km is not None:  # the kernel always lets a row see its own key: a padded row has none
            out = out * km.bool().gather(1, pos.reshape(B, Hq * m)).view(B, Hq, m, 1)
        return out
    R = G * m
    qs = qs.reshape(B, Hkv, R, D)
    limit = pos.reshape(B, Hkv, R, 1)
    kpos = torch.arange(Sk, device=q.device)
    step = max(1, _MASK_BYTES // max(1, Hkv * R * Sk))
    outs = []
    for b0 in range(0, B, step):
        b1 = min(B, b0 + step)
        mask = kpos <= limit[b0:b1]  # [b, Hkv, R, Sk]
        if km is not None:
            mask &= km[b0:b1, None, None, :Sk].bool()
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs[b0:b1], k[b0:b1], v[b0:b1], attn_mask=mask,
                                                                     scale=scale))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(B, Hq, m, v.shape[-1]).float().nan_to_num_(0.0)


def _head_mask(Hq: int, hs: list[int], dev: torch.device):
    """The measured heads as a kept [Hq] bool tensor on `dev`, or None when all are."""
    chosen = sorted(set(hs))
    if chosen == list(range(Hq)):
        return None
    mask, = _constants_on(("heads", Hq, tuple(chosen)), dev, lambda: (torch.tensor([h in chosen for h in range(Hq)]),))
    return mask


def _estimate_kernels(o, q, k, v, km, *, scale: float, first: int, rows: int, hs: list[int]):
    """`estimate_errors` through the guard's Triton kernels (kernels/muse/triton_guard.py): the same sample and
    estimates in a few launches. Without a key mask: the kept stratified ranks and each head's top rows
    (`guard_top_sample`), their exact attention, and the weighted error with the stratified weights rescaled in the
    kernel; with one, `sampled_rows`' sample and weights, then the same two steps."""
    from ...kernels.muse.triton_guard import guard_top_sample, guard_weighted_errors  # Triton: imported where it runs

    B, Hq, S, D = q.shape
    dev = q.device
    hmask = _head_mask(Hq, hs, dev)
    if hmask is not None:
        hmask = hmask.view(torch.uint8)  # a view, no copy: the kernel reads bytes
    if km is not None:
        pos, w, counts = sampled_rows(o, km, first, rows)
        if pos is None:
            return torch.full((B, Hq), float("nan"), device=dev), counts
        ref = exact_rows(q, k, v, pos, km, scale=scale, native=True)
        return guard_weighted_errors(o, ref, pos, w, head_mask=hmask), counts
    plan = _unpadded_plan(S, first, rows, dev)
    if plan is None:
        return torch.full((B, Hq), float("nan"), device=dev), [0] * B
    A, t, ranks, weights = plan
    ms = ranks.shape[0]
    pos = guard_top_sample(o, ranks, first, t) if t else ranks.expand(B, Hq, ms)
    ref = exact_rows(q, k, v, pos, None, scale=scale, native=True)
    err = guard_weighted_errors(o, ref, pos, weights.expand(B, Hq, ms), stratified=ms if t else None,
                                rest=float(A - t), head_mask=hmask)
    return err, [ms + t] * B


def estimate_errors(o, q, k, v, km, *, scale: float, first: int, rows: int, heads=None, kernels: bool | None = None):
    """The guard's estimates for one call: (errors [B, Hq] fp32 (NaN where a row samples nothing), per-row sampled
    counts). o [B, S, Hq, D] is MuSe's output; `heads` the query heads to measure (default all; others NaN).
    Without a key mask it reads nothing back from the device and copies nothing to it (after a length's first
    call). kernels: the guard's Triton kernels (True), the PyTorch ops (False: their reference), or (None) the
    kernels wherever they run (CUDA; the CPU under TRITON_INTERPRET=1)."""
    B, Hq, S, D = q.shape
    dev = q.device
    with torch.no_grad():
        hs = list(range(Hq)) if heads is None else list(heads)
        if hs and (kernels if kernels is not None else guard_kernels_missing(o, top_rows(rows)) is None):
            return _estimate_kernels(o, q, k, v, km, scale=scale, first=first, rows=rows, hs=hs)
        pos, w, counts = sampled_rows(o, km, first, rows) if hs else (None, None, [0] * B)
        if pos is None:
            return torch.full((B, Hq), float("nan"), device=dev), counts
        ref = exact_rows(q, k, v, pos, km, scale=scale)  # [B, Hq, m, D]
        got = o.detach().transpose(1, 2).gather(2, pos[..., None].expand(B, Hq, pos.shape[2], D)).float()
        num = torch.where(w > 0, (got - ref).pow(2).sum(-1) * w, 0.0).sum(-1)  # [B, Hq]
        den = torch.where(w > 0, ref.pow(2).sum(-1) * w, 0.0).sum(-1)
        e = torch.where(den > 0, (num / den.clamp_min(torch.finfo(torch.float32).tiny)).sqrt(),
                        torch.where(num > 0, float("inf"), 0.0).to(num.dtype))
        measured = (w > 0).any(-1)  # [B, Hq]: False in a row that samples nothing (its weights are all 0)
        mask = _head_mask(Hq, hs, dev)
        if mask is not None:
            measured = measured & mask
        err = torch.where(measured, e, float("nan"))
    return err, counts


def guard(o, q, k, v, km, *, config, scale: float, skip=(), layer=None, rows=None, head_offset: int = 0):
    """MuSe's output `o` [B, S, Hq, D] of one call with every (batch row, query head) whose estimated error exceeds
    `config.guard_error` replaced by exact attention (`with_exact_heads`); `o` itself when the guard is off, nothing
    is approximated or no head is over budget. q [B, Hq, S, D], k/v [B, Hkv, S, D], km the call's key mask [B, S]
    or None; skip: the query heads already exact (not measured); layer, rows (the call's rows in the forward's
    batch), head_offset (this rank's first global head): for the record only."""
    budget = config.guard_error
    if not budget:
        return o
    B, Hq, S, _ = q.shape
    heads = [h for h in range(Hq) if h not in set(skip)]
    kernels = None if config.guard_kernels and config.backend != "torch" else False
    err, counts = estimate_errors(o, q, k, v, km, scale=scale, first=first_approximated(config),
                                  rows=config.guard_rows, heads=heads, kernels=kernels)
    errs = err.tolist()  # the one host read of the decision
    bad: dict[tuple[int, ...], list[int]] = {}
    for b in range(B):
        hs = tuple(h for h in heads if errs[b][h] == errs[b][h] and errs[b][h] > budget)  # NaN: not measured
        if hs:
            bad.setdefault(hs, []).append(b)
    log = _LOG.get()
    if log is not None:
        batch = list(range(B)) if rows is None else [int(r) for r in rows]
        log.calls.append(GuardCall(
            layer, batch, S, float(budget), counts,
            [[None if e != e else float(e) for e in row] for row in errs],
            sorted((batch[b], head_offset + h) for hs, bs in bad.items() for b in bs for h in hs)))
    if not bad:
        return o
    for hs, bs in bad.items():
        if len(bs) == B:
            o = with_exact_heads(o, q, k, v, list(hs), scale=scale, key_mask=km)
            continue
        idx = torch.tensor(bs, device=o.device)
        part = with_exact_heads(o.index_select(0, idx), q.index_select(0, idx), k.index_select(0, idx),
                                v.index_select(0, idx), list(hs), scale=scale,
                                key_mask=None if km is None else km.index_select(0, idx))
        o = o.index_copy(0, idx, part)
    return o


__all__ = ["GUARD_ERROR", "GUARD_ROWS", "GuardCall", "GuardLog", "estimate_errors", "exact_rows", "kept_stratified",
           "first_approximated", "guard", "guard_log", "sample_ranks", "sampled_rows", "top_rows"]
