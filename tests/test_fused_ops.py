"""Fused inference kernels for the model's own ops (longctx_patch/fused_ops.py, kernels/model_ops/): the rotary
embedding of q and k, RMSNorm and SiLU(gate) * up against transformers' originals under Triton's interpreter, and a
patched model with them on against the same model with them off.

Tolerances: the rotary kernel rounds each product and the sum as the eager code does: bit-identical (fp32, bf16).
RMSNorm sums the squares in another order than torch.mean: fp32 within 2e-6 relative; bf16 bit-identical on these
inputs (a sum one ulp of fp32 apart can move a bf16 rounding by one ulp: allowed, 1 in 1000 elements). SiLU: the
exponential's implementation: fp32 within 1e-6 relative, bf16 likewise at most one ulp, rarely.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import greedy_with_scores, tiny_model

import longctx_patch as lp
from longctx_patch import fused_ops
from longctx_patch.errors import ConfigError
from longctx_patch.kernels import model_ops
from longctx_patch.kernels.backend import triton_installed

pytestmark = pytest.mark.skipif(not triton_installed(), reason="needs Triton (its interpreter runs the kernels)")


def _rope(B, S, D, dtype, batch_cos=True):
    pos = torch.arange(S)[None] + torch.arange(B)[:, None] * 3 + 5  # rows at different positions
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    f = pos[..., None].float() * inv
    e = torch.cat([f, f], -1)
    cos, sin = e.cos().to(dtype), e.sin().to(dtype)
    return (cos, sin) if batch_cos else (cos[:1], sin[:1])


def _projected(B, S, H, D, dtype, seed):
    """[B, H, S, D] as ArchAdapter.project makes it: a Linear's [B, S, H * D] viewed and transposed (strided)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, H * D, generator=g).to(dtype).view(B, S, H, D).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 80])
