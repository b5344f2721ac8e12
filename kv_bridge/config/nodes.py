"""`[[nodes]]`, `[prefill]`, `[decode]` and `[kv]`: each machine's role and addresses, and what its engine and
its KV transfers may use."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from kv_bridge.config.machines import MachineFields


class NodeConfig(MachineFields):
    name: str
    role: Literal["prefill", "decode"]
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    kv_port: int | None = Field(default=None, ge=1, le=65535, description="decode only: KV receiver port")
    kv_host: str | None = Field(default=None, description="decode only: the address the KV receiver listens on "
                                "when KV has its own link (a 10GbE/200Gb address beside the HTTP one); None: host")
    kv_advertise_host: str | None = Field(default=None, description="decode only: the host prefill nodes send KV to "
                                          "when it is not kv_host/host (NAT, a relay); None: kv_host or host")
    kv_advertise_port: int | None = Field(default=None, ge=1, le=65535, description="decode only: the port prefill "
                                          "nodes send KV to when it is not kv_port (a port forward, a relay)")
    max_inflight: int | None = Field(default=None, ge=1, description="most requests the gateway sends this node at "
                                     "once; a full node is skipped (None: no limit)")

    @model_validator(mode="after")
    def _kv_port(self) -> "NodeConfig":
        if self.role == "decode" and self.kv_port is None:
            raise ValueError(f"decode node {self.name!r} needs kv_port (the TCP port its KV receiver listens on)")
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def kv_target(self) -> dict:
        """Where prefill nodes push this decode node's KV: its advertised address, else host:kv_port."""
        return {"host": self.kv_advertise_host or self.kv_host or self.host,
                "port": self.kv_advertise_port or self.kv_port}


class PrefillConfig(BaseModel):
    dtype: str = Field(default="auto", description="vLLM model dtype; float32 makes bridged KV match MLX tightly")
    kv_cache_space_gib: int = Field(default=1, ge=1, description="VLLM_CPU_KVCACHE_SPACE on CPU hosts")
    gpu_memory_utilization: float = Field(default=0.3, gt=0, le=1)
    enforce_eager: bool | None = Field(
        default=None, description="unset: eager on CPU hosts, CUDA graphs on GPUs (the connector asks vLLM for "
        "piecewise graphs, so save_kv_layer still runs between layers); true/false forces it")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        default="auto", description="vLLM KV cache dtype; fp8 caches cross the wire as fp8 with their scales")
    max_num_batched_tokens: int | None = Field(default=None, ge=16)
    enable_prefix_caching: bool = Field(
        default=True, description="vLLM's own prefix cache: a follow-up turn recomputes only its new tokens")
    drop_page_cache: bool = Field(
        default=False, description="at start on a GPU, when vLLM's ask is more than is free: sync and free the page "
        "cache (echo 1 > /proc/sys/vm/drop_caches); needs root and a writable /proc/sys (docker run --privileged)")
    min_gpu_memory_utilization: float | None = Field(
        default=None, gt=0, le=1, description="at start, when gpu_memory_utilization does not fit what is free: "
        "start with what fits down to this (fewer KV blocks, said in the log); unset: wait for memory instead")


class DecodeConfig(BaseModel):
    kv_timeout_s: float = Field(default=30.0, gt=0, description="no KV progress (since the HEADER or "
                              "the last frame) for this long: prefill locally. Before the HEADER, kv_header_timeout_s")
    kv_header_timeout_s: float = Field(default=600.0, gt=0, description="longest wait for a transfer's HEADER: the "
                                     "prefill may be queued in vLLM behind live work; the gateway aborts the transfer "
                                     "at once when that prefill fails, so this only bounds a gateway that vanished")
    kv_bits: int | None = Field(
        default=None, description="4 or 8: quantize decode KV caches (mlx-lm QuantizedKVCache), bridged and local alike")
    kv_group_size: int = Field(default=64, description="32, 64 or 128")
    prefix_cache_bytes: int = Field(
        default=1 << 30, ge=0, description="finished conversations' KV kept for reuse (mlx-lm LRUPromptCache), so a "
        "follow-up turn moves only the KV the node lacks; 0 turns prefix reuse off")
    mlx_cache_limit_bytes: int = Field(
        default=1 << 30, ge=0, description="MLX's buffer cache (mx.set_cache_limit, set at decode start): freed "
        "buffers kept for reuse, so steps do not allocate anew; MLX's own default is all its memory limit")
    max_batch_size: int = Field(default=32, ge=1, description="most generations one model decodes in a batch; "
                                "more wait their turn (mlx-lm BatchGenerator completion_batch_size)")

    @model_validator(mode="after")
    def _quantization(self) -> "DecodeConfig":
        if self.kv_bits not in (None, 4, 8):
            raise ValueError(f"kv_bits must be 4, 8 or unset, got {self.kv_bits}")
        if self.kv_group_size not in (32, 64, 128):
            raise ValueError(f"kv_group_size must be 32, 64 or 128, got {self.kv_group_size}")
        return self


class KVConfig(BaseModel):
    max_tokens: int = Field(default=131072, ge=1, description="largest token count one transfer may declare")
    max_frame_bytes: int = Field(default=256 << 20, ge=1024, description="largest KV frame payload accepted")
    max_transfer_bytes: int = Field(default=8 << 30, ge=1024, description="largest total KV one transfer may declare")
    max_inflight_bytes: int = Field(
        default=8 << 30, ge=1024, description="decode node: most KV (in each model's dtype) its open transfers and the requests "
        "they feed may hold at once; a request over it gets 429 and the gateway tries another node")
    pool_bytes: int = Field(
        default=2 << 30, ge=0, description="decode node: idle receive buffers kept for the next transfers (a fresh "
        "buffer is paid in page faults as the KV lands); 0 allocates every transfer anew")
    sender_bytes: int = Field(
        default=1 << 30, ge=1 << 20, description="prefill node: most KV (host copies, pinned on CUDA) queued for "
        "one decode node; a transfer whose frame would pass it fails (decode prefills locally), the forward pass "
        "never waits")
    connect_timeout_s: float = Field(default=5.0, gt=0)
    send_timeout_s: float = Field(default=10.0, gt=0, description="prefill node: a decode node that takes no KV for "
                                  "this long fails its own transfers (its frames are dropped, the gateway falls back)")
    wire_dtype: Literal["auto", "float8_e4m3"] = Field(
        default="auto", description="auto: the cache's own dtype; float8_e4m3: scaled fp8 on the wire (1/2 of bf16)")
