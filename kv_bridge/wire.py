"""KV wire format: length-prefixed, checksummed or tagged frames; JSON headers, raw little-endian tensor payloads.

Frame:  type u8 | body_len u32 | body | trailer      (all little-endian; no pickle anywhere)
        trailer: checksum(body), or on a stream with frame MACs the frame's 32-byte tag alone (it catches whatever
        the checksum would, so the payload is hashed once per side, not twice).
        checksum: xxh3_64 u64 for KV frames (about 29 GB/s here, against 2.4-6.8 GB/s for zlib's crc32, which
        sat on the transfer's critical path on both sides), crc32 u32 for the small JSON frames: HEADER, ACK,
        ERROR and DONE read alike in every wire version, so a version mismatch is refused by name.
Stream: HEADER ->(receiver answers ACK or ERROR)-> KV* -> DONE   (or ERROR from the sender at any point)
KV body: layer u32 | token_start u32 | token_count u32 | k_scale f32 | v_scale f32 | K (H, count, D) | V (H, count, D)
         in the HEADER's wire dtype (kv_bridge/dtypes.py); scales are 1.0 except for fp8.
Streams: one transfer may arrive as several streams (tensor/pipeline-parallel ranks), each declaring the KV heads
[head_start, head_start + head_count) and the layers it carries; its KV frames hold only those heads.
Auth (when nodes share a secret): the HEADER's `auth` is an HMAC-SHA256 of its fields; with `frame_mac`, every
later sender frame ends in a 32-byte keyed-BLAKE3 tag chained from it (FrameMac) in place of its checksum.
Writers hash a payload piece by piece just before sending each piece (frame_batches), while it is in cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import re
import struct
import zlib
from dataclasses import dataclass

import blake3
import numpy as np
import xxhash

from kv_bridge import dtypes

VERSION = 4  # 4: a tagged frame carries no checksum; 3: keyed-BLAKE3 tags after the checksum; 2: HMAC-SHA256 tags,
# KV frames checksummed with xxh3_64; 1: crc32
HEADER, KV, DONE, ERROR, ACK = 1, 2, 3, 4, 5
FRAME_TYPES = {HEADER, KV, DONE, ERROR, ACK}
PREFIX = struct.Struct("<BI")
KV_PREFIX = struct.Struct("<IIIff")
CRC = struct.Struct("<I")  # JSON frames: crc32
XXH = struct.Struct("<Q")  # KV frames: xxh3_64
MAX_CHECKSUM = XXH.size
MAX_JSON_BYTES = 64 << 10
TAG_BYTES = 32  # header auth: HMAC-SHA256; frame tags: keyed BLAKE3
FRAME_KEY_CONTEXT = "disagg kv frame-mac v3"  # BLAKE3 derive_key context: frame tags get a key of their own (the tag
# is computed as in wire version 3; version 4 only dropped the checksum before it)
MAX_DRAFT_LAYERS = 8  # a drafter's own KV layers after the model's (an EAGLE-3 head: 1)
HOT_BYTES = 256 << 10  # a writer hashes this much of a payload, then sends it while it is still in cache
_HEX_TAG = re.compile(f"[0-9a-f]{{{2 * TAG_BYTES}}}")


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
    head_start: int = 0  # this stream's KV heads: [head_start, head_start + head_count); head_count 0: all of them
    head_count: int = 0
    layers: tuple[int, ...] | None = None  # the layers this stream carries (ascending); None: all of them
    window: int = 0  # > 0: on window_layers only the last `window` tokens of the transfer are sent (sliding layers)
    window_layers: tuple[int, ...] = ()
    # > 0: layers num_layers.. carry a learned drafter's own KV of the prompt (an EAGLE-3 head run by the prefill
    # node), with the model's heads and head_dim; the decode node hands them to its head (docs/speculative.md)
    draft_layers: int = 0
    auth: str | None = None  # hex HMAC-SHA256 over the fields above and frame_mac (sign_header); None: open
    frame_mac: bool = False  # every later sender frame carries a chained tag

    def to_json(self) -> dict:
        out = dict(self.__dict__)
        for name in _DEFAULTED:  # a single full stream's header is byte-for-byte what it was before these existed
            if out[name] == _FIELD_DEFAULTS[name]:
                del out[name]
        if self.auth is None:  # an open stream's header is byte-for-byte what it was before auth existed
            del out["auth"], out["frame_mac"]
        for name in ("layers", "window_layers"):
            if name in out:
                out[name] = list(out[name])
        return out

    @property
    def heads(self) -> int:
        """KV heads each frame of this stream carries."""
        return self.head_count or self.num_kv_heads

    @property
    def all_layers(self) -> int:
        """The model's layers and the drafter's after them."""
        return self.num_layers + self.draft_layers

    @property
    def stream_layers(self) -> tuple[int, ...]:
        return tuple(range(self.all_layers)) if self.layers is None else self.layers

    def layer_start(self, layer: int) -> int:
        """First token position this stream sends for `layer` (a sliding layer's window starts late)."""
        if self.window and layer in self.window_layers:
            return max(self.start, self.start + self.num_tokens - self.window)
        return self.start

    @classmethod
    def from_json(cls, obj: dict) -> "StreamHeader":
        optional = {"auth", "frame_mac", *_DEFAULTED}
        try:
            fields = {k: obj[k] for k in cls.__dataclass_fields__ if k not in optional or k in obj}
            for name in ("layers", "window_layers"):
                if fields.get(name) is not None:
                    fields[name] = _int_tuple(fields[name], name)
            hdr = cls(**fields)
        except (KeyError, TypeError) as e:
            raise WireError(f"bad stream header: {e}") from None
        for name in ("transfer_id", "fingerprint", "dtype"):
            if not isinstance(getattr(hdr, name), str):
                raise WireError(f"bad stream header field {name}: expected a string")
        if hdr.auth is not None and not (isinstance(hdr.auth, str) and _HEX_TAG.fullmatch(hdr.auth)):
            raise WireError("bad stream header field auth: expected 64 lowercase hex digits")
        if not isinstance(hdr.frame_mac, bool) or (hdr.frame_mac and hdr.auth is None):
            raise WireError("bad stream header field frame_mac: a bool, true only with auth")
        if hdr.version != VERSION:
            raise WireError(f"wire version {hdr.version} not supported (this side speaks {VERSION})")
        if hdr.dtype not in dtypes.STORAGE:
            raise WireError(f"wire dtype {hdr.dtype!r} not supported; expected one of {sorted(dtypes.STORAGE)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "start", "num_tokens", "head_start", "head_count",
                     "window", "draft_layers"):
            if not isinstance(getattr(hdr, name), int) or getattr(hdr, name) < 0:
                raise WireError(f"bad stream header field {name}={getattr(hdr, name)!r}")
        _check_slices(hdr)
        return hdr

    def kv_bytes(self, count: int, itemsize: int | None = None) -> int:
        """Payload bytes of one KV frame of `count` tokens (K and V), in the wire dtype unless told otherwise."""
        return 2 * self.heads * count * self.head_dim * (itemsize or dtypes.itemsize(self.dtype))


_DEFAULTED = ("head_start", "head_count", "layers", "window", "window_layers", "draft_layers")
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(StreamHeader)}


