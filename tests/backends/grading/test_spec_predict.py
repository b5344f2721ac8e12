"""The class prediction with speculation per lane (backends/grading/spec_predict.py): the analysis lane on
Qwen3-Coder and the feedback lane on gpt-oss each get their fitted verify cost and their call's acceptance, and the
prediction lists every assumption."""

from pathlib import Path

from backends.grading import spec_predict
from backends.grading.rates import PUBLISHED_RATES

ROOT = Path(__file__).resolve().parents[3]


def test_speedup_by_depth_is_a_gain_and_cheaper_verify_pays_more():
    qwen = dict(spec_predict.speedup_points("qwen3_moe", "analysis", PUBLISHED_RATES))
    oss = dict(spec_predict.speedup_points("gpt_oss", "analysis", PUBLISHED_RATES))
    assert all(v >= 1.0 for v in qwen.values()) and qwen[25000] > 1.0
    assert qwen[25000] > oss[25000]  # same acceptance, gpt-oss's verify costs about twice Qwen3-Coder's


def test_the_site_prediction_per_lane_with_its_assumptions():
    from backends.grading import command as grading_cli
    from kv_bridge.config.settings import load_config

    config = ROOT / "examples" / "site-seeds.toml"
    args = type("A", (), {"submissions": 60, "scale": 1.0, "seed": 0, "concurrency": None, "models": None,
                          "batch_cost": None})()
    p = grading_cli.predict(load_config(config), config.parent, args)
    lanes = p["lanes"]
    assert [row["role"] for row in lanes.values()] == ["analysis", "feedback"]
    for row in lanes.values():
        assert row["speculative"]["decode_s"] < row["split"]["decode_s"] and row["gain"] > 1.0
    slower = max(row["speculative"]["end_s"] for row in lanes.values())
    assert abs(slower - p["split+speculative"]["makespan_s"]) < 1.0  # the class ends with its slower lane
    text = "\n".join(p["assumptions"])
    assert "fitted to its published M3 Ultra decode rates" in text and "bench_class_drafts" in text
    assert len(p["assumptions"]) >= 6
