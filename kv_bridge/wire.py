"""KV wire format: length-prefixed, checksummed frames; JSON headers, raw little-endian tensor payloads.

Frame:  type u8 | body_len u32 | body | crc32(body) u32     (all little-endian; no pickle anywhere)
Stream: HEADER ->(receiver answers ACK or ERROR)-> KV* -> DONE   (or ERROR from the sender at any point)
KV body: layer u32 | token_start u32 | token_count u32 | k_scale f32 | v_scale f32 | K (H, count, D) | V (H, count, D)
         in the HEADER's wire dtype (kv_bridge/dtypes.py); scales are 1.0 except for fp8.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from kv_bridge import dtypes

VERSION = 1
HEADER, KV, DONE, ERROR, ACK = 1, 2, 3, 4, 5
FRAME_TYPES = {HEADER, KV, DONE, ERROR, ACK}
PREFIX = struct.Struct("<BI")
KV_PREFIX = struct.Struct("<IIIff")
CRC = struct.Struct("<I")
MAX_JSON_BYTES = 64 << 10


class WireError(ValueError):
    """A frame or stream violates the wire format (bad type, bound, checksum or shape)."""


@dataclass(frozen=True)
class StreamHeader:
    """What a transfer carries; the receiver checks it against what it expects before any payload."""

    transfer_id: str
    fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    start: int  # first token position the KV covers
    num_tokens: int
    version: int = VERSION

    def to_json(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, obj: dict) -> "StreamHeader":
        try:
            hdr = cls(**{k: obj[k] for k in cls.__dataclass_fields__})
        except (KeyError, TypeError) as e:
            raise WireError(f"bad stream header: {e}") from None
        if hdr.version != VERSION:
            raise WireError(f"wire version {hdr.version} not supported (this side speaks {VERSION})")
        if hdr.dtype not in dtypes.STORAGE:
            raise WireError(f"wire dtype {hdr.dtype!r} not supported; expected one of {sorted(dtypes.STORAGE)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "start", "num_tokens"):
            if not isinstance(getattr(hdr, name), int) or getattr(hdr, name) < 0:
                raise WireError(f"bad stream header field {name}={getattr(hdr, name)!r}")
        return hdr

    def kv_bytes(self, count: int, itemsize: int | None = None) -> int:
        """Payload bytes of one KV frame of `count` tokens (K and V), in the wire dtype unless told otherwise."""
        return 2 * self.num_kv_heads * count * self.head_dim * (itemsize or dtypes.itemsize(self.dtype))


def frame_parts(ftype: int, *body: bytes | memoryview) -> list[bytes | memoryview]:
    """Buffers that, written in order, form one frame (avoids joining large payloads)."""
    length = sum(len(b) for b in body)
    crc = 0
    for b in body:
        crc = zlib.crc32(b, crc)
    return [PREFIX.pack(ftype, length), *body, CRC.pack(crc)]


def json_frame(ftype: int, obj: dict) -> bytes:
    return b"".join(frame_parts(ftype, json.dumps(obj).encode()))


def kv_frame_parts(layer: int, start: int, keys: np.ndarray, values: np.ndarray,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> list:
    """keys, values: contiguous (H, count, D) arrays in the header's wire storage dtype."""
    count = keys.shape[1]
    return frame_parts(KV, KV_PREFIX.pack(layer, start, count, k_scale, v_scale),
                       memoryview(keys).cast("B"), memoryview(values).cast("B"))


def check_prefix(ftype: int, length: int, max_body: int) -> None:
    """Validate a frame prefix before anything is allocated for its body."""
    if ftype not in FRAME_TYPES:
        raise WireError(f"unknown frame type {ftype}")
    limit = max_body if ftype == KV else MAX_JSON_BYTES
    if length > limit:
        raise WireError(f"frame of type {ftype} declares {length} bytes, over the bound of {limit}")


def check_crc(body: bytes | memoryview, crc_bytes: bytes) -> None:
    (want,) = CRC.unpack(crc_bytes)
    if zlib.crc32(body) != want:
        raise WireError("frame checksum mismatch")


def parse_json(body: bytes | memoryview) -> dict:
    try:
        obj = json.loads(bytes(body))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"frame body is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise WireError("frame body must be a JSON object")
    return obj


def parse_kv(body: memoryview, hdr: StreamHeader) -> tuple[int, int, np.ndarray, np.ndarray]:
    """Decode a KV frame body into (layer, token_start, K, V) as float32 (H, count, D) arrays."""
    if len(body) < KV_PREFIX.size:
        raise WireError("KV frame shorter than its prefix")
    layer, start, count, k_scale, v_scale = KV_PREFIX.unpack_from(body)
    if layer >= hdr.num_layers:
        raise WireError(f"KV frame for layer {layer}, stream has {hdr.num_layers} layers")
    end = hdr.start + hdr.num_tokens
    if count == 0 or start < hdr.start or start + count > end:
        raise WireError(f"KV frame tokens [{start}, {start + count}) outside the stream's [{hdr.start}, {end})")
    if len(body) - KV_PREFIX.size != hdr.kv_bytes(count):
        raise WireError(f"KV frame payload is {len(body) - KV_PREFIX.size} bytes, shape says {hdr.kv_bytes(count)}")
    if not (np.isfinite(k_scale) and np.isfinite(v_scale) and k_scale > 0 and v_scale > 0):
        raise WireError(f"KV frame scales must be finite and positive, got {k_scale}, {v_scale}")
    shape = (hdr.num_kv_heads, count, hdr.head_dim)
    half = hdr.kv_bytes(count) // 2
    dt = np.dtype(dtypes.STORAGE[hdr.dtype]).newbyteorder("<")
    k = np.frombuffer(body, dtype=dt, count=half // dt.itemsize, offset=KV_PREFIX.size).reshape(shape)
    v = np.frombuffer(body, dtype=dt, count=half // dt.itemsize, offset=KV_PREFIX.size + half).reshape(shape)
    return layer, start, dtypes.to_float32(k, hdr.dtype, k_scale), dtypes.to_float32(v, hdr.dtype, v_scale)
