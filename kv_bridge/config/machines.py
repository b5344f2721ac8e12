"""What config.toml says about each machine (RAM, disk) and each model's weight sizes: the inputs of
`disagg config check`'s memory and disk budget (backends/cli/config_check.py). Mixed into NodeConfig and ModelRoute.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

# What the OS and everything beside the role keep, when a node does not say (reserved_gib):
# - prefill (DGX Spark, GB10): vLLM's start-up check compares gpu_memory_utilization x total with the memory free
#   at start; on a 128 GB GB10 that is about 102 GiB at most (the page cache and the OS count as used).
# - decode (Mac Studio): macOS and its file cache (the node's process and a logged-in session are budgeted apart:
#   backends/decode/budget.py); Metal's wired limit must be raised to the rest (docker/install-mac.sh sets it).
DEFAULT_RESERVED_GIB = {"prefill": 26.0, "decode": 8.0}


class MachineFields(BaseModel):
    """Per [[nodes]] entry: the machine it runs on. Unset fields are not budgeted (config check warns)."""

    memory_gib: float | None = Field(default=None, gt=0, description="the machine's RAM / unified memory in GiB "
                                     "(DGX Spark 128, Mac Studio 96/192/256/512)")
    disk_gib: float | None = Field(default=None, gt=0, description="free disk for the model folders in GiB")
    reserved_gib: float | None = Field(default=None, ge=0, description="memory the OS, page cache and other "
                                       "processes keep (default: prefill 26, decode 8)")

    def reserved(self, role: str) -> float:
        return self.reserved_gib if self.reserved_gib is not None else DEFAULT_RESERVED_GIB[role]


class ModelSizes(BaseModel):
    """Per [[models]] entry: weight sizes for machines whose folder is not where the check runs. A folder that is
    there is measured instead (its *.safetensors)."""

    prefill_weights_gib: float | None = Field(default=None, gt=0, description="the prefill side's checkpoint "
                                              "(e.g. FP8 or MXFP4 safetensors) in GiB")
    decode_weights_gib: float | None = Field(default=None, gt=0, description="the decode side's MLX folder in GiB")
    answer_tokens: int = Field(default=3500, ge=1, description="the longest answer clients ask of this model (Ollama "
                               "num_predict, OpenAI max_tokens; the site's app: 2000-3500): `config check` budgets "
                               "its generated tokens' KV on each Mac; the gateway does not cap answers by it")
