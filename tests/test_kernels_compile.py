"""The LoLA Triton kernels compile for the H200 (sm_90) with the installed Triton, on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1, the other kernel tests) runs the kernels' Python semantics, not the
compiler: a constexpr re-declared in a loop, a dtype that changes across an `if`, or a tile that needs more
shared memory than the chip has pass there and fail only on the GPU. `tests/compile_sm90.py` compiles each
kernel to a cubin for sm_90 (front end, TTGIR, LLVM, ptxas: all shipped with Triton) in the configurations the
wrappers launch; it runs in a subprocess because this session has the interpreter on.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SM90_SMEM = 232448  # bytes of shared memory one block may use on an H100/H200
SCRIPT = Path(__file__).with_name("compile_sm90.py")
NAMES = ["chunk_sums", "hybrid_fwd_lola_D128", "hybrid_fwd_fp32", "sre", "fold", "decode", "feature_map",
         "ev_score", "ev_select", "ev_fold", "local_states"]


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_every_case_is_listed(compiled):
    assert sorted(compiled) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_lola_kernel_compiles_for_sm90(compiled, name):
    res = compiled[name]
    assert "error" not in res, res.get("error", "") + "\n" + res.get("trace", "")
    assert res["cubin_bytes"] > 0
    assert res["shared"] <= SM90_SMEM, f"{name} asks for {res['shared']} B of shared memory"
