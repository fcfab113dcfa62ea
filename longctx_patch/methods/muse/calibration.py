"""What `longctx_patch.calibrate` measures and sets for muse (`Muse.calibration()`, a `methods.base.MethodCalibration`):
the ladder of budgets (`Muse.calibration_ladder`), the op a setting runs (`kernels.muse.muse_attention` of its kernel
options), its exact heads (heads.py) and the keys a query attends (`Muse.attended_keys`). docs/muse.md, "Calibration".
"""

from __future__ import annotations

import json
import warnings

from ...errors import ConfigError, LongctxWarning
from ...kernels.muse import muse_attention
from ..base import MethodCalibration
from .heads import with_exact_heads


class MuseCalibration(MethodCalibration):
    def __init__(self, method) -> None:
        self.method = method  # the registered Muse

    def check_text(self, config, seq_len, specs, device_type) -> None:
        name = self.method.name
        L, local = config.get("block_size"), config.local_blocks
        if seq_len <= (local + 1) * L:
            raise ConfigError(f"the calibration text has {seq_len} tokens; {name} approximates only past "
                              f"(local_blocks + 1) x block_size = {(local + 1) * L} tokens, exact before: give a longer "
                              "text (the length the model will run: the error grows with it)")
        least = min(config.min_len(device_type, s.head_dim) for s in specs)
        if seq_len < least:
            warnings.warn(f"calibrating on {seq_len} tokens, but the patched layers run {name} from {least} tokens on "
                          f"{device_type} (min_seq_len): the errors measured here are those of shorter prefills than it "
                          "approximates; calibrate on a text of the length the model will run", LongctxWarning,
                          stacklevel=3)

    def ladder(self, config, seq_len):
        return self.method.calibration_ladder(config, seq_len)

    def key(self, config) -> str:
        return json.dumps(config.kernel_kwargs(), sort_keys=True)

    def attend(self, q, k, v, *, scale, config):
        return muse_attention(q, k, v, scale=scale, options=config.kernel_options(), backend=config.backend)

    def with_exact_heads(self, o, q, k, v, heads, *, scale):
        return with_exact_heads(o, q, k, v, heads, scale=scale)

    def attended_keys(self, config, seq_len):
        return self.method.attended_keys(config, seq_len)


__all__ = ["MuseCalibration"]
