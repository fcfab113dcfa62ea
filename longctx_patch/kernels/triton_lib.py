"""The kernel families' shared Triton helpers (as flash-linear-attention keeps `fla/ops/utils`).

A Triton file: it imports Triton at module level, so only the other kernel files (`triton_*.py`) import it, and
they are imported only once `backend.resolve_backend` chose "triton".

- `dot`, `dot_acc`: `tl.dot` with fp32 accumulation at the precision PREC ("ieee", "tf32", "tf32x3"; it matters
  for fp32 operands only), and the interpreter's workaround (UPCAST): Triton's CPU interpreter (3.9) multiplies
  bf16/fp16 dot operands wrongly, so there the operands are upcast to fp32 first. They hold bf16/fp16 values, so
  the products are the ones the GPU's tensor cores compute; the interpreter ignores PREC.
- `rounded` / `cast_out`: an fp32 value rounded to a narrower dtype (as fp32) / stored in an output's dtype, to
  nearest even also under the interpreter (which truncates fp32 -> bf16).
- `dot_bf16x3`: a @ c to fp32 accuracy on bf16 tensor cores, for bf16 `a` and fp32 `c` (c split in three bf16
  parts): the LoLA self-recall error and the MuSe clustering.
- `online_softmax_step`: the rescale of a running (flash) softmax by one tile of keys (new max, exponentials,
  factor), base e or 2, with or without the guard for rows that have seen no key yet; the kernels add the sum and
  the output in the order each one had (the order changes the sm_90 code); `online_softmax` does both.
  `online_softmax_scaled`: the whole step in base 2 for logits that still need their scale (the scale and the max
  subtraction fuse into one FMA); `online_softmax_row`: one query against a tile of keys without a tensor-core dot
  (decode steps). OVQ's attention kernels write their step out (p before the factor).
- `combine_splits`: the sums of the partial softmaxes of a split-key attention ("flash-decoding") at their common
  max.

Host side: `dot_precision`, `np2`; the kernels' UPCAST flag is `backend.INTERPRET` (compiled kernels keep their
bf16 dots).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import next_power_of_2

LOG2E = 1.4426950408889634


def dot_precision(*tensors: torch.Tensor) -> str:
    """"ieee" (fp32 products) when every operand is fp32, else "tf32" (which bf16/fp16 operands ignore)."""
    return "ieee" if all(t.dtype == torch.float32 for t in tensors) else "tf32"


def np2(x: int, lo: int = 16) -> int:
    """x rounded up to a power of two, at least `lo` (a tile dimension)."""
    return max(lo, next_power_of_2(int(x)))


@triton.jit
def dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b in fp32 with products at PREC; UPCAST: the interpreter's workaround (module docstring)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def rounded(x, dt: tl.constexpr, EMU: tl.constexpr):
    """fp32 x rounded to dtype dt (to nearest, ties to even), as fp32 values. EMU: the interpreter's workaround
    (Triton's CPU interpreter truncates fp32 -> bf16 casts): the rounding done on the bits (finite values; the
    kernels' tests run there). On the GPU the cast itself rounds to nearest even."""
    if dt == tl.float32:
        return x
    elif EMU and dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dt).to(tl.float32)


@triton.jit
def cast_out(x, PTR, UPCAST: tl.constexpr):
    """fp32 x in PTR's element type, rounded to nearest even as the GPU rounds it (`rounded` first under the
    interpreter, UPCAST, whose cast would truncate)."""
    if UPCAST:
        x = rounded(x, PTR.dtype.element_ty, UPCAST)
    return x.to(PTR.dtype.element_ty)


