"""The metric names docker/'s Grafana dashboard and Prometheus alert rules query, by the process that exports each,
and the names a /metrics text exports (test_deploy_files, test_node_metrics_e2e)."""

from __future__ import annotations

import json
import re

import yaml

from tests.support import ROOT

DOCKER = ROOT / "docker"

# Which process exports a queried name: the prefill node (vLLM's registry), the decode node, else the gateway.
NODE_FAMILIES = {"prefill": "vllm:", "decode": "disagg_decode_"}


def source(name: str) -> str:
    return next((role for role, prefix in NODE_FAMILIES.items() if name.startswith(prefix)), "gateway")


def queried_metrics(role: str | None = None) -> dict[str, set[str]]:
    """Every disagg_* / vllm:* name a dashboard panel or an alert rule queries (only `role`'s, when given), with
    where it is used."""
    where: dict[str, set[str]] = {}
    dash = json.loads((DOCKER / "grafana/dashboards/disagg.json").read_text())
    exprs = [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]
    rules = yaml.safe_load((DOCKER / "prometheus/alerts.yml").read_text())["groups"][0]["rules"]
    exprs += [(r["alert"], r["expr"]) for r in rules]
    for title, expr in exprs:
        names = re.findall(r"\b(?:disagg_[a-z0-9_]+|vllm:[a-z0-9_:]+)", expr)
        assert names, f"{title}: queries no disagg or vllm metric: {expr}"
        for n in names:
            if role is None or source(n) == role:
                where.setdefault(n, set()).add(title)
    return where


def exported(text: str) -> set[str]:
    """Sample names /metrics exports: every family from its TYPE line (also one without samples yet)."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
                "gauge": ("",), "summary": ("", "_count", "_sum", "_created")}
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        base = name.removesuffix("_total") if kind == "counter" else name  # counters are typed as name_total
        names |= {base + s for s in suffixes.get(kind, ("",))}
    return names | set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M))
