"""The settings objects of the LoLA / LoLCATs host functions (kernels/lola): each refuses a bad value when it is built,
naming the field and what is allowed, and takes what the functions took as keywords before (defaults unchanged).
Their use is checked where each function is (tests/test_lola_*.py); the width of the functions that take them by
tests/test_layering.py."""

from __future__ import annotations

import pytest
import torch

from longctx_patch.errors import ConfigError
from longctx_patch.kernels.lola import HybridSpec, LolaRun, StateSizes
from longctx_patch.kernels.lola import reference as ref
from longctx_patch.kernels.lola.training import PrefillSets, SetsSpec
from longctx_patch.kernels.lola.tuning import DEFAULT_TUNING, LolaTuning


def _phi(x):
    return x


@pytest.mark.parametrize("changes,error,match", [
    (dict(window=-1), ValueError, r"HybridSpec.window=-1: allowed an int >= 0"),
    (dict(window=2.5), ValueError, r"HybridSpec.window=2.5"),
    (dict(chunk=0), ValueError, r"HybridSpec.chunk=0: allowed an int >= 1"),
    (dict(state_chunk=0), ValueError, r"HybridSpec.state_chunk=0"),
    (dict(scale=0.0), ValueError, r"HybridSpec.scale=0.0: allowed None \(D \*\* -0.5\) or a number > 0"),
    (dict(scale="0.1"), ValueError, r"HybridSpec.scale='0.1'"),
    (dict(combine="max"), ValueError, r"combine must be one of"),
    (dict(backend="cuda"), ConfigError, r"backend must be one of auto, triton, torch, not 'cuda'"),
    (dict(tuning={"hybrid_num_warps": 4}), TypeError, r"HybridSpec.tuning: a LolaTuning"),
])
def test_hybrid_spec_refuses_bad_settings(changes, error, match):
    with pytest.raises(error, match=match):
        HybridSpec(**{"window": 8, **changes})


def test_hybrid_spec_defaults_are_the_former_keywords():
    spec = HybridSpec(window=8)
    assert (spec.scale, spec.combine, spec.chunk, spec.state_chunk, spec.backend, spec.tuning) == (
        None, "shifted", 64, None, "auto", DEFAULT_TUNING)
    g, lf = torch.ones(2), torch.zeros(2)
    rule = HybridSpec(window=8, scale=0.5, combine="unshifted").rule(g, lf)
    assert (rule.window, rule.scale, rule.combine, rule.g is g, rule.lf is lf) == (8, 0.5, "unshifted", True, True)


@pytest.mark.parametrize("changes,error,match", [
    (dict(phi_k=None), TypeError, r"LolaRun.phi_k: the key feature map"),
    (dict(chunk=0), ValueError, r"LolaRun.chunk=0: allowed an int >= 1"),
    (dict(lam=-1), ValueError, r"LolaRun.lam=-1: allowed an int >= 0"),
    (dict(scale=-1.0), ValueError, r"LolaRun.scale=-1.0"),
    (dict(backend="gpu"), ConfigError, r"backend must be one of"),
    (dict(combine="both"), ValueError, r"combine must be one of"),
    (dict(tuning=None), TypeError, r"LolaRun.tuning: a LolaTuning"),
])
def test_lola_run_refuses_bad_settings(changes, error, match):
    with pytest.raises(error, match=match):
        LolaRun(**{"phi_k": _phi, "window": 8, "chunk": 4, "lam": 2, "scale": 0.25, **changes})


def test_state_sizes_check_the_heads():
    assert StateSizes(2, 4, 2, 16, 8, 3).sparse_head_count == 2
    assert StateSizes(2, 4, 2, 16, 8, 3, sparse_heads=4).sparse_head_count == 4
    with pytest.raises(ValueError, match=r"StateSizes.sparse_heads=3: allowed None or the kv heads \(2\), or the "
                                         r"query heads \(4\)"):
        StateSizes(2, 4, 2, 16, 8, 3, sparse_heads=3)
    with pytest.raises(ValueError, match=r"q_heads=5 must be a multiple of kv_heads=2"):
        StateSizes(2, 5, 2, 16, 8, 3)
    with pytest.raises(ValueError, match=r"StateSizes.head_dim=0: allowed an int >= 1"):
        StateSizes(2, 4, 2, 0, 8, 3)


def test_sets_spec_and_prefill_sets():
    spec = SetsSpec(window=8, chunk=4, scale=0.25)
    assert (spec.combine, spec.block, spec.dense) == ("shifted", 1024, False)
    with pytest.raises(ValueError, match=r"SetsSpec.block=0: allowed an int >= 1"):
        SetsSpec(window=8, chunk=4, block=0)
    with pytest.raises(ValueError, match=r"SetsSpec.dense=1: allowed True or False"):
        SetsSpec(window=8, chunk=4, dense=1)
    positions = torch.full((2, 1, 1, 3), -1)
    assert PrefillSets(positions).key_mask is None and PrefillSets(positions).positions is positions


def test_eviction_plan_refuses_a_first_eviction_past_the_last():
    tk = pytest.importorskip("longctx_patch.kernels.lola.triton_kernels")
    plan = tk.EvictionPlan(window=16, chunk=16, lam=4, sparse_heads=2, n_ev=3)
    assert (plan.first, plan.eps) == (0, ref.EPS_SRE)
    with pytest.raises(ValueError, match=r"EvictionPlan.first=4: first eviction outside 0 .. n_ev=3"):
        tk.EvictionPlan(window=16, chunk=16, lam=4, sparse_heads=2, n_ev=3, first=4)
    with pytest.raises(ValueError, match=r"EvictionPlan.eps=0: allowed a number > 0"):
        tk.EvictionPlan(window=16, chunk=16, lam=4, sparse_heads=2, n_ev=3, eps=0)


def test_a_spec_is_frozen():
    spec = HybridSpec(window=8, tuning=LolaTuning(train_block_m=32))
    with pytest.raises(AttributeError):
        spec.window = 4
