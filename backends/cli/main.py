"""`disagg` command line: prepare models, check a config, run one role (prefill, decode, gateway), `up` for all of
them, `status` of a running site, `smoke` it end to end, or `doctor` for one machine before it serves.

Role modules are imported inside their command, so `disagg gateway` works on a box without torch or mlx.
"""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import os
import sys
from pathlib import Path

from backends import host_blas
from backends.cli import procenv
from kv_bridge.config.models import resolve_model_path
from kv_bridge.config.settings import Settings, load_config
from kv_bridge.config.source import ConfigError, DEFAULT_CONFIG

EXIT_CONFIG = 2  # same code argparse uses for bad usage: the fix is in the invocation or the file


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # DISAGG_LOG_FILE (the Mac's launchd agent): reopened when newsyslog renames it, so rotation needs no restart
    log_file = os.environ.get("DISAGG_LOG_FILE")
    logging.basicConfig(level=os.environ.get("DISAGG_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=[logging.handlers.WatchedFileHandler(log_file)] if log_file else None)
    try:
        procenv.ensure()  # a container's user: no passwd entry, no HOME, maybe no writable /tmp
    except OSError as e:  # only what writes temporary files needs one; models prepare retries beside its folder
        print(f"disagg: warning: {e}", file=sys.stderr)
    if args.func in (_cmd_decode, _cmd_models_prepare, _cmd_doctor):  # the commands that run MLX
        logging.getLogger("backends.cli").info("MLX's matmuls: %s", host_blas.prefer_openblas())
    try:
        settings = load_config(args.config)
        return args.func(settings, args) or 0
    except ConfigError as e:
        print(f"disagg: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, default=Path(os.environ.get("DISAGG_CONFIG", DEFAULT_CONFIG)),
                        help="config file (default: $DISAGG_CONFIG or ./config.toml)")
    p = argparse.ArgumentParser(prog="disagg", description="Disaggregated LLM inference: vLLM prefill, MLX decode.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    models = sub.add_parser("models", help="manage model folders").add_subparsers(dest="action", required=True)
    prep = models.add_parser("prepare", parents=[common], help="build the embedded models named in the config")
    prep.add_argument("--model", help="only this model id (default: every [[models]] route)")
    prep.add_argument("--role", choices=("prefill", "decode", "gateway", "draft"), help="a real checkpoint for this "
                      "side (with --model); gateway: only its tokenizer, chat template and config.json, copied from "
                      "--hf; draft: the speculative draft model at speculative.draft_path, its tokenizer files "
                      "checked against the decode side's (eagle3 / dflash: the learned drafter, its config checked "
                      "against the decode side's config.json)")
    prep.add_argument("--hf", metavar="SRC", help="HF checkpoint: a local folder or a hub id (prefill side; the "
                      "source --bits converts)")
    prep.add_argument("--mlx", metavar="SRC", help="decode side: an MLX folder or hub id, used as it is")
    prep.add_argument("--bits", type=int, choices=(4, 8), help="decode side: convert --hf with mlx-lm to this")
    prep.add_argument("--against", metavar="FOLDER_OR_FINGERPRINT", help="verify against the other side: its "
                      "folder, the gateway's copy (config.json + tokenizer, no weights), or its fingerprint string")
    prep.set_defaults(func=_cmd_models_prepare)

    cfg = sub.add_parser("config", help="check a config file").add_subparsers(dest="action", required=True)
    chk = cfg.add_parser("check", help="validate FILE and print what each machine will run")
    chk.add_argument("config", type=Path, metavar="FILE", help="the config file (e.g. examples/site.toml)")
    chk.add_argument("--json", action="store_true", help="machine-readable output")
    chk.add_argument("--docker", type=Path, metavar="DIR", help="check DIR/compose.yaml and DIR/prometheus/"
                     "prometheus.yml against FILE (default: ./docker when run from the repository root)")
    chk.set_defaults(func=_cmd_config_check)

    st = sub.add_parser("status", parents=[common], help="one table for the whole site: every node's health, "
                        "fingerprint, load and the KV link bandwidth of each prefill->decode pair")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--probe-mib", type=float, default=64.0, help="test transfer size per pair (0: no probe)")
    st.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each node")
    st.add_argument("--no-fidelity", action="store_true", help="leave out the KV fidelity table")
    st.add_argument("--recheck", action="store_true", help="run every pair's KV fidelity canary now (the gateway's "
                    "operator-only POST /fidelity, at most every [fidelity] recheck_min_s) instead of reading its "
                    "verdicts; needs an operator credential: the config's node secret, --operator-key or "
                    "$DISAGG_OPERATOR_KEY")
    st.add_argument("--operator-key", help="an operator key ([auth] operator_keys) for --recheck")
    st.add_argument("--api-key", help="a client key for the gateway (default: $DISAGG_API_KEY, else the config's "
                    "auth.api_keys / api_keys_file where this machine can read it)")
    st.set_defaults(func=_cmd_status)

    sm = sub.add_parser("smoke", parents=[common], help="from any machine: one long prompt per model through the "
                        "running gateway; the path it took, TTFT, KV bytes, the pair's KV fidelity, decode tokens/s; "
                        "exit 1 naming the cause and remedy when a model did not take the disaggregated path")
    sm.add_argument("--model", action="append", metavar="M", help="this model id or alias (repeat for more; "
                    "default: every [[models]] route)")
    sm.add_argument("--json", action="store_true", help="machine-readable output")
    sm.add_argument("--url", help="the gateway's URL (default: the config's [gateway], as `disagg status` reaches it)")
    sm.add_argument("--key", "--api-key", dest="key", help="a client key for the gateway (default: $DISAGG_API_KEY, "
                    "else the config's auth.api_keys / api_keys_file where this machine can read it)")
    sm.add_argument("--tokens", type=int, help="prompt tokens (default: twice the model's min_disagg_tokens, "
                    "at least 512)")
    sm.add_argument("--max-tokens", type=int, default=32, help="tokens to decode (for the decode rate)")
    sm.add_argument("--timeout", type=float, default=600.0, help="seconds for each model's request")
    sm.set_defaults(func=_cmd_smoke)

    doc = sub.add_parser("doctor", parents=[common], help="check this machine before it serves one role: one "
                         "line per check with the fix; exit 1 on any failure")
    doc.add_argument("--node", required=True, help="the [[nodes]] name this machine runs, or `gateway` for the "
                     "gateway box")
    doc.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for each /health")
    doc.set_defaults(func=_cmd_doctor)

    for role, func in (("prefill", _cmd_prefill), ("decode", _cmd_decode)):
        r = sub.add_parser(role, parents=[common], help=f"run one {role} node")
        r.add_argument("--node", required=True, help=f"name of a [[nodes]] entry with role = {role!r}")
        r.set_defaults(func=func)

    bench = sub.add_parser("bench", help="benchmarks against a running site").add_subparsers(dest="action",
                                                                                           required=True)
    from backends.grading.command import add_parser as add_grading
    from backends.grading.spec import add_parser as add_spec

    add_grading(bench, common)
    add_spec(bench, common)
    from backends.cli.fidelity import add_parser as add_fidelity

    add_fidelity(sub, common)

    gw = sub.add_parser("gateway", parents=[common], help="run the OpenAI-compatible gateway")
    gw.set_defaults(func=_cmd_gateway)
    sub.add_parser("up", parents=[common], help="start every role of the config on this machine; "
                   "Ctrl-C stops them").set_defaults(func=_cmd_up)
    return p


def _role_node(settings: Settings, name: str, role: str):
    node = settings.node(name)
    if node.role != role:
        raise ConfigError(f"node {name!r} has role {node.role!r}; run `disagg {node.role} --node {name}` "
                          f"or pick a {role} node: {[n.name for n in settings.nodes if n.role == role]}")
    return node


def _cmd_prefill(settings: Settings, args: argparse.Namespace) -> int | None:
    from backends.prefill.node import serve

    return serve(settings, _role_node(settings, args.node, "prefill"))


def _cmd_decode(settings: Settings, args: argparse.Namespace) -> int | None:
    from backends.decode.mac_memory import check_decode_start

    node = _role_node(settings, args.node, "decode")
    check_decode_start(settings, node, args.config)  # on a Mac: the models and their KV fit Metal's wired limit
    from backends.decode.node import serve

    return serve(settings, node)


def _cmd_gateway(settings: Settings, args: argparse.Namespace) -> int | None:
    from gateway.app import serve

    return serve(settings)


def _cmd_up(settings: Settings, args: argparse.Namespace) -> int:
    from backends.cli.up import up

    return up(settings, args.config)


def _cmd_config_check(settings: Settings, args: argparse.Namespace) -> int:
    from backends.cli import config_check

    return config_check.main(settings, args.config, args.json, docker=args.docker)


def _cmd_status(settings: Settings, args: argparse.Namespace) -> int:
    from backends.cli import status

    return status.main(settings, as_json=args.json, probe_bytes=int(args.probe_mib * 2**20), timeout=args.timeout,
                       fidelity=not args.no_fidelity, api_key=args.api_key, recheck=args.recheck,
                       operator=args.operator_key)


def _cmd_smoke(settings: Settings, args: argparse.Namespace) -> int:
    from backends.cli import smoke

    return smoke.main(settings, str(args.config), args.model, as_json=args.json, url=args.url, key=args.key,
                      tokens=args.tokens, max_tokens=args.max_tokens, timeout=args.timeout)


def _cmd_doctor(settings: Settings, args: argparse.Namespace) -> int:
    from backends.cli.doctor import report as doctor

    return doctor.main(settings, args.config, args.node, args.timeout)


def _cmd_models_prepare(settings: Settings, args: argparse.Namespace) -> int:
    from backends.cli import models

    routes = settings.models
    if args.model is not None:
        routes = [r for r in routes if r.id == args.model]
        if not routes:
            raise ConfigError(f"--model {args.model!r} is not in [[models]] of {args.config}; "
                              f"known: {[r.id for r in settings.models]}")
    try:
        procenv.ensure(tuple(resolve_model_path(r).parent for r in routes if resolve_model_path(r).parent.is_dir()))
        if args.role is not None:
            return _prepare_checkpoint(routes, args)
        return _prepare_embedded(routes, models)
    except OSError as e:  # e.g. /srv on macOS: a read-only system volume
        print(f"disagg: cannot write the model folder: {e}; put [[models]] path on a writable volume the user "
              f"owns (the seed site uses /opt/disagg/models on every machine)", file=sys.stderr)
        return 1


def _prepare_embedded(routes, models) -> int:
    failed = 0
    for route in routes:
        dest = resolve_model_path(route)
        if route.id in models.EMBEDDED:
            models.prepare(dest, route.id)
        elif (dest / "config.json").is_file():
            print(f"{route.id}: not embedded; using the folder at {dest}")
        else:
            print(f"{route.id}: not embedded and {dest} has no config.json; copy the model's HF folder "
                  f"(config.json, weights, tokenizer) there, or fix [[models]] path", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def _prepare_checkpoint(routes, args: argparse.Namespace) -> int:
    from backends.cli import checkpoints

    if args.model is None:
        raise ConfigError("--role prepares one model's checkpoint: add --model ID")
    route = routes[0]
    if args.role == "gateway":
        if args.hf is None:
            raise ConfigError("--role gateway copies the tokenizer files from --hf FOLDER_OR_HUB_ID")
        try:
            dest = checkpoints.prepare_gateway(route.id, resolve_model_path(route), args.hf)
        except checkpoints.CheckpointError as e:
            print(f"disagg: {e}", file=sys.stderr)
            return 1
        print(f"{route.id}: gateway files ready in {dest}: {', '.join(sorted(p.name for p in dest.iterdir()))}")
        return 0
    if args.role == "draft":
        return _prepare_draft(route, args)
    try:
        sides = checkpoints.prepare(route.id, resolve_model_path(route), args.role, hf=args.hf, mlx=args.mlx,
                                    bits=args.bits, against=args.against)
    except checkpoints.CheckpointError as e:
        print(f"disagg: {e}", file=sys.stderr)
        return 1
    agree = "fingerprints agree" if len(sides) == 2 else "no other side given (--against) to compare with"
    print(f"{route.id}: {args.role} side ready; {agree}\n" + "\n".join(s.line() for s in sides))
    return 0


def _prepare_draft(route, args: argparse.Namespace) -> int:
    from backends.cli import checkpoints
    from kv_bridge.config.speculative import SITE_DRAFTS

    if not route.speculative.draft_path:
        raise ConfigError(f"--role draft: set [models.speculative] draft_path for {route.id} (where its draft goes)")
    if {"eagle3", "dflash"} & set(route.speculative.sources):
        return _prepare_learned(route, args)
    suggested = next((SITE_DRAFTS[n] for n in (*route.aliases, route.id) if n in SITE_DRAFTS), None)
    mlx = args.mlx or (None if args.hf else suggested)
    dest = Path(route.speculative.draft_path).expanduser()
    try:
        s = checkpoints.prepare_draft(route.id, dest, resolve_model_path(route), hf=args.hf, mlx=mlx, bits=args.bits)
    except checkpoints.CheckpointError as e:
        print(f"disagg: {e}", file=sys.stderr)
        return 1
    print(f"{route.id}: draft ready, same tokenizer files as the decode side\n{s.line()}")
    return 0


def _prepare_learned(route, args: argparse.Namespace) -> int:
    """An EAGLE-3 head or a DFlash drafter at speculative.draft_path (--mlx, else the one published for the model),
    checked against the decode side's config.json (hidden size, vocabulary, layers, RoPE)."""
    from backends.cli import checkpoints
    from backends.decode.speculative.learned import SITE_HEADS
    from backends.decode.speculative.learned_load import check_folder

    method = next(n for n in route.speculative.sources if n in ("eagle3", "dflash"))
    source = args.mlx or next((SITE_HEADS[method][n] for n in (*route.aliases, route.id) if n in SITE_HEADS[method]),
                              None)
    if source is None:
        raise ConfigError(f"--role draft: no published {method} drafter known for {route.id}: pass --mlx "
                          "FOLDER_OR_HUB_ID (docs/speculative.md, learned drafters)")
    dest = Path(route.speculative.draft_path).expanduser()
    try:
        folder = checkpoints.fetch(source, dest)
        summary = check_folder(method, folder, resolve_model_path(route))
    except (checkpoints.CheckpointError, ValueError) as e:
        print(f"disagg: {e}", file=sys.stderr)
        return 1
    print(f"{route.id}: {method} drafter ready at {folder} ({source}): {summary}")
    if route.prefill_draft_path and method in ("eagle3", "dflash"):  # the prefill nodes run the same drafter
        return _prepare_prefill_head(route, source, method)
    return 0


def _prepare_prefill_head(route, source: str, method: str = "eagle3") -> int:
    """The drafter at [[models]] prefill_draft_path, checked as a prefill node starts it (backends/prefill/
    draft_head.py: its KV shape the model's, a dtype vLLM can read)."""
    from backends.cli import checkpoints
    from backends.prefill.draft_head import check_head

    try:
        folder = checkpoints.fetch(source, resolve_model_path(route, role="prefill_draft"))
        check_head(folder, resolve_model_path(route, role="prefill"))
    except (checkpoints.CheckpointError, ValueError) as e:
        print(f"disagg: {e}", file=sys.stderr)
        return 1
    print(f"{route.id}: the prefill nodes' {method} drafter ready at {folder}: its prompt KV rides the KV stream")
    return 0


if __name__ == "__main__":
    sys.exit(main())
