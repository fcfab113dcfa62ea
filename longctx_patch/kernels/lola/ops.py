"""Dispatchers of the LoLCATs / LoLA kernels on plain tensors: the hedgehog feature map and the whole-sequence
hybrid attention, with their Triton autograd Functions.

`backend`: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch". Under gradients the whole-sequence
LoLCATs hybrid (`hybrid_attention`: `HybridAttentionFn`, the forward kernel and `triton_hybrid_bwd`'s backward) and
the feature map (`FeatureMapFn`: `triton_feature_map_bwd`) have Triton paths; every other piece (the LoLA chunk
loop, evictions, the training pass over sparse sets) takes the differentiable PyTorch path under grad with "auto"
and refuses "triton". Under TRITON_INTERPRET=1 "triton" runs the kernels on the CPU (tests).

The LoLA sparse cache (the decode state and its state machine) is `state.py` and `sparse_cache.py`; the parallel
prefills `prefill.py`; left-padded rows' eviction grids `padded.py`.
"""

from __future__ import annotations

import dataclasses

import torch

from ...errors import ConfigError
from ..backend import check_backend, needs_grad, resolve_backend
from . import reference as ref
from .tuning import DEFAULT_TUNING, LolaTuning


def use_triton(backend: str, *tensors) -> bool:
    """Whether the forward-only Triton kernels run (`kernels.backend.resolve_backend`): `auto` takes the
    (differentiable) PyTorch path whenever one of `tensors` needs a gradient; pass every input that may be
    trained (q, k, v and the feature maps' outputs, the window factors). The whole-sequence hybrid
    (`hybrid_attention`) does not ask here under grad: it has a Triton backward (`HybridAttentionFn`)."""
    grad = refuse_forced_triton_under_grad(backend, *tensors)
    return resolve_backend(backend, *tensors, what="lola/lolcats") == "triton" and not grad


def refuse_forced_triton_under_grad(backend: str, *tensors) -> bool:
    """Raises ConfigError for backend='triton' when one of `tensors` needs a gradient and the piece about to run has
    no Triton backward (the LoLA chunk loop, its evictions, the training pass over sparse sets); returns whether a
    gradient is needed."""
    check_backend(backend, "lola/lolcats")
    grad = needs_grad(*tensors)
    if backend == "triton" and grad:
        raise ConfigError("backend='triton' was asked for while gradients are needed, but this LoLA/LoLCATs "
                          "Triton kernel has no backward (the LoLCATs whole-sequence hybrid attention and the "
                          "feature map have one; the LoLA chunk loop, its evictions and its training pass over sparse "
                          "sets do not); train with "
                          "backend='auto' (the Triton hybrid where it has a backward, the PyTorch path elsewhere) "
                          "or backend='torch'")
    return grad


def triton_ops():
    """The Triton entry points (`triton_kernels`), imported once the backend chose them."""
    from . import triton_kernels

    return triton_kernels


class FeatureMapFn(torch.autograd.Function):
    """The hedgehog feature map on the Triton kernels: forward `feature_map`, backward `feature_map_bwd` (it
    recomputes the projection and the softmaxes: nothing but x and W is kept)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, out_dtype, tuning: LolaTuning):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.tuning = eps, tuning
        return triton_ops().feature_map(x, weight, eps=eps, out_dtype=out_dtype, tuning=tuning)

    @staticmethod
    def backward(ctx, dphi):
        x, weight = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = triton_ops().feature_map_bwd(x, weight, dphi, ctx.eps, need_dx, need_dw, tuning=ctx.tuning)
        return dx, (dw.to(weight.dtype) if dw is not None else None), None, None, None


def feature_map(x, weight, eps: float = 1e-12, out_dtype=None, backend: str = "auto", out=None,
                tuning: LolaTuning = DEFAULT_TUNING):
    """Hedgehog feature map [softmax(x W), softmax(-x W)]: Triton on CUDA (under grad `FeatureMapFn`, forward and
    backward kernels), else torch. out: write the result there (no grad; Triton writes it directly, torch copies)
    and return it. tuning: the kernels' launch settings (tuning.LolaTuning)."""
    check_backend(backend, "lola/lolcats")
    if x.stride(-1) == 1 and resolve_backend(backend, x, weight, what="lola/lolcats") == "triton":
        if not needs_grad(x, weight):
            return triton_ops().feature_map(x, weight, eps=eps, out_dtype=out_dtype, out=out, tuning=tuning)
        if out is None:
            return FeatureMapFn.apply(x, weight, float(eps), out_dtype, tuning)
        refuse_forced_triton_under_grad(backend, x, weight)  # writing into `out` under grad: the torch path only
    f = ref.hedgehog_feature_map(x, weight, eps=eps, out_dtype=out_dtype)
    if out is None:
        return f
    out.copy_(f)
    return out