@pytest.mark.parametrize("S", [1, 37])
def test_rotary_matches_apply_rotary_pos_emb(dtype, D, S):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    B, Hkv, G = 2, 2, 7  # GQA: 7 q heads per kv head
    q, k = _projected(B, S, Hkv * G, D, dtype, 0), _projected(B, S, Hkv, D, dtype, 1)
    assert S == 1 or not q.is_contiguous()  # S = 1: the transpose is contiguous too
    for batch_cos in (True, False):
        cos, sin = _rope(B, S, D, dtype, batch_cos)
        assert model_ops.rotary_missing(q, k, cos, sin, "triton") is None
        want = apply_rotary_pos_emb(q, k, cos, sin)
        got = model_ops.rotary(q, k, cos, sin)
        for w, g in zip(want, got):
            assert g.dtype == dtype and g.shape == w.shape and g.is_contiguous()
            assert torch.equal(g, w), (g.float() - w.float()).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_are_the_model_code(dtype):
    """kernels/model_ops/reference.py computes what transformers' own functions and modules compute, bit for bit."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = _projected(2, 9, 6, 64, dtype, 0), _projected(2, 9, 2, 64, dtype, 1)
    cos, sin = _rope(2, 9, 64, dtype)
    for w, g in zip(apply_rotary_pos_emb(q, k, cos, sin), model_ops.rotary_reference(q, k, cos, sin)):
        assert torch.equal(g, w)
    x = (torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(4)) * 2).to(dtype)
    for wdtype in (dtype, torch.float32):
        for norm in _norms(64, dtype, wdtype):
            with torch.no_grad():
                assert torch.equal(model_ops.rms_norm_reference(x, norm.weight, norm.variance_epsilon), norm(x))
    a, b = x * 3, x.flip(-1)
    assert torch.equal(model_ops.silu_mul_reference(a, b), F.silu(a) * b)


def test_rotary_refuses_what_it_does_not_compute():
    q, k = _projected(1, 3, 4, 64, torch.float32, 0), _projected(1, 3, 2, 64, torch.float32, 1)
    cos, sin = _rope(1, 3, 64, torch.float32)
    assert model_ops.rotary_missing(q, k, cos, sin, "auto") is not None  # CPU tensors: "auto" is for CUDA
    assert model_ops.rotary_missing(q, k, cos[..., :32], sin[..., :32], "triton") is not None  # partial rotary
    assert model_ops.rotary_missing(q, k, cos.double(), sin.double(), "triton") is not None  # dtypes differ
    assert model_ops.rotary_missing(q.requires_grad_(), k, cos, sin, "triton") is not None  # a gradient
    with torch.no_grad():
        assert model_ops.rotary_missing(q, k, cos, sin, "triton") is None


def _norms(N, dtype, wdtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    g = torch.Generator().manual_seed(3)
    out = []
    for cls in (LlamaRMSNorm, Qwen2RMSNorm):
        n = cls(N, eps=1e-5).to(wdtype)
        with torch.no_grad():
            n.weight.copy_(torch.randn(N, generator=g) * 0.5 + 1)
        out.append(n)
    return out


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("N", [64, 80])
def test_rms_norm_matches_the_modules(dtype, wdtype, N):
    x = (torch.randn(3, 37, N, generator=torch.Generator().manual_seed(4)) * 2).to(dtype)
    for norm in _norms(N, dtype, wdtype):
        with torch.no_grad():
            want = norm(x)
            assert model_ops.rms_norm_missing(x, norm.weight, "triton") is None
            got = model_ops.rms_norm(x, norm.weight, norm.variance_epsilon)
        assert got.dtype == want.dtype and got.shape == want.shape
        if want.dtype == torch.float32 and dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        else:
            diff = (got.float() - want.float()).abs()
            ulp = want.float().abs() * 2.0 ** -7 + 1e-6
            assert (diff <= ulp).all() and (diff > 0).float().mean() <= 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches(dtype):
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randn(3, 7, 131, generator=g) * 3).to(dtype), torch.randn(3, 7, 131, generator=g).to(dtype)
    assert model_ops.silu_mul_missing(a, b, "triton") is None
    want, got = F.silu(a) * b, model_ops.silu_mul(a, b)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        diff = (got.float() - want.float()).abs()
        assert (diff <= want.float().abs() * 2.0 ** -7 + 1e-6).all() and (diff > 0).float().mean() <= 1e-3


# ------------------------------------------------------------------------------------------------- model level
@pytest.fixture
def counted(monkeypatch):
    """Counts the calls of each fused kernel at the call sites of fused_ops.py and architectures.py."""
    import longctx_patch.architectures as arch

    calls = {"rotary": 0, "rms_norm": 0, "silu_mul": 0}

    def counting(where, name):
        orig = getattr(where, name)

        def f(*a, **k):
            calls[name] += 1
            return orig(*a, **k)

        monkeypatch.setattr(where, name, f)

    counting(arch, "rotary")
    counting(fused_ops, "rms_norm")
    counting(fused_ops, "silu_mul")
    return calls


def _targets(model):
    base = model.model
    mods = [base.norm]
    for layer in base.layers:
        mods += [layer.input_layernorm, layer.post_attention_layernorm, layer.mlp]
    return mods


@pytest.mark.parametrize("model_type,method", [("llama", "exact"), ("llama", "lolcats"), ("qwen2", "exact"),
                                               ("qwen2", "lolcats"), ("mistral", "exact")])
def test_patched_model_same_with_fused_ops(model_type, method, counted, one_thread):
    model = tiny_model(model_type)
    ids = torch.randint(3, 128, (2, 13), generator=torch.Generator().manual_seed(6))
    lp.patch(model, method, fused_ops=False)
    assert all("forward" not in m.__dict__ for m in _targets(model))
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        off = model(ids).logits
        tokens_off = model.generate(ids, **gen)
    assert counted == {"rotary": 0, "rms_norm": 0, "silu_mul": 0}
    lp.set_fused_ops(model, "triton")
    assert all(isinstance(m.__dict__.get("forward"), fused_ops.FusedForward) for m in _targets(model))
    with torch.no_grad():
        on = model(ids).logits
    L = len(model.model.layers)
    assert counted == {"rotary": L, "rms_norm": 2 * L + 1, "silu_mul": L}
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **gen), tokens_off)


def test_qwen3_qk_norms_fused(counted, one_thread):
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(7))
    lp.patch(model, "lolcats", fused_ops=False)
    with torch.no_grad():
        off = model(ids).logits
    lp.set_fused_ops(model, "triton")
    with torch.no_grad():
        on = model(ids).logits
    L = len(model.model.layers)
    assert counted["rms_norm"] == 4 * L + 1  # input, post-attention, q_norm, k_norm; the final norm
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_unpatch_restores_the_modules(model_type):
    from longctx_patch.architectures import get_adapter

    model = tiny_model(model_type)
    mods = _targets(model)
    if model_type == "qwen3":
        mods += [m for layer in model.model.layers for m in (layer.self_attn.q_norm, layer.self_attn.k_norm)]
    assert get_adapter(model).standard_rotary()
    before = [(dict(m.__dict__), m.forward.__func__) for m in mods]
    # mistral's config has a sliding window on every layer, which lolcats refuses
    lp.patch(model, "exact" if model_type == "mistral" else "lolcats", fused_ops="triton")
    assert all(isinstance(m.__dict__.get("forward"), fused_ops.FusedForward) for m in mods)
    lp.unpatch(model)
    for m, (d, f) in zip(mods, before):
        assert m.forward.__func__ is f is type(m).forward
        assert m.__dict__.keys() == d.keys() and all(m.__dict__[k] is v for k, v in d.items())
    # on and off again, then patched a second time
    lp.patch(model, "exact", fused_ops="triton")
    lp.set_fused_ops(model, False)
    assert all("forward" not in m.__dict__ for m in mods)
    lp.unpatch(model)


def test_gradients_take_the_original_ops(counted, one_thread):
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(8))
    grads = []
    for mode in (False, "triton"):
        model = tiny_model("llama")
        lp.patch(model, "lolcats", fused_ops=mode)
        loss = model(ids, use_cache=False).logits.float().pow(2).mean()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert counted == {"rotary": 0, "rms_norm": 0, "silu_mul": 0}
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


def test_decode_graphs_with_fused_ops(simulate, counted, one_thread):
    """Decode steps replayed (CPU simulation of the graphs) with the fused kernels: the tokens of eager steps."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(9))
    lp.patch(model, "lolcats", fused_ops="triton", decode_graphs=False)
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        eager = model.generate(ids, **gen)
        lp.set_decode_graphs(model, True)
        replayed = model.generate(ids, **gen)
    assert counted["rotary"] > 0
    assert torch.equal(eager, replayed)


