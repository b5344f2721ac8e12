"""The node roles and the operator's tools, one package per job: decode/ (the MLX decode node), prefill/ (the vLLM
prefill node), cli/ (the `disagg` command line and its operator commands), site/ (a whole site on one machine) and
grading/ (the grading bench). At this root: what both node services share (common, probe, node_metrics).

Imports run one way: cli -> site, grading, decode, prefill -> this root -> kv_bridge; never gateway (it is a
process the cli starts, spoken to over HTTP)."""
