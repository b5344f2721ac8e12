"""ChatTokenizer against transformers' apply_chat_template + encode, the independent reference."""

from __future__ import annotations

import json

import pytest

from tests.support.fakes import MODEL_DIR
from gateway.errors import InvalidRequest
from gateway.text.tokenizer import ChatTokenizer, compile_template

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, in French: ça va? 日本語 🙂"},
    ],
    [{"role": "user", "content": "  leading and trailing spaces \n\n and newlines  "}],
    [{"role": "user", "content": "<|im_start|> literal special token text <|im_end|>"}],
]

@pytest.fixture(scope="module")
def reference():
    import transformers
    return transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR))

@pytest.fixture(scope="module")
def chat_tok():
    return ChatTokenizer.from_folder(MODEL_DIR)

@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_matches_transformers(chat_tok, reference, messages):
    text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat_tok.render(messages) == text
    assert chat_tok.encode_chat(messages) == reference.encode(text, add_special_tokens=False)

def test_text_parts_are_joined(chat_tok, reference):
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    flat = [{"role": "user", "content": "first\nsecond"}]
    text = reference.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
    assert chat_tok.encode_chat(parts) == reference.encode(text, add_special_tokens=False)

def test_decode_round_trip(chat_tok, reference):
    ids = reference.encode("The capital of France is Paris.", add_special_tokens=False)
    assert chat_tok.decode(ids) == reference.decode(ids, skip_special_tokens=True)

def test_template_features():
    # HF-style templates rely on raise_exception, a non-escaping tojson, and trim/lstrip of block tags.
    tpl = compile_template(
        "{% for m in messages %}\n  {{ m | tojson }}\n{% endfor %}"
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
    )
    assert tpl.render(messages=[{"a": "<&>"}]) == '  {"a": "<&>"}\n'
    with pytest.raises(Exception, match="one message only"):
        tpl.render(messages=[{}, {}])

def test_template_exception_is_invalid_request(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((MODEL_DIR / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    tok = ChatTokenizer.from_folder(tmp_path)
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        tok.encode_chat([{"role": "user", "content": "x"}])

def test_template_from_tokenizer_config(tmp_path, chat_tok):
    (tmp_path / "tokenizer.json").write_bytes((MODEL_DIR / "tokenizer.json").read_bytes())
    source = (MODEL_DIR / "chat_template.jinja").read_text()
    cfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": source}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    msgs = CONVERSATIONS[1]
    assert ChatTokenizer.from_folder(tmp_path).encode_chat(msgs) == chat_tok.encode_chat(msgs)

def test_missing_files_fail_with_fix(tmp_path):
    from kv_bridge.config.source import ConfigError

    with pytest.raises(ConfigError, match="tokenizer.json"):
        ChatTokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((MODEL_DIR / "tokenizer.json").read_bytes())
    with pytest.raises(ConfigError, match="chat_template"):
        ChatTokenizer.from_folder(tmp_path)

def test_chat_template_kwargs_reach_the_template(tmp_path, reference):
    """Qwen3's template with enable_thinking false adds an empty think block; transformers renders the reference."""
    (tmp_path / "tokenizer.json").write_bytes((MODEL_DIR / "tokenizer.json").read_bytes())
    source = (MODEL_DIR.parent.parent / "tests" / "support" / "templates" / "qwen3.jinja").read_text()
    (tmp_path / "chat_template.jinja").write_text(source)
    tok = ChatTokenizer.from_folder(tmp_path)
    msgs = CONVERSATIONS[0]
    off = tok.encode_chat(msgs, template_kwargs={"enable_thinking": False})
    assert off != tok.encode_chat(msgs)
    text = reference.apply_chat_template(msgs, chat_template=source, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=False)
    assert tok.render(msgs, enable_thinking=False) == text
    assert off == reference.encode(text, add_special_tokens=False)
    with pytest.raises(InvalidRequest, match="may not set messages"):
        tok.encode_chat(msgs, template_kwargs={"messages": []})