def test_defaults_and_switches(monkeypatch):
    model = tiny_model("llama")
    lp.patch(model, "exact")  # CPU model: off by default
    assert all("forward" not in m.__dict__ for m in _targets(model))
    assert fused_ops.default_mode(model) is None  # on CUDA models only
    monkeypatch.delenv(fused_ops.ENV, raising=False)
    assert fused_ops.env_enabled()  # on unless turned off
    monkeypatch.setenv(fused_ops.ENV, "0")
    assert not fused_ops.env_enabled()
    monkeypatch.setattr(fused_ops, "triton_installed", lambda: True)
    monkeypatch.setattr(type(next(model.parameters())), "is_cuda", property(lambda self: True))
    assert fused_ops.default_mode(model) is None  # the environment turned it off
    monkeypatch.setenv(fused_ops.ENV, "1")
    assert fused_ops.default_mode(model) == "auto"  # a CUDA model (as far as the check can tell)
    monkeypatch.undo()
    with pytest.raises(ConfigError):
        lp.set_fused_ops(model, "yes")
    other = tiny_model("llama")
    with pytest.raises(ConfigError):  # refused before the model changes
        lp.patch(other, "exact", fused_ops="on")
    assert not lp.is_patched(other)
    lp.set_fused_ops(model, True)  # "auto": installed, CPU tensors take the original ops
    assert all(isinstance(m.__dict__.get("forward"), fused_ops.FusedForward) for m in _targets(model))
    # a second patch() of other layers keeps the choice
    lp.unpatch(model)
    lp.patch(model, "exact", layers=[0], fused_ops="triton")
    lp.patch(model, "lolcats", layers=[1, 2])
    assert all(isinstance(m.__dict__.get("forward"), fused_ops.FusedForward) for m in _targets(model))
    lp.unpatch(model)


def test_only_standard_modules():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class MyNorm(LlamaRMSNorm):
        pass

    model = tiny_model("llama")
    layers = model.model.layers
    layers[0].input_layernorm = MyNorm(64)
    replaced = layers[1].post_attention_layernorm
    replaced.forward = lambda x: x
    custom = replaced.__dict__["forward"]
    lp.patch(model, "exact", fused_ops="triton")
    assert "forward" not in layers[0].input_layernorm.__dict__
    assert replaced.__dict__["forward"] is custom
    assert isinstance(layers[1].input_layernorm.__dict__.get("forward"), fused_ops.FusedForward)
    lp.unpatch(model)
    assert replaced.__dict__["forward"] is custom


