"""Structured output after reasoning (issue 22, item 5): the decode node's grammar starts only after the harmony
final-channel header or `</think>`, as vLLM's structured outputs and Ollama do, so the reasoning is free text; a
prompt that already ended the reasoning (or a `<think>` model that does not open a block) is constrained at once.
Real llguidance on the family tokenizers (tests/support/tiny_models.py); the prompts come from the chat templates."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from backends.decode.grammar import GrammarCompiler, GrammarSpec
from gateway.text.reasoning import gate_grammar
from kv_bridge.protocol import ProtocolError, Sampling, json_grammar
from tests.support.tiny_models import write_family_tokenizer

VOCAB = 49152
OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """{family: (hf tokenizer, GrammarCompiler)}: gpt_oss (harmony), qwen3_moe with the thinking Qwen3 template."""
    out = {}
    for name in ("gpt_oss", "qwen3_moe"):
        folder = write_family_tokenizer(tmp_path_factory.mktemp(name), name,
                                        "qwen3.jinja" if name == "qwen3_moe" else None)  # the thinking Qwen3
        tok = AutoTokenizer.from_pretrained(str(folder))
        eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
        out[name] = tok, GrammarCompiler(tok, VOCAB, eos)
    return out


class Steps:
    """Drive a processor as mlx-lm does: one call before the first token, then one per generated token, each
    with the tokens so far; `allowed` is the set of ids the last call let through."""

    def __init__(self, proc):
        self.proc, self.tokens = proc, [0]  # a prompt token: the first call sees only the prompt
        self.allowed = self._call()

    def _call(self) -> set[int]:
        import mlx.core as mx

        logits = self.proc(mx.array(self.tokens), mx.zeros((1, VOCAB)))
        return {i for i, ok in enumerate((logits[0] == 0).tolist()) if ok}

    def take(self, token: int) -> set[int]:
        assert token in self.allowed, token
        self.tokens.append(token)
        self.allowed = self._call()
        return self.allowed

    def feed(self, tok, text: str) -> list[set[int]]:
        """`text`'s tokens one by one; the allowed set after each."""
        return [self.take(t) for t in tok.encode(text, add_special_tokens=False)]

    def answer(self, eos: list[int], limit: int = 40) -> list[int]:
        """Let the grammar write: the lowest allowed id each step, until only EOS is left."""
        out = []
        while not self.allowed <= set(eos) and len(out) < limit:
            out.append(min(self.allowed - set(eos)))
            self.take(out[-1])
        return out


def grammar(tok, compiler, prompt: str, schema=OK_SCHEMA, parser="harmony"):
    wire = gate_grammar(json_grammar(schema), parser, prompt)
    return compiler.processor(GrammarSpec.from_wire(Sampling(grammar=wire).grammar))


def test_harmony_reasoning_is_free_and_the_final_message_is_json(family):
    tok, compiler = family["gpt_oss"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Grade this."}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|start|>assistant")
    steps = Steps(grammar(tok, compiler, prompt))
    assert len(steps.allowed) == VOCAB
    after = steps.feed(tok, "<|channel|>analysis<|message|>Hmm, the notebook is fine.<|end|><|start|>assistant"
                            "<|channel|>final<|message|>")
    assert all(len(s) == VOCAB for s in after[:-1])  # every step of the reasoning and the header: anything goes
    assert after[-1] and all(tok.decode([t]).startswith("{") for t in after[-1])  # after the final header: JSON
    answer = tok.decode(steps.answer(compiler.tokenizer.eos_tokens))
    assert isinstance(json.loads(answer)["ok"], bool) and list(json.loads(answer)) == ["ok"]


def test_a_prompt_that_opened_the_final_channel_is_constrained_at_once(family):
    tok, compiler = family["gpt_oss"]
    steps = Steps(grammar(tok, compiler, "<|start|>assistant<|channel|>final<|message|>"))
    assert steps.allowed and all(tok.decode([t]).startswith("{") for t in steps.allowed)


def test_think_model_that_thinks_then_answers(family):
    tok, compiler = family["qwen3_moe"]
    steps = Steps(grammar(tok, compiler, "<|im_start|>assistant\n", parser="think"))
    think = tok.convert_tokens_to_ids("<think>")
    # The first token decides: open a block, or answer in JSON right away.
    assert think in steps.allowed and all(t == think or tok.decode([t]).startswith("{") for t in steps.allowed)
    after = steps.feed(tok, "<think>I should say yes.</think>")
    assert all(len(s) == VOCAB for s in after[:-1])
    assert after[-1] and all(tok.decode([t]).startswith("{") for t in after[-1])


def test_think_model_without_a_block_is_constrained_from_its_first_token(family):
    tok, compiler = family["qwen3_moe"]
    steps = Steps(grammar(tok, compiler, "<|im_start|>assistant\n", parser="think"))
    first = next(t for t in steps.allowed if tok.decode([t]).startswith("{"))
    assert tok.convert_tokens_to_ids("<think>") not in steps.take(first)
    answer = tok.decode([first, *steps.answer(compiler.tokenizer.eos_tokens)])
    assert isinstance(json.loads(answer)["ok"], bool)
    # The template's no-thinking prompt closes the block itself: no gate at all.
    closed = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True, enable_thinking=False)
    assert closed.rstrip().endswith("</think>") and "after" not in gate_grammar(json_grammar(), "think", closed)
    opened = gate_grammar(json_grammar(), "think", "<|im_start|>assistant\n<think>\n")
    assert opened["after"] == ["</think>"] and "open" not in opened


def test_resumed_generation_goes_through_the_gate(family):
    """Mid-stream failover hands the new node the tokens generated so far: reasoning and a half answer."""
    tok, compiler = family["gpt_oss"]
    wire = gate_grammar(json_grammar(OK_SCHEMA), "harmony", "<|start|>assistant")
    done = tok.encode("<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>final<|message|>",
                      add_special_tokens=False)
    steps = Steps(compiler.processor(GrammarSpec.from_wire(wire), generated=done))
    assert steps.allowed and all(tok.decode([t]).startswith("{") for t in steps.allowed)
    with pytest.raises(Exception, match="do not fit"):
        compiler.processor(GrammarSpec.from_wire(wire), generated=[*done, *tok.encode("no", add_special_tokens=False)])


def test_the_gate_on_the_wire():
    g = gate_grammar(json_grammar(), "harmony", "<|start|>assistant")
    Sampling(grammar=g).check()
    assert GrammarSpec.from_wire(GrammarSpec.from_wire(g).to_wire()) == GrammarSpec.from_wire(g)
    for bad in [{**g, "after": "x"}, {**g, "after": [""]}, {"type": "json_object", "open": "<think>"}]:
        with pytest.raises(ProtocolError):
            Sampling(grammar=bad).check()
    lark = {"type": "lark", "grammar": "start: \"a\""}  # forced tool calls admit the reasoning themselves
    assert gate_grammar(lark, "harmony", "") == lark and gate_grammar(json_grammar(), None, "") == json_grammar()
