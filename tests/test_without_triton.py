"""Triton is optional: a CPU install of PyTorch brings none, and every method then runs its PyTorch reference.

Each check runs in a fresh interpreter in which `import triton` fails (as on such a machine), so the suite's own
Triton import (the interpreter tests) cannot hide a module-level import.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

_NO_TRITON = """
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError, as where it is not installed
"""


def _run(code: str, env_extra: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update({"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", _NO_TRITON + textwrap.dedent(code)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


# small settings that make each method's approximate path run at 40 tokens (muse: its clustered prefill)
_SETTINGS = {
    "exact": {},
    "sliding-window": {"window": 8},
    "muse": {"block_size": 8, "min_seq_len": 16, "k_clusters": 2, "q_clusters": 2, "topk_blocks": 1,
             "topk_clusters": 1},
    "moba": {"block_size": 8, "top_k": 2},
    "lolcats": {"window": 8, "chunk": 8},
    "lola": {"window": 8, "chunk": 8, "sparse_cache": 4},
    "ovq": {"chunk_size": 16, "max_centroids": 8},
}


def test_every_method_runs_and_generates_without_triton():
    r = _run(f"""
        import json, warnings
        import torch
        warnings.simplefilter("ignore")
        sys.path.insert(0, "tests")
        from conftest import tiny_model
        import longctx_patch as lp
        settings = json.loads({json.dumps(json.dumps(_SETTINGS))})
        assert sorted(settings) == lp.list_methods(), lp.list_methods()
        out = {{}}
        for name in lp.list_methods():
            model = tiny_model("llama", max_position_embeddings=256)
            ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                ref = model(ids).logits
                lp.patch(model, name, **settings[name])
                logits = model(ids).logits
                gen = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
            assert torch.isfinite(logits).all(), name
            assert gen.shape == (2, 44), (name, gen.shape)
            lp.unpatch(model)
            with torch.no_grad():
                assert torch.equal(model(ids).logits, ref), name
            out[name] = float((logits - ref).abs().max())
        assert "triton" not in sys.modules or sys.modules["triton"] is None
        print(json.dumps(out))
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    diffs = json.loads(r.stdout.strip().splitlines()[-1])
    assert diffs["exact"] < 1e-5, diffs


@pytest.mark.parametrize("name", ["muse", "lolcats", "lola", "ovq"])
def test_backend_triton_without_triton_is_a_device_error(name):
    r = _run(f"""
        import torch
        sys.path.insert(0, "tests")
        from conftest import tiny_model
        import longctx_patch as lp
        settings = {_SETTINGS!r}[{name!r}]
        model = lp.patch(tiny_model("llama"), {name!r}, backend="triton", **settings)
        try:
            with torch.no_grad():
                model(torch.randint(3, 128, (1, 40)))
        except lp.DeviceError as e:
            print("DeviceError:", e)
        else:
            print("no error")
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.strip().splitlines()[-1]
    assert out.startswith("DeviceError:"), out
    assert "Triton is not installed" in out and "backend='auto'" in out, out


@pytest.mark.parametrize("name", ["muse", "lolcats", "lola", "ovq"])
def test_backend_triton_on_a_cpu_tensor_is_a_device_error(name):
    """Triton installed (as in the test environment) but no GPU and no interpreter: the same named error."""
    import torch

    import longctx_patch as lp
    from longctx_patch.kernels import backend
    from conftest import tiny_model

    model = lp.patch(tiny_model("llama"), name, backend="triton", **_SETTINGS[name])
    old = backend.INTERPRET
    backend.INTERPRET = False
    try:
        with pytest.raises(lp.DeviceError, match="run on CUDA GPUs"):
            with torch.no_grad():
                model(torch.randint(3, 128, (1, 40)))
    finally:
        backend.INTERPRET = old


def test_cli_info_lists_every_method_without_triton():
    r = _run("""
        from longctx_patch.cli.main import main
        sys.argv = ["longctx", "info"]
        try:
            main()
        except SystemExit as e:
            assert not e.code, e.code
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("exact", "sliding-window", "muse", "lolcats", "lola", "ovq"):
        assert name in r.stdout, r.stdout[-2000:]