# ------------------------------------------------------------------------------------------- lolcats forward
STATE_CHUNK = 256  # keys per materialised prefix state of the parallel pass (H200: 1.36 ms vs 1.72 ms with 64)


class HybridAttentionFn(torch.autograd.Function):
    """The whole-sequence hybrid on the Triton kernels: forward `hybrid_fwd` (the inference kernel, with the row
    statistics of the backward), backward `hybrid_bwd` (triton_hybrid_bwd.py); gradients for q, k, v, fq, fk, g, lf.
    The prefix states are recomputed in the backward (cheap), not saved. spec (`reference.HybridSpec`): window, scale,
    the keys per prefix state and the tuning, whose `train_block_m` / `train_block_n` are the tiles of both passes."""

    @staticmethod
    def forward(ctx, q, k, v, fq, fk, g, lf, key_mask, spec: ref.HybridSpec):
        tk = triton_ops()
        tuning = spec.tuning
        state_chunk = int(spec.state_chunk or tuning.train_state_chunk or STATE_CHUNK)
        q, k, v, fq, fk = (x.contiguous() for x in (q, k, v, fq, fk))
        Hs, Ss = tk.chunk_states(fk, v, state_chunk, key_mask=key_mask)
        B, Hq, S, D = q.shape
        # the output in fp32 (rounded to q.dtype below, as the kernel rounds it): the backward's
        # delta = do . o from the unrounded o (a bf16 o made dg / dlf, sums over every row, visibly noisier)
        o32 = torch.empty(B, S, Hq, D, device=q.device, dtype=torch.float32)
        keys = ref.HybridKeys(k, v, fk, Hs, Ss, key_mask=key_mask, q_offset=0, state_chunk=state_chunk)
        rule = _training_rule(spec, g, lf)
        o32, (m, r, am) = tk.hybrid_fwd(q, fq, keys, rule, block_m=int(tuning.train_block_m or 64),
                                        block_n=int(tuning.train_block_n or 64), stats=True, out=o32, tuning=tuning)
        del Hs, Ss
        ctx.save_for_backward(q, k, v, fq, fk, g, lf, key_mask, o32, m, r, am)
        ctx.spec, ctx.state_chunk = spec, state_chunk
        return o32.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, fq, fk, g, lf, key_mask, o, m, r, am = ctx.saved_tensors
        if do.stride(-1) != 1:
            do = do.contiguous()
        # the forward's keys without their prefix states (None: the backward recomputes them)
        keys = ref.HybridKeys(k, v, fk, None, None, key_mask=key_mask, q_offset=0, state_chunk=ctx.state_chunk)
        rule = _training_rule(ctx.spec, g, lf)
        with torch.autocast(q.device.type, enabled=False):  # its few torch ops (prefix states' sums) stay fp32
            grads = triton_ops().hybrid_bwd(q, fq, keys, rule, o, do, (m, r, am), tuning=ctx.spec.tuning)
        return (*grads, None, None)


def _training_rule(spec: ref.HybridSpec, g, lf) -> ref.HybridRule:
    """The rule of the training pass: LoLCATs' combination (the only one its backward differentiates)."""
    return ref.HybridRule(int(spec.window), g, lf, None if spec.scale is None else float(spec.scale))


