"""bench_class_spec's [models.speculative] block, as the decode node's settings read it: `--fixed-k` turns the node's
controller off (every step drafts num_draft), the default leaves it on; a list method and a head's folder carry over."""

from __future__ import annotations

import tomllib

from bench.bench_class_spec import _spec_toml
from kv_bridge.config.speculative import SpeculativeConfig


def _read(block: str) -> SpeculativeConfig:
    return SpeculativeConfig(**tomllib.loads(block)["models"]["speculative"])


def test_fixed_k_turns_the_controller_off_and_the_default_leaves_it_on():
    fixed = _read(_spec_toml("prompt_lookup+suffix+eagle3", 3, "/heads/h", adaptive=False))
    assert (fixed.adaptive, fixed.num_draft, fixed.draft_path) == (False, 3, "/heads/h")
    assert fixed.method == ["prompt_lookup", "suffix", "eagle3"]
    default = _read(_spec_toml("prompt_lookup", 3))
    assert (default.adaptive, default.method, default.draft_path) == (True, "prompt_lookup", None)
    assert _spec_toml("off", 3) == ""