@triton.jit
def dot_acc(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b + acc (fp32 accumulator), as `dot`."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def dot_bf16x3(a, c, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ c + acc to fp32 accuracy with bf16 products: `a` holds bf16 values (exact as a tensor-core operand),
    c (fp32) = hi + mid + lo in three bf16 parts (24 mantissa bits, fp32's), so three bf16 dots with fp32 sums,
    the smallest part first."""
    hi = c.to(tl.bfloat16)
    r = c - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    acc = dot_acc(a, lo, acc, PREC, UPCAST)
    acc = dot_acc(a, mid, acc, PREC, UPCAST)
    return dot_acc(a, hi, acc, PREC, UPCAST)


@triton.jit
def online_softmax_step(s, m_i, BASE2: tl.constexpr, EMPTY: tl.constexpr):
    """The rescale of one tile of keys in a running softmax: s [BM, BN] logits (-inf = masked; log2 units when
    BASE2), m_i [BM] the running max. Returns (m_new, p, alpha): the new max, the tile's exponentials and the factor
    of the running sum and output; the caller then adds l_i * alpha + sum(p) and acc * alpha + p @ v (in the order
    its kernel needs; `online_softmax` does both).
    EMPTY: a row may have seen only masked keys (running max -inf): the max is then taken as 0, so that the
    exponentials of -inf are 0, not NaN; without it the running max must start finite (e.g. -1e30)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if EMPTY:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    if BASE2:
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
    else:
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
    return m_new, p, alpha


@triton.jit
def online_softmax(s, vals, m_i, l_i, acc, PREC: tl.constexpr, UPCAST: tl.constexpr, BASE2: tl.constexpr,
                   EMPTY: tl.constexpr):
    """One tile of keys into a running softmax (`online_softmax_step`, then the sum and the output): vals [BN, D],
    l_i [BM] the running sum, acc [BM, D] fp32 the unnormalised output. Returns (m_i, l_i, acc).
    The step is written out here: called as a function inside this one, the sm_90 build of MuSe's fp32 forward
    orders six of its address instructions differently."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if EMPTY:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    if BASE2:
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
    else:
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(vals.dtype), vals, PREC, UPCAST)
    return m_new, l_i, acc


@triton.jit
def online_softmax_scaled(s, qk, vals, m_i, l_i, acc, PREC: tl.constexpr, UPCAST: tl.constexpr,
                          EMPTY: tl.constexpr):
    """`online_softmax` in base 2 for unscaled logits s: the logits are qk * s, the row max is scaled once
    ([BM] products) and each exponent qk * s - max is one FMA. EMPTY as there."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk)
    if EMPTY:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    p = tl.exp2(s * qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    acc = acc * alpha[:, None] + dot(p.to(vals.dtype), vals, PREC, UPCAST)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def online_softmax_row(s, vals, m_i, l_i, acc):
    """One query: s [BN] log2-unit logits (-inf = masked), vals [BN, D] fp32, m_i / l_i [1] (the running max starts
    finite), acc [D]; the products on the CUDA cores (a single query fills no tensor-core tile)."""
    m_new = tl.maximum(m_i, tl.max(s, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    acc = acc * alpha + tl.sum(p[:, None] * vals, 0)
    l_i = l_i * alpha + tl.sum(p, 0)
    return m_new, l_i, acc


@triton.jit
def combine_splits(PO, PM, PL, first, step, size, rows, mask, NS, D: tl.constexpr, BR: tl.constexpr,
                   MASKED: tl.constexpr):
    """The partial softmaxes of NS key splits at their common max. Split s of row r: its max (log2 units) and sum at
    PM / PL[i], its unnormalised output at PO[i * D + d], i = (first + s * step) * size + r, for the BR row offsets
    r in `rows` (MASKED: only the rows of `mask` are read); `first` may be 32- or 64-bit, i is 64-bit. Returns (acc [BR, D], den [BR]): the output is
    acc / den (den is 0 for a row that no split saw a key of)."""
    step = tl.cast(step, tl.int64)  # 64-bit split offsets: `first + s * step` counts rows of all programs
    mx = tl.full([BR], float("-inf"), tl.float32)
    for s in range(0, NS):
        if MASKED:
            mx = tl.maximum(mx, tl.load(PM + (first + s * step) * size + rows, mask=mask, other=float("-inf")))
        else:
            mx = tl.maximum(mx, tl.load(PM + (first + s * step) * size + rows))
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # rows with no key in any split (or padding rows)
    den = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, D], tl.float32)
    d = tl.arange(0, D)
    for s in range(0, NS):
        # the two forms of the address arithmetic are those of the two kernels this combine came from (OVQ's,
        # masked; decode's, not): each compiles to the code its kernel had
        if MASKED:
            row = (first + s * step) * size + rows
            w = tl.exp2(tl.load(PM + row, mask=mask, other=float("-inf")) - mx)
            den += w * tl.load(PL + row, mask=mask, other=0.0)
            acc += w[:, None] * tl.load(PO + row[:, None] * D + d[None, :], mask=mask[:, None], other=0.0)
        else:
            base = first + s * step
            w = tl.exp2(tl.load(PM + base * size + rows) - mx)
            den += w * tl.load(PL + base * size + rows)
            acc += w[:, None] * tl.load(PO + (base * size + rows)[:, None] * D + d[None, :])
    return acc, den
