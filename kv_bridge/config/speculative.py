"""A model's speculative decoding on its decode nodes ([models.speculative] in config.toml; docs/speculative.md):
which drafter, how many tokens it drafts, and what the node's controller weighs to turn drafting down, off and on.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator


# A draft for each site model with the same tokenizer (`disagg models prepare --role draft` checks the tokenizer
# files): Qwen3's small dense model shares Qwen3-Coder's byte-level BPE (151,643 tokens + Qwen3's added ones);
# gpt-oss-20b shares gpt-oss-120b's o200k_harmony. docs/speculative.md weighs what each costs on a Mac.
SITE_DRAFTS = {
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": "Qwen/Qwen3-0.6B",
    "Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8": "Qwen/Qwen3-0.6B",
    "openai/gpt-oss-120b": "openai/gpt-oss-20b",
}


class SpeculativeConfig(BaseModel):
    """Off by default. A decode node drafts only while the model's batch holds one generation (the lab's case: one
    request per model at a time); with more it decodes the batch as before."""

    method: str | list[str] = Field(
        default="off", description='a drafting source, a list of them (the controller picks per step), "auto" (every '
        'one this node has and the config allows) or "off". Sources: "prompt_lookup": n-gram matches in the prompt '
        'and the text so far (no extra model); "suffix": suffix decoding over the prompt and the model\'s earlier answers '
        '(backends/decode/speculative/suffix.py); "draft": a small model of the same tokenizer (draft_path) drafts '
        'greedily; "eagle3" / "dflash": a learned drafter over the model\'s own hidden states (draft_path: an EAGLE-3 '
        'head\'s or a DFlash drafter\'s folder, trained for this model; named explicitly, not by "auto"); the decode '
        'node refuses a name it has no source for (backends/decode/speculative/sources.py)')
    num_draft: int = Field(default=4, ge=1, le=16, description="most tokens drafted per verify step")
    ngram_max: int = Field(default=4, ge=1, le=16, description="prompt_lookup: longest suffix n-gram looked up")
    ngram_min: int = Field(default=2, ge=1, le=16, description="prompt_lookup: shortest suffix n-gram looked up")
    draft_path: str | None = Field(default=None, description="draft: the draft model's MLX folder (same tokenizer); "
                                   "eagle3 / dflash: the drafter's folder (config.json + safetensors)")
    suffix_store_tokens: int = Field(default=250_000, ge=2, description="suffix: tokens of this model's earlier "
                                     "answers the node keeps to draft from (oldest answers dropped first; ~90-600 B "
                                     "a token); they only ever propose tokens the model then verifies")
    adaptive: bool = Field(default=True, description="the node picks the draft length from the acceptance it "
                           "measures (false: always num_draft)")
    verify_cost: float = Field(
        default=0.1, ge=0.0, description="the prior only: what each drafted token adds to a verify step, as a fraction "
        "of a plain decode step, until the node has measured its own (cost_samples steps of each size at the "
        "context depth; exported as disagg_decode_spec_verify_cost). Drafting pays while expected tokens per step / "
        "(1 + k * verify_cost) > 1 + min_gain")
    cost_samples: int = Field(default=8, ge=1, le=64, description="timed steps of 1 row and of k + 1 rows (per "
                              "context-depth bucket) before the measured verify cost replaces verify_cost")
    draft_cost: float = Field(default=0.0, ge=0.0, description="draft: one draft-model token as a fraction of a "
                              "target decode step (added per drafted token to the cost)")
    min_gain: float = Field(default=0.05, ge=0.0, description="expected speedup below 1 + this: drafting turns off")
    ewma_alpha: float = Field(default=0.03, gt=0.0, le=1.0, description="discount per verify step of the "
                              "accepted and rejected counts the acceptance alpha is estimated from (1/this: about "
                              "how many recent verify steps it weighs)")
    hysteresis: float = Field(default=0.04, ge=0.0, description="drafting turns off only below 1 + min_gain - this "
                              "(on above 1 + min_gain), and k changes only for a quarter of this more speedup")
    probe_every: int = Field(default=32, ge=1, description="while off: plain steps before one probing verify step "
                             "(it drafts the smallest k that could pay), taken at the next step with a proposal")

    @property
    def sources(self) -> tuple[str, ...]:
        """The source names asked for: () when off, ("auto",) for every one."""
        names = (self.method,) if isinstance(self.method, str) else tuple(self.method)
        return () if names == ("off",) else names

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"speculative.ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")
        names = (self.method,) if isinstance(self.method, str) else tuple(self.method)
        if not names or "off" in names and len(names) > 1 or "auto" in names and len(names) > 1:
            raise ValueError(f'speculative.method {self.method!r}: "off", "auto", one source name or a non-empty list '
                             'of source names (e.g. ["prompt_lookup", "draft"])')
        if len(set(names)) != len(names):
            raise ValueError(f"speculative.method {self.method!r} names a source twice")
        if "draft" in names and not self.draft_path:
            raise ValueError('speculative.method "draft" needs draft_path: the draft model\'s MLX folder (same '
                             'tokenizer as the model), or use method = "prompt_lookup"')
        models = [n for n in names if n in ("draft", "eagle3", "dflash")]
        if len(models) > 1:
            raise ValueError(f"speculative.method {self.method!r}: {models} would share the one draft_path; name at "
                             "most one of draft, eagle3, dflash (beside prompt_lookup and suffix)")
        if models and models[0] != "draft" and not self.draft_path:
            raise ValueError(f'speculative.method "{models[0]}" needs draft_path: the folder of a drafter trained '
                             'for this model (docs/speculative.md, learned drafters), or use method = "prompt_lookup"')
        return self