def hybrid_attention_triton(q, k, v, fq, fk, g, lf, spec: ref.HybridSpec, *, key_mask=None):
    """`HybridAttentionFn` (the Triton forward and backward): q [B,Hq,S,D], k/v [B,Hkv,S,D], fq/fk [B,Hq,S,F2] of
    one dtype, g/lf [Hq], key_mask [B, S] bool or None -> [B, S, Hq, D] in q.dtype. spec (`reference.HybridSpec`):
    window, scale, combine "shifted" (ConfigError for "unshifted": the backward differentiates LoLCATs' combination
    only), state_chunk as it is (None: `tuning.train_state_chunk`, else STATE_CHUNK), a multiple of the key tile;
    the tiles of both passes are `spec.tuning.train_block_m` / `train_block_n` (None: 64; tests pass small ones to get
    several state slots at small S) and the rest of the tuning their launch settings. spec.chunk and spec.backend are
    not read."""
    if ref.check_combine(spec.combine):
        raise ConfigError("hybrid_attention_triton differentiates combine='shifted' only (its backward is LoLCATs' "
                          "combination); pass a HybridSpec with combine='shifted', or run ops.hybrid_attention, "
                          "which takes the PyTorch path for combine='unshifted' under gradients")
    return HybridAttentionFn.apply(q, k, v, fq, fk, g, lf, key_mask, spec)


def refuse_unshifted_triton_backward(backend: str, combine: str) -> bool:
    """Whether the Triton backward of the whole-sequence hybrid can run: not with combine="unshifted" (it
    differentiates LoLCATs' combination only). backend="triton" is then refused (ConfigError); "auto" takes the
    differentiable PyTorch path."""
    if not ref.check_combine(combine):
        return True
    if backend == "triton":
        raise ConfigError("combine='unshifted' under gradients has no Triton backward (the LoLCATs hybrid's backward "
                          "differentiates combine='shifted' only); train with backend='auto' or backend='torch' (the "
                          "PyTorch path, which differentiates either), or with combine='shifted'")
    return False


def hybrid_attention(q, k, v, fq, fk, g, lf, spec: ref.HybridSpec, *, key_mask=None):
    """LoLCATs hybrid over a whole sequence (no cache): q [B,Hq,S,D], k/v [B,Hkv,S,D], fq/fk [B,Hq,S,F2], g/lf [Hq],
    key_mask [B, S] bool or None; the settings (window, scale, combine, chunk, state_chunk, backend, tuning) in
    `spec` (`reference.HybridSpec`).

    Returns [B, S, Hq, D] in q.dtype. Differentiable on both backends: under grad the Triton backend runs
    `HybridAttentionFn` (Triton forward and backward), the torch backend `reference.hybrid_attention_chunked`.
    combine: "shifted" (LoLCATs) or "unshifted" (the LoLA authors'; `reference._finish`); under grad "unshifted"
    takes the PyTorch path with backend="auto" and is refused with "triton" (`refuse_unshifted_triton_backward`).
    tuning: the kernels' launch settings (the training pass's keys per prefix state and tiles: `train_*`).
    """
    window, backend, tuning = spec.window, spec.backend, spec.tuning
    cs = max(64, ((spec.state_chunk or STATE_CHUNK) // 64) * 64)
    tensors = (q, k, v, fq, fk, g, lf)
    if needs_grad(*tensors):
        if (window >= 1 and resolve_backend(backend, *tensors, what="lola/lolcats") == "triton"
                and refuse_unshifted_triton_backward(backend, spec.combine)):
            # one dtype for the kernels: autocast's where it is on (a trainer's fp32 weights under bf16 autocast
            # hand over fp32 q/k after the rotary's fp32 cos/sin and bf16 v: the kernels would run fp32 "ieee"
            # products, far slower than bf16 ones), else q's
            dev = q.device.type
            dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else q.dtype
            train = dataclasses.replace(spec, state_chunk=cs if spec.state_chunk else (tuning.train_state_chunk or cs))
            return hybrid_attention_triton(q.to(dt), k.to(dt), v.to(dt), fq.to(dt), fk.to(dt), g, lf, train,
                                           key_mask=key_mask)
    elif use_triton(backend, *tensors):
        tk = triton_ops()
        Hs, Ss = tk.chunk_states(fk, v, cs, key_mask=key_mask)
        return tk.hybrid_fwd(q, fq, ref.HybridKeys(k, v, fk, Hs, Ss, key_mask=key_mask, q_offset=0, state_chunk=cs),
                             spec.rule(g, lf), tuning=tuning)
    o = ref.hybrid_attention_chunked(q, k, v, fq, fk, g, lf, spec, key_mask=key_mask)
    return o.transpose(1, 2).to(q.dtype)
