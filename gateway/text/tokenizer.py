"""Chat templating and tokenization without transformers: `tokenizers` for tokenizer.json, jinja2 for the template.

The template is rendered the way Hugging Face's `apply_chat_template` renders it, so prompt ids match what the
nodes (and transformers) compute from the same model folder.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kv_bridge.config.source import ConfigError

from gateway.errors import InvalidRequest

# tokenizer_config.json keys that transformers passes to every template (its `special_tokens_map`).
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering ignores it."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; templates expect plain JSON (as in transformers).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_source(folder: Path, config: dict) -> str:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    tpl = config.get("chat_template")
    if isinstance(tpl, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    if not isinstance(tpl, str) or not tpl:
        raise ConfigError(
            f"model folder {folder} has no chat template: add chat_template.jinja "
            "or a \"chat_template\" entry in tokenizer_config.json"
        )
    return tpl


def message_text(content: Any) -> str:
    """OpenAI content: a string, null, or a list of {"type": "text", "text": ...} parts (joined like vLLM, by newline)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content)


_TEMPLATE_ARGS = {"messages", "tools", "documents", "add_generation_prompt"}  # the request's own, never overridden


class ChatTokenizer:
    """One model's tokenizer plus chat template; `encode_chat(messages)` gives the prompt ids nodes expect."""

    def __init__(self, tokenizer: Tokenizer, template_source: str, special_tokens: dict[str, str]) -> None:
        self._tok = tokenizer
        self.template_source = template_source
        self._template = compile_template(template_source)
        self.special_tokens = dict(special_tokens)
        self.model_type: str | None = None  # config.json's model_type, when the folder has one

    @functools.cached_property
    def renders_inline_system(self) -> bool:
        """Whether the chat template renders a system message after the first turn: probed once, as vLLM probes it,
        with a [system, user, system, user] conversation; a template that raises (Qwen's `loop.first` guard) or
        silently drops the second system message does not."""
        probe = [{"role": r, "content": f"<<{r}-{i}>>"} for i, r in enumerate(("system", "user", "system", "user"))]
        try:
            return "<<system-2>>" in self.render(probe)
        except InvalidRequest:
            return False

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tool definitions (a template that never names `tools` drops them)."""
        return "tools" in self.template_source

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ChatTokenizer":
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ConfigError(
                f"{tok_file} not found: point [[models]] path in config.toml at a Hugging Face model folder "
                "that contains tokenizer.json"
            )
        cfg_file = folder / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        special = {k: t for k in _SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
        tok = cls(Tokenizer.from_file(str(tok_file)), _template_source(folder, config), special)
        model_cfg = folder / "config.json"
        if model_cfg.is_file():  # the family picks the default reasoning parser
            tok.model_type = json.loads(model_cfg.read_text(encoding="utf-8")).get("model_type")
        return tok

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **kwargs: Any) -> str:
        """Apply the chat template; a template's raise_exception (e.g. roles must alternate) is a 400."""
        msgs = [{**m, "content": message_text(m.get("content"))} for m in messages]
        params = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=msgs, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **params
            )
        except jinja2.TemplateError as e:
            raise InvalidRequest(f"chat template rejected the messages: {e}", param="messages") from None

    def encode(self, text: str) -> list[int]:
        # The template already wrote every special token, so the tokenizer must not add its own.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt ids; `template_kwargs` (a request's chat_template_kwargs, e.g. enable_thinking) reach the
        template as variables."""
        kwargs = template_kwargs or {}
        reserved = sorted(set(kwargs) & _TEMPLATE_ARGS)
        if reserved:
            raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
        return self.encode(self.render(messages, tools=tools, **kwargs))

    def encode_prompt(self, text: str) -> list[int]:
        """A raw completion prompt: no template, so the tokenizer adds its own special tokens (e.g. BOS)."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
