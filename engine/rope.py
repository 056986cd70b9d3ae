"""Rotary position embeddings as transformers computes them: the settings of a config in
either spelling (with the family's defaults), the inverse frequencies of the default,
linear and yarn types, and the cos/sin table of a step's positions."""

import math
from dataclasses import dataclass

import numpy as np

ROPE_TYPES = ("default", "linear", "yarn")


def rope_parameters(cfg: dict, defaults: dict) -> dict:
    """The RoPE settings of a config in either spelling: transformers 5's `rope_parameters`
    or the hub's top-level `rope_theta` plus `rope_scaling`; a config with neither takes
    the family's `defaults` (its transformers config class's: gpt-oss's is yarn, GLM-4.5's
    rotates half the head). Returns a dict with at least rope_type and rope_theta."""
    params = dict(cfg.get("rope_parameters") or {})
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", defaults["rope_theta"]))
    given = set(params) | ({"rope_type"} if "type" in params else set())
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", cfg.get("rope_theta", defaults["rope_theta"]))
    if cfg.get("partial_rotary_factor") is not None:  # the hub's spelling (GLM-4.5): at the top level
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if not given - {"rope_theta"}:  # the config sets no RoPE type: the family's whole default
        params |= {k: v for k, v in defaults.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if "partial_rotary_factor" in defaults:
        params.setdefault("partial_rotary_factor", defaults["partial_rotary_factor"])
    return params


def rope_inv_freq(params: dict, head_dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim/2] and attention scaling, as transformers computes them
    (float32 arithmetic) for the default, linear and yarn RoPE types."""
    base = float(params["rope_theta"])
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(base), exps).astype(np.float32)  # [dim/2]
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq, 1.0
    factor = params.get("factor")
    if kind == "linear":
        return (inv_freq / np.float32(factor)).astype(np.float32), 1.0
    # yarn
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    if factor is None:
        factor = max_position_embeddings / original

    def mscale_of(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = params.get("attention_factor")
    if attn is None:
        ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = mscale_of(factor, ms) / mscale_of(factor, ms_all) if ms and ms_all else mscale_of(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(n_rot):
        return (dim * math.log(original / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = np.float32(1) - ramp
    inv_interp = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    inv_freq = inv_interp * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq.astype(np.float32), float(attn)


@dataclass
class Rope:
    inv_freq: np.ndarray  # [hd/2] f32
    scaling: float

    def table(self, pos0: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        # -> cos, sin [n, hd/2] for positions pos0 .. pos0+n-1
        return self.at(np.arange(pos0, pos0 + n))

    def at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # positions [n] -> cos, sin [n, hd/2] (DeepSeek-V4's compressed entries: every rate-th)
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]
        cos = (np.cos(freqs) * np.float32(self.scaling)).astype(np.float32)
        sin = (np.sin(freqs) * np.float32(self.scaling)).astype(np.float32)
        return cos, sin
