"""Mixer specs: a mixer chosen by name and options, parsed from the command line's text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ...errors import ConfigError
from .mixers import MIXERS, Mixer


@dataclass(frozen=True)
class MixerSpec:
    name: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.options)

    def build(self, d_model: int, n_heads: int) -> Mixer:
        return MIXERS[self.name](d_model, n_heads, **dict(self.options))


def parse_mixer(text: str) -> MixerSpec:
    """``"ovq"`` or ``"ovq:max_centroids=128,growth=64"`` -> :class:`MixerSpec` (values typed like the defaults)."""
    name, _, rest = str(text).strip().partition(":")
    name = name.strip().lower()
    if name not in MIXERS:
        raise ConfigError(f"unknown mixer {name!r}; choose from: {', '.join(MIXERS)}")
    cls = MIXERS[name]
    opts = []
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq or key not in cls.defaults:
            raise ConfigError(f"mixer {name!r}: bad option {item!r}; write KEY=VALUE with KEY one of: "
                              f"{', '.join(cls.defaults) or '(none)'}")
        default = cls.defaults[key]
        try:
            value = type(default)(val.strip()) if not isinstance(default, bool) else val.strip().lower() in ("1", "true", "yes")
        except ValueError:
            raise ConfigError(f"mixer {name!r}: {key} must be a {type(default).__name__}, got {val!r}") from None
        if key == "backend" and value not in ("auto", "torch", "triton"):
            raise ConfigError(f"mixer {name!r}: backend must be auto, torch or triton, got {value!r}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise ConfigError(f"mixer {name!r}: {key} must be >= 0, got {value}")
        opts.append((key, value))
    return MixerSpec(name, tuple(opts))


def parse_mixers(items: str | Sequence[str]) -> list[MixerSpec]:
    if isinstance(items, str):
        items = [items]
    out: list[MixerSpec] = []
    for it in items:
        # commas separate mixers unless they follow an option list ("ovq:a=1,b=2" stays one spec)
        parts: list[str] = []
        for piece in str(it).split(","):
            piece = piece.strip()
            if not piece:
                continue
            if parts and "=" in piece and ":" not in piece:
                parts[-1] += "," + piece
            else:
                parts.append(piece)
        out.extend(parse_mixer(p) for p in parts)
    labels = [s.label for s in out]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"a mixer is given twice: {', '.join(labels)}")
    if not out:
        raise ConfigError(f"no mixer given; choose from: {', '.join(MIXERS)}")
    return out


__all__ = ["MixerSpec", "parse_mixer", "parse_mixers"]
