"""Wire dtypes and their numpy decoding: float32, float16, bfloat16 (raw bits) and fp8 e4m3 (bytes + a scale),
into the decode node's KV dtype (the model's compute dtype: float32, float16 or bfloat16).

numpy has no bfloat16 or fp8: those travel as uint16 / uint8 codes, and a bfloat16 KV is held as its uint16 bits
(kv_bridge/mlx/cache.py views them as mx.bfloat16, no float32 detour).
"""

from __future__ import annotations

import numpy as np

# wire name -> numpy storage dtype of the payload
STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "float8_e4m3": np.uint8}
E4M3_MAX = 448.0
# decode-side KV dtypes (what the receiver allocates and MLX holds) -> numpy storage
TARGETS = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def itemsize(name: str) -> int:
    return np.dtype(STORAGE[name]).itemsize


def _e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 fp8 e4m3 (OCP "fn": no inf, 0x7f/0xff are NaN) codes."""
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = (codes & 0x7).astype(np.float64)
    normal = (1.0 + man / 8.0) * np.exp2(exp.astype(np.float64) - 7.0)
    subnormal = (man / 8.0) * np.exp2(-6.0)
    vals = sign * np.where(exp == 0, subnormal, normal)
    vals[(codes & 0x7F) == 0x7F] = np.nan
    return vals.astype(np.float32)


E4M3_TABLE = _e4m3_table()


def target_itemsize(name: str) -> int:
    """Bytes per element of a decode-side KV dtype; ValueError names the ones there are."""
    if name not in TARGETS:
        raise ValueError(f"KV dtype {name!r} not supported on a decode node; expected one of {sorted(TARGETS)}")
    return np.dtype(TARGETS[name]).itemsize


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest, ties to even, as MLX casts (NaN: its 0x7fc0)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    r = (bits >> 16) & 1
    r += 0x7FFF
    r += bits  # wraps only for a negative NaN's bits, fixed below
    r >>= 16
    out = r.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


E4M3_BF16 = to_bfloat16(E4M3_TABLE)  # every e4m3 value is exact in bfloat16 (3-bit mantissa, exponents -9..8)


def to_float32(raw: np.ndarray, name: str, scale: float = 1.0) -> np.ndarray:
    """Widen a payload of wire dtype `name` to float32 (fp8 multiplied by its scale)."""
    if name == "float32":
        return raw
    if name == "float16":
        return raw.astype(np.float32)
    if name == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if name == "float8_e4m3":
        out = E4M3_TABLE[raw]
        return out if scale == 1.0 else out * np.float32(scale)
    raise ValueError(f"unknown wire dtype {name!r}")


def convert(raw: np.ndarray, name: str, target: str, scale: float = 1.0) -> np.ndarray:
    """A payload of wire dtype `name` in the storage of decode KV dtype `target`: the float32 value (to_float32)
    rounded once to `target` (nearest even), so a bf16 target holds exactly what float32 cast to bf16 would."""
    if name == target:
        return raw
    if target == "float32":
        return to_float32(raw, name, scale)
    if target == "bfloat16":
        if name == "float8_e4m3" and scale == 1.0:
            return E4M3_BF16[raw]
        return to_bfloat16(to_float32(raw, name, scale))
    if target == "float16":
        return to_float32(raw, name, scale).astype(np.float16)  # numpy rounds to nearest even
    raise ValueError(f"unknown KV dtype {target!r}")


def e4m3_encode(x: np.ndarray, scale: float) -> np.ndarray:
    """Nearest fp8 e4m3 code of x / scale (saturating), for tests and the numpy path of the fp8 wire option."""
    y = np.clip(np.asarray(x, np.float32) / np.float32(scale), -E4M3_MAX, E4M3_MAX)
    finite = E4M3_TABLE[:127]  # codes 0..126: the non-negative finite values, ascending
    mag = np.abs(y)
    idx = np.searchsorted(finite, mag).clip(1, 126)
    lower_closer = (mag - finite[idx - 1]) <= (finite[idx] - mag)
    code = np.where(lower_closer, idx - 1, idx).astype(np.uint8)
    return np.where(y < 0, code | 0x80, code).astype(np.uint8)
