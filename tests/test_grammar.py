"""Constrained decoding (backends/grammar.py) on the real embedded model with mlx-lm directly: JSON mode always
parses, schema-constrained answers validate with jsonschema, constrained and free requests share one
BatchGenerator batch, and a schema the engine cannot compile is a GrammarError naming the problem."""

from __future__ import annotations

import json

import jsonschema
import pytest

from backends.grammar import GrammarCompiler, GrammarError, GrammarSpec

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
SUBJECTS = ["a student in Paris", "a teacher from Rome", "a baker in Lyon", "my grandmother", "a pilot",
            "a chess player", "a young painter", "a retired doctor", "a football coach", "a poet in Dublin",
            "a farmer", "a librarian in Oslo", "a sailor", "a nurse from Madrid", "a violinist", "an astronaut",
            "a gardener", "a chef in Tokyo", "a software engineer", "a tailor in Milan"]
FREE_PROMPTS = ["The capital of France is", "Write a haiku about rain.", "What is 2 + 2?", "Name three colours."]


@pytest.fixture(scope="module")
def mlx_model(mlx_ref):
    model, tok = mlx_ref
    return model, tok, GrammarCompiler(tok._tokenizer, model.args.vocab_size, list(tok.eos_token_ids))


def _prompt(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def _batch(model, tok, prompts: list[list[int]], processors: list[list], max_tokens: int) -> list[str]:
    """Greedy BatchGenerator run, as the decode node drives it; returns each request's text."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=[[t] for t in tok.eos_token_ids], completion_batch_size=len(prompts))
    uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts), logits_processors=processors)
    out = {uid: [] for uid in uids}
    while len(out) > sum(1 for v in out.values() if v and v[-1] is None):
        _, responses = gen.next()
        for r in responses:
            if r.finish_reason != "stop":
                out[r.uid].append(r.token)
            if r.finish_reason is not None:
                out[r.uid].append(None)
    gen.close()
    return [tok.decode([t for t in out[uid] if t is not None]) for uid in uids]


def test_json_mode_always_parses_with_stream_generate(mlx_model):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tok, compiler = mlx_model
    for text in ["Give me a JSON object describing a cat with name and age.",
                 "Return a JSON object with the keys city and country for Paris.",
                 "Answer in JSON: who wrote Hamlet?"]:
        proc = compiler.processor(GrammarSpec.from_ollama_format("json"))
        sampler = make_sampler(temp=0.0)
        out, finish = "", None
        for r in stream_generate(model, tok, _prompt(tok, text), max_tokens=160, sampler=sampler,
                                 logits_processors=[proc]):
            out, finish = out + r.text, r.finish_reason
        assert finish == "stop", out  # the grammar closed the object and only EOS was left
        assert isinstance(json.loads(out), dict)


@pytest.mark.timeout(1800)  # about 16 min on this machine under other engineers' load (20 rows on mlx-cpu)
def test_schema_answers_validate_for_20_prompts_in_one_batch(mlx_model):
    model, tok, compiler = mlx_model
    spec = GrammarSpec.from_response_format({"type": "json_schema",
                                             "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    prompts = [_prompt(tok, f"Describe {s} as a JSON object.") for s in SUBJECTS]
    outs = _batch(model, tok, prompts, [[compiler.processor(spec)] for _ in prompts], max_tokens=100)
    for out in outs:
        jsonschema.validate(json.loads(out), PERSON)


def test_constrained_and_free_requests_share_one_batch(mlx_model):
    """Free rows in a mixed batch get exactly what the same batch gives them with no grammar anywhere."""
    model, tok, compiler = mlx_model
    prompts = [_prompt(tok, p) for p in FREE_PROMPTS]
    free = _batch(model, tok, prompts, [[] for _ in prompts], max_tokens=24)
    mixed_procs = [[compiler.processor(GrammarSpec())] if i % 2 else [] for i in range(len(prompts))]
    mixed = _batch(model, tok, prompts, mixed_procs, max_tokens=24)
    for i, (a, b) in enumerate(zip(free, mixed)):
        if i % 2:
            assert b.startswith("{"), b  # constrained: JSON (max_tokens may cut it)
        else:
            assert a == b


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

    from backends.decode_engine import MLXModel
    from fakes import MODEL_DIR
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