def test_not_in_the_patch_record(tmp_path):
    """A runtime option: save_patched does not write it; a loaded model takes the default (off on the CPU)."""
    import json

    from longctx_patch.checkpoint import PATCH_JSON
    from longctx_patch.patcher import apply_patch_record

    model = tiny_model("llama")
    lp.patch(model, "lolcats", fused_ops="triton")
    lp.save_patched(model, tmp_path)
    assert "fused" not in (tmp_path / PATCH_JSON).read_text()
    json.loads((tmp_path / PATCH_JSON).read_text())
    fresh = tiny_model("llama")
    apply_patch_record(fresh, tmp_path)
    assert all("forward" not in m.__dict__ for m in _targets(fresh))
    lp.set_fused_ops(fresh, "triton")
    assert all(isinstance(m.__dict__.get("forward"), fused_ops.FusedForward) for m in _targets(fresh))


def test_kernels_launch_on_the_layers_device(monkeypatch):
    """Triton launches on the current CUDA device: the patched attention and the fused norms / MLP make their
    input's device current first (a model split over GPUs), through kernels.backend.on_device."""
    import contextlib
    import types

    from longctx_patch.kernels import backend
    from longctx_patch.methods import base

    # on_device itself: a CUDA tensor on another device than the current one switches, else nothing
    entered = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda d: entered.append(d) or contextlib.nullcontext())
    assert isinstance(backend.on_device(torch.zeros(1)), contextlib.nullcontext) and entered == []
    backend.on_device(types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1)))
    assert entered == [torch.device("cuda", 1)]
    assert isinstance(backend.on_device(types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))),
                      contextlib.nullcontext)
    monkeypatch.undo()

    # the call sites: every patched layer and every fused norm / MLP asks for its input's device
    seen = []

    def spy(t):
        seen.append(tuple(t.shape))
        return contextlib.nullcontext()

    monkeypatch.setattr(base, "on_device", spy)
    monkeypatch.setattr(fused_ops, "on_device", spy)
    model = tiny_model("llama")
    lp.patch(model, "exact", fused_ops="triton")
    ids = torch.randint(3, 100, (1, 5))
    with torch.no_grad():
        model(ids)
    layers = model.config.num_hidden_layers
    hidden, inter = model.config.hidden_size, model.config.intermediate_size
    assert seen.count((1, 5, hidden)) == layers + 2 * layers + 1  # attention inputs, two norms a layer, final norm
    assert seen.count((1, 5, inter)) == layers  # the SiLU products


def test_smollm2_greedy_tokens_equal_with_fused_ops(smollm2, monkeypatch):
    """The real model (SmolLM2-135M, fp32): greedy tokens and every step's scores with the fused kernels as with
    transformers' own ops (the GPU check in benchmarks/generate/check_fused_ops.py runs random 1B-shaped weights)."""
    model, tok = smollm2
    ids = tok("Long contexts need cheap attention because", return_tensors="pt").input_ids
    calls = []
    norm = fused_ops.rms_norm
    monkeypatch.setattr(fused_ops, "rms_norm", lambda *a: calls.append(1) or norm(*a))
    try:
        lp.patch(model, "exact", fused_ops=False)
        seq_a, sc_a, _ = greedy_with_scores(model, ids, 6)
        lp.unpatch(model)
        assert not calls
        lp.patch(model, "exact", fused_ops="triton")
        seq_b, sc_b, _ = greedy_with_scores(model, ids, 6)
    finally:
        lp.unpatch(model)
    assert len(calls) == 6 * (2 * model.config.num_hidden_layers + 1)  # every norm of every forward took the kernel
    assert torch.equal(seq_a, seq_b)
    torch.testing.assert_close(sc_b, sc_a, atol=2e-4, rtol=0)


def test_hub_wrapped_rotary_is_unwrapped():
    """A modeling module's `apply_rotary_pos_emb` wrapped by `kernels`' `use_kernel_forward_from_hub` (transformers
    5.2x) is an nn.Module whose forward closes over the function; the patched attention calls that function, and an
    unknown wrapper is left as it is (then the fused rotary is not used)."""
    from torch import nn

    from longctx_patch.architectures import _unwrap_hub_function

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        return q, k

    def wrap(func):
        class Func(nn.Module):
            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)

        return Func()

    class Opaque(nn.Module):
        def forward(self, q, k, cos, sin):
            return q, k

    assert _unwrap_hub_function(wrap(apply_rotary_pos_emb)) is apply_rotary_pos_emb
    assert _unwrap_hub_function(apply_rotary_pos_emb) is apply_rotary_pos_emb
    opaque = Opaque()
    assert _unwrap_hub_function(opaque) is opaque
    assert _unwrap_hub_function(wrap(opaque)) is not opaque  # a wrapped module is not a function: kept wrapped
