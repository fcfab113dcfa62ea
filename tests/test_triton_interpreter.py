"""The suite's shortcut in Triton's interpreter (tests/triton_interpreter.py: a jit helper's call does not patch
triton.language again while a launch has it patched) changes no result: LoLA's prefill and decode kernels, whose
programs call jit helpers, give the same bits with Triton's own device-function call."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import triton_interpreter  # noqa: E402
from triton.runtime import interpreter as interp  # noqa: E402

from test_lola_feature_cache import _run, _seq  # noqa: E402


def _lola():
    seq = _seq(2, 4, 2, 14, 16, 8, seed=3)
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[1, :3] = False
    out, st = _run(seq, [8] + [1] * 6, feature_cache=True, backend="triton", window=4, chunk=4, lam=3, mask=mask)
    return [out, st.H, st.s, st.sp_k, st.sp_v, st.win_fk]


def test_the_shortcut_is_installed_and_changes_no_bit(monkeypatch):
    assert getattr(interp.InterpretedFunction.__call__, "_shortcut", False), "the conftest installs it"
    helper_calls = []
    patch_lang = interp._patch_lang
    monkeypatch.setattr(interp, "_patch_lang", lambda fn: helper_calls.append(fn) or patch_lang(fn))
    fast = _lola()
    with_shortcut = len(helper_calls)
    helper_calls.clear()
    triton_interpreter.restore()
    try:
        plain = _lola()
    finally:
        assert triton_interpreter.skip_repeated_language_patch()
    # Triton's own call patches again at every helper call: many more patches than launches
    assert len(helper_calls) > 3 * with_shortcut > 0, (len(helper_calls), with_shortcut)
    for a, b in zip(fast, plain):
        assert torch.equal(a, b)