def _int_tuple(value, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise WireError(f"bad stream header field {name}: expected a list of integers")
    return tuple(value)


def _check_slices(hdr: StreamHeader) -> None:
    """The heads and layers a stream declares lie inside the model's, layers ascending without repeats."""
    if hdr.draft_layers > MAX_DRAFT_LAYERS:
        raise WireError(f"bad stream header field draft_layers={hdr.draft_layers}: at most {MAX_DRAFT_LAYERS}")
    if hdr.head_start + hdr.heads > hdr.num_kv_heads:
        raise WireError(f"stream heads [{hdr.head_start}, {hdr.head_start + hdr.heads}) outside the model's "
                        f"{hdr.num_kv_heads}")
    for name in ("layers", "window_layers"):
        ls = getattr(hdr, name) or ()
        if any(b <= a for a, b in zip(ls, ls[1:])) or any(not 0 <= x < hdr.all_layers for x in ls):
            raise WireError(f"bad stream header field {name}: ascending layer indices below {hdr.all_layers}")


def _auth_message(hdr: StreamHeader) -> bytes:
    fields = [hdr.version, hdr.transfer_id, hdr.fingerprint, hdr.num_layers, hdr.num_kv_heads, hdr.head_dim,
              hdr.dtype, hdr.start, hdr.num_tokens, hdr.frame_mac]
    sliced = [hdr.head_start, hdr.head_count, hdr.layers and list(hdr.layers), hdr.window, list(hdr.window_layers)]
    if sliced != [0, 0, None, 0, []]:  # a single full stream signs exactly what it signed before streams were sliced
        fields.append(sliced)
    if hdr.draft_layers:  # signed too; a header without them signs what it signed before they existed
        fields.append({"draft_layers": hdr.draft_layers})
    return b"disagg kv header\0" + json.dumps(fields, separators=(",", ":")).encode()  # JSON: unambiguous


def sign_header(hdr: StreamHeader, key: bytes, frame_mac: bool = True) -> StreamHeader:
    """The header with its authenticator: HMAC-SHA256(key, every field) in hex."""
    signed = dataclasses.replace(hdr, frame_mac=frame_mac, auth=None)
    return dataclasses.replace(signed, auth=hmac.new(key, _auth_message(signed), hashlib.sha256).hexdigest())


def header_auth_ok(hdr: StreamHeader, key: bytes) -> bool:
    want = hmac.new(key, _auth_message(hdr), hashlib.sha256).hexdigest()
    return hdr.auth is not None and hmac.compare_digest(want, hdr.auth)


class FrameMac:
    """Chained per-frame tags: tag_i = BLAKE3(frame key, tag_{i-1} | type u8 | body_len u32 | body), tag_0 = the
    header's auth, frame key = BLAKE3-derive_key(FRAME_KEY_CONTEXT, KV key). The chain binds each frame to its
    stream and position: none can be dropped, reordered, replayed from another stream or spliced in, even by
    someone on the path. Keyed BLAKE3 rather than HMAC-SHA256: 7.4 against 1.1 GB/s on one core here
    (bench/bench_kv_auth.py), so the tag no longer sets the transfer's pace."""

    def __init__(self, key: bytes, header_auth: str):
        self._key = blake3.blake3(key, derive_key_context=FRAME_KEY_CONTEXT).digest()
        self._prev = bytes.fromhex(header_auth)

    def begin(self, ftype: int, length: int):
        """A running tag for the next frame (type, body length): update() it with the body in order, then
        seal_running() (sender) or check_running() (receiver)."""
        h = blake3.blake3(self._prev, key=self._key)
        h.update(PREFIX.pack(ftype, length))
        return h

    def _advance(self, h) -> bytes:
        self._prev = h.digest()
        return self._prev

    def seal(self, parts: list) -> list:
        """frame_parts(...) output with its checksum replaced by its tag, to be written in order."""
        ftype, length = PREFIX.unpack(parts[0])
        h = self.begin(ftype, length)
        for b in parts[1:-1]:
            h.update(b)
        return [*parts[:-1], self._advance(h)]

    def seal_running(self, h) -> bytes:
        """The tag of a running tag from begin(), fed the whole body; the chain moves on."""
        return self._advance(h)

    def check(self, ftype: int, body: bytes | memoryview, tag: bytes) -> None:
        self.check_parts(ftype, len(body), (body,), tag)

    def check_parts(self, ftype: int, length: int, parts, tag: bytes) -> None:
        """As check(), for a body received in pieces (`parts`, in order, `length` bytes in all)."""
        h = self.begin(ftype, length)
        for b in parts:
            h.update(b)
        self.check_running(h, tag)

    def check_running(self, h, tag: bytes | memoryview) -> None:
        """Check a running tag from begin(), fed the whole body, against the frame's `tag`; the chain moves on."""
        if not hmac.compare_digest(self._advance(h), bytes(tag)):
            raise WireError("frame authentication failed (tag mismatch): the stream was altered or forged")


def checksum_size(ftype: int) -> int:
    return XXH.size if ftype == KV else CRC.size


def trailer_size(ftype: int, mac: FrameMac | None) -> int:
    """Bytes after a frame's body: its tag on a stream with frame MACs, else its checksum."""
    return TAG_BYTES if mac is not None else checksum_size(ftype)


class _Crc32:
    """zlib.crc32 behind xxhash's running-hash methods."""

    def __init__(self):
        self.value = 0

    def update(self, b) -> None:
        self.value = zlib.crc32(b, self.value)

    def intdigest(self) -> int:
        return self.value


def _running_checksum(ftype: int):
    """A frame body's running checksum (update() with each buffer in order; see _checksum_trailer)."""
    return xxhash.xxh3_64() if ftype == KV else _Crc32()


def _checksum_trailer(ftype: int, h) -> bytes:
    return (XXH if ftype == KV else CRC).pack(h.intdigest())


def checksum(ftype: int, body) -> bytes:
    """The trailer of a frame whose body is `body` (buffers, in order): xxh3_64 for KV frames, crc32 otherwise."""
    h = _running_checksum(ftype)
    for b in body:
        h.update(b)
    return _checksum_trailer(ftype, h)


def kv_digest(first: bytes | memoryview):
    """A running KV frame checksum to update() with the rest of the body as it arrives; see check_digest."""
    return xxhash.xxh3_64(first)


def check_digest(digest, got: bytes | memoryview) -> None:
    if _checksum_trailer(KV, digest) != bytes(got):
        raise WireError("frame checksum mismatch")


def frame_parts(ftype: int, *body: bytes | memoryview) -> list[bytes | memoryview]:
    """Buffers that, written in order, form one frame (avoids joining large payloads)."""
    return [PREFIX.pack(ftype, sum(len(b) for b in body)), *body, checksum(ftype, body)]


def frame_batches(ftype: int, body: list, mac: FrameMac | None = None):
    """One frame (prefix | body | trailer) as batches of buffers to write in order, one sendmsg each: every piece of
    the body (HOT_BYTES at most) is hashed just before its batch is handed out, so the writer sends bytes the hash
    has just pulled into cache; a separate pass over a cold KV payload cost the sender ~11 ms a 1k-token transfer.
    The trailer is the frame's tag with `mac` (the chain moves on), else its checksum (frame_parts' bytes)."""
    views = [memoryview(b).cast("B") for b in body]
    length = sum(len(v) for v in views)
    h = mac.begin(ftype, length) if mac is not None else _running_checksum(ftype)
    batch, size = [PREFIX.pack(ftype, length)], 0
    for v in views:
        off = 0
        while off < len(v):
            piece = v[off:off + HOT_BYTES - size]
            h.update(piece)
            batch.append(piece)
            size, off = size + len(piece), off + len(piece)
            if size == HOT_BYTES:
                yield batch
                batch, size = [], 0
    batch.append(mac.seal_running(h) if mac is not None else _checksum_trailer(ftype, h))
    yield batch


def json_frame(ftype: int, obj: dict) -> bytes:
    return b"".join(frame_parts(ftype, json.dumps(obj).encode()))


def kv_body(layer: int, start: int, keys: np.ndarray, values: np.ndarray,
            k_scale: float = 1.0, v_scale: float = 1.0) -> list:
    """A KV frame's body as buffers (no copy). keys, values: contiguous (H, count, D) arrays in the header's wire
    storage dtype."""
    return [KV_PREFIX.pack(layer, start, keys.shape[1], k_scale, v_scale),
            memoryview(keys).cast("B"), memoryview(values).cast("B")]


def kv_frame_parts(layer: int, start: int, keys: np.ndarray, values: np.ndarray,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> list:
    """A whole checksummed KV frame's buffers (see kv_body)."""
    return frame_parts(KV, *kv_body(layer, start, keys, values, k_scale, v_scale))


def check_prefix(ftype: int, length: int, max_body: int) -> None:
    """Validate a frame prefix before anything is allocated for its body."""
    if ftype not in FRAME_TYPES:
        raise WireError(f"unknown frame type {ftype}")
    limit = max_body if ftype == KV else MAX_JSON_BYTES
    if length > limit:
        raise WireError(f"frame of type {ftype} declares {length} bytes, over the bound of {limit}")


def check_checksum(ftype: int, parts, got: bytes | memoryview) -> None:
    """Check a frame's trailer against its body, received whole or in pieces (`parts`, in order)."""
    if checksum(ftype, parts) != bytes(got):
        raise WireError("frame checksum mismatch")


def parse_json(body: bytes | memoryview) -> dict:
    try:
        obj = json.loads(bytes(body))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"frame body is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise WireError("frame body must be a JSON object")
    return obj


def parse_kv_prefix(prefix: bytes | memoryview, body_len: int, hdr: StreamHeader) -> tuple[int, int, int, float, float]:
    """Validate a KV frame's prefix against its stream before its payload is read anywhere:
    (layer, token_start, token_count, k_scale, v_scale)."""
    if body_len < KV_PREFIX.size:
        raise WireError("KV frame shorter than its prefix")
    layer, start, count, k_scale, v_scale = KV_PREFIX.unpack_from(prefix)
    if layer >= hdr.all_layers or (hdr.layers is not None and layer not in hdr.layers):
        raise WireError(f"KV frame for layer {layer}, which the stream does not carry")
    end, first = hdr.start + hdr.num_tokens, hdr.layer_start(layer)
    if count == 0 or start < first or start + count > end:
        raise WireError(f"KV frame tokens [{start}, {start + count}) outside the stream's [{first}, {end}) "
                        f"for layer {layer}")
    if body_len - KV_PREFIX.size != hdr.kv_bytes(count):
        raise WireError(f"KV frame payload is {body_len - KV_PREFIX.size} bytes, shape says {hdr.kv_bytes(count)}")
    if not (np.isfinite(k_scale) and np.isfinite(v_scale) and k_scale > 0 and v_scale > 0):
        raise WireError(f"KV frame scales must be finite and positive, got {k_scale}, {v_scale}")
    return layer, start, count, k_scale, v_scale


def parse_kv(body: memoryview, hdr: StreamHeader, target: str = "float32") -> tuple[int, int, np.ndarray, np.ndarray]:
    """Decode a KV frame body into (layer, token_start, K, V): (H, count, D) arrays in the storage of decode KV
    dtype `target` (dtypes.TARGETS; bfloat16 as uint16 bits)."""
    layer, start, count, k_scale, v_scale = parse_kv_prefix(body, len(body), hdr)
    shape = (hdr.heads, count, hdr.head_dim)
    half = hdr.kv_bytes(count) // 2
    dt = np.dtype(dtypes.STORAGE[hdr.dtype]).newbyteorder("<")
    k = np.frombuffer(body, dtype=dt, count=half // dt.itemsize, offset=KV_PREFIX.size).reshape(shape)
    v = np.frombuffer(body, dtype=dt, count=half // dt.itemsize, offset=KV_PREFIX.size + half).reshape(shape)
    return layer, start, dtypes.convert(k, hdr.dtype, target, k_scale), dtypes.convert(v, hdr.dtype, target, v_scale)
