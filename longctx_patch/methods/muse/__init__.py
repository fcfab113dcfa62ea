"""`muse`: multipole semantic attention (MuSe) for the prefill of Llama-family models.

The softmax kernel of each patched layer is replaced by MuSe (longctx_patch.kernels.muse) for prefill
without a past (q_len == k_len > block_size and >= min_seq_len); decode steps, continued prefill and
short sequences take exact softmax attention over a full KV cache, so `generate()` is exact after the
prompt; a prefill that fills a cache in eval mode recomputes its last `exact_tail` queries exactly. Each MuSe call
measures its heads' error on a few sampled query rows and runs those over `guard_error` exactly (guard.py). The
projections are the original ones: no new parameters. docs/muse.md explains every option.
"""

import contextlib
import math
import warnings

from ...errors import ConfigError
from ...kernels.muse import attended_keys
from ..base import Approximation, Method, register_method
from .attention import MuseAttention
from .calibration import MuseCalibration
from .config import CROSSOVER, FAR_FIELD_DEFAULTS, Q_CLUSTERS, MuseConfig
from .guard import GuardCall, GuardLog, guard_log

# the budgets a calibration tries per layer (longctx_patch.calibrate): retrieved blocks per score (topk_blocks =
# peak_blocks = b for the cells plans; topk_blocks = b for the tilted design) and key cells (the config's k_clusters
# and twice it); settings that retrieve every far block at the calibration's length are one setting (the cells no
# longer matter there), the cheapest
LADDER_BLOCKS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
LADDER_CELLS = (1, 2)  # multiples of the config's k_clusters


@register_method
class Muse(Method):
    name = "muse"
    description = ("multipole semantic attention for long prefills (clustered key summaries + exact retrieval of "
                   "blocks); exact decode")
    config_cls = MuseConfig
    module_cls = MuseAttention
    window_conflict = "approximates full causal attention (cluster summaries of every earlier block)"

    def check_layers(self, specs, config) -> None:
        super().check_layers(specs, config)
        heads = config.exact_heads
        few = [s for s in specs if heads and heads[-1] >= s.num_heads]
        if few:
            raise ConfigError(f"muse: exact_heads={heads} names query head {heads[-1]}, but layer {few[0].layer_idx} has "
                              f"{few[0].num_heads} query heads (0-{few[0].num_heads - 1})")

    @contextlib.contextmanager
    def call_report(self):
        """What the run-time guard did in the calls inside (guard.py's `guard_log`): its summary line, if any call ran."""
        with guard_log() as log:
            yield lambda: [log.summary()] if log.calls else []

    def approximation_start(self, config: MuseConfig, device_type: str = "cpu", head_dim: int = 64) -> Approximation:
        """Above min_seq_len (which depends on the device and the head dim), past the blocks each query block attends
        exactly."""
        L = int(config.get("block_size"))
        exact, what = self._exact_blocks(config)
        first = (exact + 1) * L
        min_len = config.min_len(device_type, head_dim)
        return Approximation(max(min_len, first + 1), first, (
            f"each query block attends {what} = {exact} earlier blocks of block_size={L} exactly, so the far field "
            f"starts at block {exact + 1} (token {first})"
            + (f" in prefills of min_seq_len={min_len} tokens or more" if min_len > first else "")))

    @staticmethod
    def _exact_blocks(config: MuseConfig) -> tuple[int, str]:
        """(earlier blocks a query block attends exactly, how they add up)."""
        if config.far_field == "tilted":
            return (int(config.local_blocks) + int(config.get("topk_blocks")),
                    f"local_blocks={config.local_blocks} + topk_blocks={config.get('topk_blocks')}")
        return (int(config.sink_blocks) + int(config.local_blocks) + int(config.get("topk_blocks"))
                + int(config.get("peak_blocks")),
                f"sink_blocks={config.sink_blocks} + local_blocks={config.local_blocks} + "
                f"topk_blocks={config.get('topk_blocks')} + peak_blocks={config.get('peak_blocks')}")

    def attention_profile(self, config: MuseConfig, head_dim: int, seq_len: int, kernels: bool
                          ) -> tuple[float, float]:
        """The kernels: the blocks attended exactly (at most half a causal row) and one super-key per key cell of
        every block; the dense reference: every score, its mask and weights."""
        if not kernels:
            return seq_len, 3 * seq_len
        L = int(config.get("block_size"))
        exact, _ = self._exact_blocks(config)
        return min(L * exact, seq_len / 2) + seq_len / L * int(config.get("k_clusters")), 4 * head_dim

    def calibration(self) -> MuseCalibration:
        return MuseCalibration(self)

    def attended_keys(self, config: MuseConfig, seq_len: int) -> tuple[float, float]:
        """(exactly attended keys, super-keys) per query and head of `config` over one sequence of `seq_len` tokens
        (kernels.muse.attended_keys), the exact heads aside."""
        return attended_keys(seq_len, **config.kernel_kwargs())

    def calibration_ladder(self, config: MuseConfig, seq_len: int) -> list[dict]:
        """The settings `longctx_patch.calibrate` measures on every layer, as overrides of `config`: budgets of
        retrieved blocks (LADDER_BLOCKS) and key cells (LADDER_CELLS times its k_clusters, at most block_size),
        cheapest first by attended keys at `seq_len`; the settings that retrieve every far block there count once."""
        L, local = config.get("block_size"), config.local_blocks
        far_max = max(0, math.ceil(seq_len / L) - 1 - local)
        tilted = config.far_field == "tilted"
        cells = sorted({min(L, m * config.get("k_clusters")) for m in LADDER_CELLS})
        out, seen_all = [], False
        for b in LADDER_BLOCKS:
            blocks = b if tilted else config.sink_blocks + 2 * b
            if blocks >= far_max:
                if seen_all:
                    continue
                seen_all = True
                over = dict(topk_blocks=b) if tilted else dict(topk_blocks=b, peak_blocks=b)
                out.append(dict(over, k_clusters=cells[0]))
                continue
            for c in cells:
                over = dict(topk_blocks=b) if tilted else dict(topk_blocks=b, peak_blocks=b)
                out.append(dict(over, k_clusters=c))

        def keys(over):
            return sum(self.attended_keys(self.parse_config({**config.to_dict(), **over}), seq_len))

        return sorted(out, key=keys)

    def after_patch(self, model, modules, config) -> None:
        dev = next((p.device for p in model.parameters()), None)
        if dev is not None and dev.type != "cuda" and config.backend != "torch":
            warnings.warn(
                "muse: the model is on the CPU, where MuSe runs its dense PyTorch reference, which is slower than "
                "exact attention (one SmolLM2 layer at 8k tokens: 6.4 s against 0.47 s on 2 cores). MuSe's speed "
                "comes from its Triton kernels on CUDA: move the model there (model.cuda(); CLI: --device cuda) for long "
                "prefills, or use the CPU for checks only. backend='torch' (CLI: --set backend=torch) silences this.", stacklevel=3)


__all__ = ["CROSSOVER", "FAR_FIELD_DEFAULTS", "GuardCall", "GuardLog", "LADDER_BLOCKS", "LADDER_CELLS", "Muse",
           "MuseAttention", "MuseCalibration", "MuseConfig", "Q_CLUSTERS", "guard_log"]
