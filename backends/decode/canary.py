"""The decode node's side of the KV fidelity canary (kv_bridge/fidelity.py has the contract).

POST /v1/fidelity/expect {model}: renders the canary prompt with the model's chat template, registers its transfer
(prompt minus its last token, as a request's, never refused for KV capacity) and answers {transfer_id, token_ids,
kv_target} for the caller to hand a prefill node's /v1/prefill. GET /v1/fidelity/{tid}: waits for that KV, then the
model's MLX thread prefills the same tokens itself in one forward (ahead of the next batch step: serving goes on),
compares the two caches layer by layer and, where both sides hold the same weights, decodes a few greedy tokens from
each; answers the verdict (heartbeating while it waits). A failure is logged once, naming layer, tensor and error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from aiohttp import web

from backends.common import NodeError, bad_request, json_body
from backends.decode import canary_allowance
from backends.decode.canary_plan import CanaryPlan
from kv_bridge.fidelity import HEARTBEAT_S, Verdict, allowance_class, calibrate_command, kl_tolerance
from kv_bridge.fingerprint import weight_precision
from kv_bridge.receiver import TransferError

log = logging.getLogger("backends.decode.canary")
CANARY_PREFIX = "canary-"
# Plain, varied prose (no repetition a model could shortcut), then a question whose answer is in it.
_SENTENCES = [
    "The river town of Alder Bend kept its records in a stone hall beside the mill.",
    "Every spring the clerks counted the boats, the sheep, the looms and the children born that winter.",
    "In the year of the long flood the count was taken twice, once before the water rose and once after.",
    "The second count found forty-one boats where the first had found thirty-seven.",
    "Nobody could explain the four extra boats until a fisherman admitted he had built them from a fallen barn.",
    "The clerks wrote his name, Tobin Marsh, in the margin of the ledger with a small drawing of a hammer.",
    "Years later a teacher used the ledger to show her pupils how a town remembers what it owns.",
    "She asked them to add the columns by hand and to check each total against the clerk's own sum.",
]
QUESTION = "Who built the four extra boats, and from what? Answer in one sentence."


def canary_ids(m, want: int, variant: int = 0, nonce: str = "") -> list[int]:
    """The canary prompt: prose grown to at least `want` tokens, chat-templated as a request is (MLX's tokenizer);
    `variant` starts it at another sentence (calibration's varied canaries), `nonce` opens it (a prompt no cache has
    seen)."""
    tok, text, i = m.tokenizer, f"Ledger {nonce}." if nonce else "", variant
    while True:
        text += (" " if text else "") + _SENTENCES[i % len(_SENTENCES)]
        i += 1
        ids = _render(tok, f"{text}\n\n{QUESTION}")
        if len(ids) >= want:
            return ids


def _render(tok, content: str) -> list[int]:
    messages = [{"role": "user", "content": content}]
    if getattr(tok, "chat_template", None):
        return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return list(tok.encode(content))


def canary_length(m, canary_tokens: int) -> int:
    """At least `canary_tokens`, and past the model's sliding window by 32 so the window's rotation is checked."""
    from kv_bridge.mlx.cache import layer_specs

    windows = [s.window for s in layer_specs(m.model) if s.window is not None]
    return max([canary_tokens] + [w + 32 for w in windows])


def run(m, ids: list[int], kv, greedy_tokens: int, prefix: int = 0, weights: str = "full",
        allowance: float | None = None, measure: bool = False, band: list[dict] | None = None):
    """MLX thread, one step at a time (MLXModel.run_task): the canary's comparison and greedy tokens -> dict.
    prefix > 0: the bridged cache is MLX's own prefill of the first `prefix` tokens (a held prefix) with the
    received KV appended, as a request that reuses a prefix is built. Each prefill is one forward (a few steps in
    all: a busy batch cannot stretch it). `weights`: the pair's allowance class; greedy tokens only where it is
    "full" (with different weights they measure the weights, not the KV). `allowance` (a pair's calibrated one) or
    `measure`: also what this canary's error magnitude needs (canary_allowance.measure). `band`: the pair's
    calibrated gain band (per layer {"k", "v"}: [lo per head, hi per head])."""
    from kv_bridge.mlx import fidelity
    from kv_bridge.mlx.cache import append_kv, build_prompt_cache, quantize

    t0, wire, head_kv, sent_from = time.perf_counter(), kv.wire_dtype, _draft_kv(m, kv, prefix), kv.layer_first
    try:
        if prefix:
            held = yield from fidelity.prefill(m.model, ids[:prefix], chunk=prefix)
            bridged = append_kv(held, kv.keys, kv.values, m.dtype)
        else:
            bridged = build_prompt_cache(m.model, kv.keys, kv.values, m.dtype)
    finally:
        kv.release()
    reference = yield from fidelity.prefill(m.model, ids[:-1], chunk=len(ids))
    out = {**fidelity.compare(bridged, reference, wire, weights, model=m.model, start=prefix, band=band,
                              sent_from=sent_from),
           "weights": weights, "greedy": None, "kl": None, "allowance": allowance, "gain_band": band is not None}
    if head_kv is not None:  # the head's layer, judged as one more layer; a wrong one costs drafts, not answers
        yield
        out["draft"] = _judge_head(m, ids, head_kv, wire, weights, len(bridged))
        if out["draft"]["findings"]:
            log.warning("canary of %s: the prefill node's EAGLE-3 head KV differs from this node's head: %s",
                        m.model_id, out["draft"]["findings"][0]["what"])
    if allowance is not None or measure:
        out.update(canary_allowance.measure(bridged, reference, wire, sent_from, prefix))
    if weights == "full":
        yield
        quantize(bridged, m.kv_bits, m.kv_group_size)
        quantize(reference, m.kv_bits, m.kv_group_size)
        steps = yield from fidelity.greedy(m.model, bridged, reference, ids[-1], greedy_tokens)
        out.update(greedy=f"{steps['agree']}/{steps['steps']}", kl=steps["kl"])
    return {**out, "seconds": time.perf_counter() - t0}


def _draft_kv(m, kv, prefix: int):
    """The drafter's KV the prefill node sent with the canary, as float32 (Ld, H, T, D) K and V, where this node runs
    the same kind of drafter to compare it with (an EAGLE-3 head or a DFlash drafter; from position 0 only); else
    None."""
    from kv_bridge.dtypes import to_float32

    head = getattr(m, "draft_model", None)
    if kv.draft_keys is None or prefix or not (hasattr(head, "fuse") or hasattr(head, "add_context")):
        return None
    return to_float32(kv.draft_keys, kv.dtype), to_float32(kv.draft_values, kv.dtype)


def _judge_head(m, ids: list[int], head_kv, wire: str, weights: str, layer: int) -> dict:
    """The drafter's figures and findings (its layers named from `layer`, the wire's index of its first): the
    prefill node's drafter KV against the drafter over this node's own prefill of the canary
    (eagle3_source.head_prompt_kv, dflash.dflash_prompt_kv), by the canary's own metric; the worst layer's figures.
    They do not fail the pair: drafts are verified, so a wrong drafter KV costs acceptance, not answers."""
    from kv_bridge.mlx.fidelity_metric import judge

    if hasattr(m.draft_model, "fuse"):
        from backends.decode.speculative.eagle3_source import head_prompt_kv

        k, v = (a[None] for a in head_prompt_kv(m.draft_model, m.model, ids))
        what = "EAGLE-3 head's KV"
    else:
        from backends.decode.speculative.dflash import dflash_prompt_kv

        k, v = dflash_prompt_kv(m.draft_model, m.model, ids)
        what = "DFlash drafter's KV"
    res = judge([{"k": a, "v": b} for a, b in zip(*head_kv)], [{"k": a, "v": b} for a, b in zip(k, v)], wire, weights)
    i, row = max(enumerate(res["layers"]), key=lambda r: max(r[1]["k"] / r[1]["k_tol"], r[1]["v"] / r[1]["v_tol"]))
    found = [{**f, "layer": layer + (f.get("layer") or 0), "what": f"{what}: {f['what']}"} for f in res["findings"]]
    return {"layer": layer + i, "k": row["k"], "v": row["v"], "k_tol": row["k_tol"], "v_tol": row["v_tol"],
            "findings": found[:4]}


def verdict(model: str, node: str, kv_dtype: str, wire: str, tokens: int, out: dict) -> Verdict:
    """The verdict of a comparison (kv_bridge/mlx/fidelity_metric.py): failed on any finding (a head in another
    slot, a scale, an error beyond the wire's own plus the pair's allowance, a first-layer position holding another
    token); with the same weights on both sides also when the next-token KL passes its tolerance. With different
    weights the error magnitude alone past its allowance, placement, position and gain holding, is "verified, over
    allowance" (a WARN that names `disagg fidelity calibrate`): the weights' honest difference, not a wrong KV."""
    worst, findings = out["worst"] or {}, out["findings"]
    weights, allowance = out.get("weights", "full"), out.get("allowance")
    if allowance is not None and "excess_at" in out:
        findings = canary_allowance.rejudge(findings, out["excess_at"], allowance)
        worst = findings[0] if findings else canary_allowance.nearest(out["excess_at"], allowance)
    kl_tol = kl_tolerance(wire, kv_dtype)
    kl_bad = weights == "full" and out.get("kl") is not None and out["kl"] > kl_tol
    over = weights != "full" and canary_allowance.magnitude_only(findings)
    msg = "; ".join(f["what"] for f in findings[:1])
    if kl_bad:
        msg = "; ".join(x for x in (msg, f"next-token KL {out['kl']:.3g} over {kl_tol:g}") if x)
    if over:
        msg += (f" while placement, position and gain hold ({weights}-bit class); measure this pair's own "
                f"allowance: {calibrate_command(model)}")
    state = "verified" if over or not (findings or kl_bad) else "failed"
    return Verdict(model, "", node, state, worst.get("value"), worst.get("layer"), worst.get("tensor"),
                   worst.get("tolerance"), wire, kv_dtype, tokens, out["greedy"], out["seconds"], msg, out["layers"],
                   out["kl"], head=worst.get("head"), metric=worst.get("metric"), weights=weights,
                   findings=findings[:8], over_allowance=over, allowance=allowance, excess=out.get("excess"),
                   gain_band=bool(out.get("gain_band")), draft=out.get("draft"))


def _band(band) -> list[dict] | None:
    """A calibrated `gain_band` as the calibration file holds it (kv_bridge.fidelity.gain_band), checked for its
    form; its shape against the model's KV is checked by the judge."""
    def heads(x) -> bool:
        return (isinstance(x, list) and len(x) == 2 and isinstance(x[0], list) and len(x[0]) == len(x[1])
                and all(isinstance(g, (int, float)) and not isinstance(g, bool) for g in x[0] + x[1]))
    if band is None:
        return None
    if not (isinstance(band, list) and band and all(isinstance(r, dict) and heads(r.get("k")) and heads(r.get("v"))
                                                    for r in band)):
        raise bad_request("gain_band must be a list per layer of {\"k\": [[lo per head], [hi per head]], \"v\": "
                          "[...]} (`disagg fidelity calibrate` writes it)")
    return band


def _options(body: dict, m) -> dict:
    """/v1/fidelity/expect's optional fields, checked: the pair's allowance class (from the prefill side's
    `prefill_weights` and this model's own), a calibrated `allowance` and `gain_band`, `calibrate` (measure the
    excess), `variant`."""
    pw = body.get("prefill_weights")
    if pw is not None and not (isinstance(pw, dict) and isinstance(pw.get("scheme"), str)):
        raise bad_request(f"prefill_weights must be {{\"scheme\": str, \"bits\": int | null}}, got {pw!r}")
    allowance = body.get("allowance")
    if allowance is not None and (isinstance(allowance, bool) or not isinstance(allowance, (int, float))
                                  or not 0 < allowance < 10):
        raise bad_request(f"allowance must be a number in (0, 10), got {allowance!r}")
    variant = body.get("variant", 0)
    if not isinstance(variant, int) or isinstance(variant, bool) or variant < 0:
        raise bad_request(f"variant must be a non-negative integer, got {variant!r}")
    return {"weights": allowance_class(pw, weight_precision(m.path)), "allowance": allowance,
            "measure": bool(body.get("calibrate", False)), "variant": variant, "band": _band(body.get("gain_band"))}


async def _heartbeat(resp: web.StreamResponse, work: asyncio.Future) -> dict:
    """`work`'s result, a space written every HEARTBEAT_S meanwhile (the caller's read stays alive while the node
    is busy; a silent node times it out)."""
    while True:
        done, _ = await asyncio.wait({work}, timeout=HEARTBEAT_S)
        if done:
            return work.result()
        await resp.write(b" ")


def register(app: web.Application, svc) -> None:
    """Canary routes on a decode node; `svc` is the DecodeService (models, receiver, settings, node)."""
    pending: dict[str, tuple] = {}  # transfer id -> (model, canary ids, prefix, options, long form)
    lengths: dict[str, int] = {}
    rounds = CanaryPlan()

    def _drop(tid: str) -> None:
        if pending.pop(tid, None) is not None:
            svc.receiver.forget(tid)

    async def expect(request: web.Request) -> web.Response:
        body = await json_body(request)
        m = svc.models.get(body.get("model"))
        if m is None:
            raise NodeError(404, f"model {body.get('model')!r} is not served here", "model_not_found")
        if m.failure is not None:
            raise NodeError(503, m.failure, "engine_dead")
        cfg, opts = svc.settings.fidelity, _options(body, m)
        want = lengths.setdefault(m.model_id, canary_length(m, cfg.canary_tokens))
        longest = next((r.max_model_len for r in svc.settings.models if r.id == m.model_id), None) or 1 << 30
        plan = rounds.next(m.model_id, str(body.get("prefill") or ""), want,  # canary_plan.py
                           min(cfg.start_canary_tokens, longest // 2), cfg.prefix_tokens, body.get("long") is True)
        ids = await asyncio.get_running_loop().run_in_executor(None, canary_ids, m, plan.tokens, opts.pop("variant"),
                                                               plan.nonce)
        prefix = body.get("prefix_tokens", plan.prefix)
        if not isinstance(prefix, int) or isinstance(prefix, bool) or prefix < 0:
            raise bad_request(f"prefix_tokens must be a non-negative integer, got {prefix!r}")
        prefix = min(prefix, len(ids) - 2)  # at least one token's KV arrives
        tid = CANARY_PREFIX + uuid.uuid4().hex
        # Held as a request's is, but never refused for capacity: a busy Mac's pair must still be checked.
        svc.receiver.expect(tid, len(ids) - 1, m.spec, prefix, m.kv_dtype, exempt=True)
        pending[tid] = (m, ids, prefix, opts, plan.long)
        # A caller that never asks for the result must not leave the reservation behind.
        asyncio.get_running_loop().call_later(cfg.timeout_s + 60, _drop, tid)
        return web.json_response({"transfer_id": tid, "token_ids": ids[:-1], "kv_target": svc.node.kv_target,
                                  "kv_start": prefix, "next_token": ids[-1]})

    async def compared(m, ids: list[int], prefix: int, opts: dict, long: bool, t, timeout: float) -> dict:
        """The verdict's JSON: the KV's arrival within `timeout`, then the comparison on the MLX thread, whose own
        run (from its first step, not its wait in the inbox) is bounded by `timeout` too."""
        def error(message: str) -> dict:
            return Verdict(m.model_id, "", svc.node.name, "error", message=message).to_json()
        try:
            kv = await t.result(timeout)
        except TransferError as e:
            return error(f"KV did not arrive: {e}")
        finally:
            svc.receiver.forget(t.transfer_id)
        greedy = svc.settings.fidelity.greedy_tokens
        task = m.submit_task(lambda: run(m, ids, kv, greedy, prefix, **opts))
        work = asyncio.wrap_future(task.future)
        try:
            while not work.done():
                await asyncio.wait({work}, timeout=1.0)
                if not work.done() and task.started is not None and time.monotonic() - task.started > timeout:
                    task.future.cancel()  # the MLX loop drops a cancelled task at its next step
                    return error(f"the comparison ran longer than {timeout:g}s on the MLX thread")
        except asyncio.CancelledError:  # the caller went: the MLX thread need not finish it
            task.future.cancel()
            raise
        try:
            out = work.result()
        except Exception as e:  # the comparison itself broke (logged by the MLX loop): the canary did not run
            return error(f"comparison failed: {type(e).__name__}: {e}")
        v = verdict(m.model_id, svc.node.name, m.kv_dtype, kv.wire_dtype, len(ids) - 1, out)
        v.prefix, v.long = prefix, long
        log.log(logging.WARNING if v.over_allowance else logging.INFO, "KV fidelity of %s: %s (wire %s, KV %s, "
                "weights %s)", m.model_id, v.summary(), kv.wire_dtype, v.kv_dtype, v.weights)
        return v.to_json()

    async def result(request: web.Request) -> web.StreamResponse:
        tid = request.match_info["tid"]
        entry, t = pending.pop(tid, None), svc.receiver.transfers.get(tid)
        if entry is None or t is None:
            raise NodeError(404, f"no canary transfer {tid!r}", "not_found")
        try:
            timeout = float(request.query.get("timeout", svc.settings.fidelity.timeout_s))
        except ValueError:
            svc.receiver.forget(tid)
            raise bad_request("timeout must be a number of seconds") from None
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        work = asyncio.ensure_future(compared(*entry, t, timeout))
        try:
            body = await _heartbeat(resp, work)
        finally:
            work.cancel()  # the caller went: nothing waits for the comparison any more
        await resp.write(json.dumps(body).encode())
        await resp.write_eof()
        return resp

    app.router.add_post("/v1/fidelity/expect", expect)
    app.router.add_get("/v1/fidelity/{tid}", result)
