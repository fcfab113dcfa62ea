"""kernels/graphs.run_steps: the host loop shared by LoLA's evictions and OVQ's chunk runs."""
import torch

from longctx_patch.kernels.graphs import run_steps


def test_run_steps_runs_every_step_in_order_off_cuda():
    for n in (0, 1, 2, 5):
        seen = []
        g = run_steps(lambda: seen.append(len(seen)), n, torch.device("cpu"))
        assert g is None and seen == list(range(n))
        seen.clear()
        run_steps(lambda: seen.append(len(seen)), n, torch.device("cpu"), eager_first=False)
        assert seen == list(range(n))  # no capture off CUDA: every step still runs
