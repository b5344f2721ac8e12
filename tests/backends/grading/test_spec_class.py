"""The grading class for speculation (backends/grading/spec_class.py): one rubric, varied notebooks sized with the
real tokenizer, an analysis in JSON and prose feedback per submission sharing everything but the task."""

from pathlib import Path

import pytest

from backends.grading import spec_class
from backends.grading.replay import RUBRIC

MODEL = Path(__file__).resolve().parents[3] / "models" / "smollm2-135m"


def test_a_class_of_twenty_two_calls_each_one_rubric_prompts_of_two_to_six_thousand_tokens():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    sized = spec_class.make_class(3, 0, count=lambda text: len(spec_class.chat_ids(tok, text)))
    assert all(2000 * 0.9 <= c.prompt_tokens <= 6000 * 1.1 for c in sized)  # the drawn size, with the real tokenizer
    calls = spec_class.make_class(20, 0)
    assert len(calls) == 40 and [c.role for c in calls[:2]] == ["analysis", "feedback"]
    assert all(c.prompt.startswith(RUBRIC) for c in calls)
    assert all(c.json_format == (c.role == "analysis") for c in calls)
    for a, f in zip(calls[::2], calls[1::2]):  # the two calls differ only in the task at the end
        assert a.submission == f.submission and a.prompt.endswith(spec_class.TASKS["analysis"])
        assert f.prompt.endswith(spec_class.FEEDBACK_PROSE) and "JSON" not in spec_class.FEEDBACK_PROSE.split("(")[0]
        assert a.prompt[:-len(spec_class.TASKS["analysis"])] == f.prompt[:-len(spec_class.FEEDBACK_PROSE)]
    notebooks = {c.prompt for c in calls[::2]}
    assert len(notebooks) == 20  # every student's own


def test_no_submissions_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        spec_class.make_class(0)


def test_cached_answers_are_read_without_generating(tmp_path):
    calls = spec_class.make_class(1, 0, (300, 400))
    assert spec_class.answers(calls, str(MODEL), 8, tmp_path, generate=False) == []
    key = spec_class.cache_key(calls, str(MODEL), 8)
    rows = [{"submission": 0, "role": "analysis", "prompt": [1, 2], "answer": [3]}]
    (tmp_path / f"class-answers-{key}.partial").write_text(__import__("json").dumps(rows))
    assert spec_class.answers(calls, str(MODEL), 8, tmp_path, generate=False) == rows
