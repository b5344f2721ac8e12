"""A model family in one place (kv_bridge/families): each family's default reasoning and tool-call parsers, named in
the gateway's registries; configured parser names checked against those registries at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest

from kv_bridge.config.source import ConfigError
from kv_bridge.families import FAMILIES, OUTPUT_ONLY, family_for, output_family

from gateway.app import create_app
from gateway.text.output import check_parsers, tool_parser_name
from gateway.text.reasoning import REASONING_PARSERS, parser_name
from gateway.text.toolcalls import PARSERS

from tests.support.fakes import FakeDecodeNode, make_settings


def test_every_family_default_is_a_registered_parser():
    for model_type, fam in {**FAMILIES, **OUTPUT_ONLY}.items():
        assert fam.model_type == model_type
        assert fam.reasoning_parser in (None, *REASONING_PARSERS), model_type
        assert fam.tool_parser in (None, *PARSERS), model_type


def test_family_defaults_and_config_overrides():
    """The defaults the gateway always had (gpt_oss harmony both ways, qwen3_moe qwen3_coder calls and no reasoning,
    dense qwen3 think + hermes, qwen2 hermes, anything else plain); a configured name wins, "none" switches off."""
    defaults = {t: (parser_name(None, t), tool_parser_name(None, t))
                for t in ("gpt_oss", "qwen3_moe", "qwen3", "qwen2", "llama", "mamba", None)}
    assert defaults == {"gpt_oss": ("harmony", "harmony"), "qwen3_moe": (None, "qwen3_coder"),
                        "qwen3": ("think", "hermes"), "qwen2": (None, "hermes"), "llama": (None, None),
                        "mamba": (None, None), None: (None, None)}
    assert parser_name("think", "qwen3_moe") == "think"
    assert parser_name("none", "gpt_oss") is None and tool_parser_name("none", "gpt_oss") is None


def test_output_only_families_carry_no_kv():
    """qwen3 and qwen2 name parsers only: the KV bridge still refuses them, listing the families it carries."""
    assert output_family("qwen3") is OUTPUT_ONLY["qwen3"]
    for model_type in OUTPUT_ONLY:
        with pytest.raises(ValueError, match=r"supported: \['gpt_oss', 'llama', 'qwen3_moe'\]"):
            family_for(model_type)


@pytest.mark.parametrize("field,name,choices", [("reasoning_parser", "deepseek", "harmony, think"),
                                                ("tool_parser", "mistral", "harmony, hermes, qwen3_coder")])
def test_unknown_parser_name_fails_at_start_up(field, name, choices, tmp_path: Path):
    """Checked against the registries themselves: the gateway refuses to build, and `disagg config check` says why."""
    from backends.cli.config_check import check

    settings = _settings({field: name})
    msg = f"model 'smollm2:135m': {field} '{name}' is not a known parser; set it to one of {choices} or \"none\""
    with pytest.raises(ConfigError, match=msg):
        create_app(settings)
    assert [e for e in check(settings, tmp_path / "config.toml").errors if e.startswith(msg)]
    check_parsers(_settings({field: "none"}).models)


def _settings(route: dict):
    return make_settings([FakeDecodeNode("decode-0")], [], route=route,
                         nodes_extra={"decode-0": {"port": 8200, "kv_port": 8201}})
