"""Learned drafters against prompt lookup on prose: tokens per target forward and decode tokens/s for off / prompt
lookup / the EAGLE-3 head trained here (`make draft-head`) / the controller choosing per step between prompt lookup
and the head / a DFlash drafter (untrained: mechanism only), greedy, on
smollm2:135m, one run, each method on the same prompts through the decode node's MLX loop (local prompts: the node
prefills them and the head builds its prompt state from that prefill's hidden states); and the head on the split's
path: the prompt's KV bridged, without and with the head's own prompt KV from the prefill side.

Run from the repository root:  .venv/bin/python -m bench.bench_learned [--max-tokens 64] [--head DIR] [--smoke]
Ratios are against `off` measured in the same run; mlx-cpu here, not a Mac (docs/speculative.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from backends.decode.engine import Job, MLXModel
from backends.decode.speculative.control import SpecController
from kv_bridge.config.speculative import SpeculativeConfig
from kv_bridge.protocol import Sampling
from tests.support.fakes import HeldKV

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "smollm2-135m"
HEAD = ROOT / "models" / "smollm2-135m-eagle3"
PROSE = ["Explain in a few sentences why the sky is blue.",
         "Write a short paragraph of feedback for a student whose essay on the water cycle was clear but too short.",
         "Describe what a compiler does, for someone who has never programmed.",
         "Summarise the benefits of regular exercise in one paragraph."]


def bridged_job(m: MLXModel, ids: list[int], head_kv: bool) -> dict:
    """The disaggregated path's Job fields: ids[:-1]'s KV as a prefill node's arrives (MLX's own here) and, with
    `head_kv`, the head's own KV of them as a prefill node running the head sends it (eagle3_source.head_prompt_kv,
    which test_eagle3_split_e2e finds equal to vLLM's within 1e-3); computed on the node's MLX thread."""
    def work():
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        from backends.decode.speculative.eagle3_source import head_prompt_kv
        from kv_bridge.mlx.cache import cache_kv

        yield
        cache = make_prompt_cache(m.model)
        m.model(mx.array([ids[:-1]]), cache=cache)
        kv = cache_kv(cache, len(ids) - 1)
        head = head_prompt_kv(m.draft_model, m.model, ids) if head_kv else None
        return kv, head
    kv, head = m.submit_task(work).future.result(1800)
    return {"tokens": ids[-1:], "history": ids[:-1], "make_cache": lambda: m.prompt_cache(None, HeldKV(*kv)),
            "draft_kv": None if head is None else (0, head[0][None], head[1][None])}


def run(m: MLXModel, ids: list[int], max_tokens: int, bridged: bool | None = None) -> tuple[list[int], float]:
    """(tokens, decode seconds from the first token to the last). `bridged`: from the prompt's KV as it arrives on
    the disaggregated path, with (True) or without (False) the head's prompt KV; None: a local prompt."""
    out, stamps, done = [], [], threading.Event()

    def emit(ev):
        if ev is None:
            done.set()
        elif ev[0] == "token":
            out.append(ev[1].token_id)
            stamps.append(time.perf_counter())
    fields = {"tokens": ids} if bridged is None else bridged_job(m, ids, bridged)
    job = Job(gen=Sampling.from_json({"temperature": 0.0, "max_tokens": max_tokens}), emit=emit, grammar=None,
              **fields)
    m.submit(job)
    done.wait(1800)
    return out, stamps[-1] - stamps[0]


def measure(m: MLXModel, method: str | list[str], draft: str | None, prompts: list[list[int]], n: int, k: int,
            bridged: bool | None = None) -> dict:
    """One row; a list of methods: the node's controller picks per step (adaptive k, as a node runs it)."""
    learned = {"eagle3", "dflash"} & set([method] if isinstance(method, str) else method)
    cfg = SpeculativeConfig(method=method, draft_path=draft if learned else None, num_draft=k,
                            adaptive=not isinstance(method, str))
    m.speculation = SpecController(cfg)
    toks = secs = 0
    outs = []
    for ids in prompts:
        out, s = run(m, ids, n, bridged)
        outs.append(out)
        toks, secs = toks + len(out) - 1, secs + s
    st = m.speculation.stats
    forwards = st.verify_steps + st.plain_steps
    per_forward = (toks + len(prompts)) / forwards if forwards else 1.0  # the first token comes with the prefill
    name = (method if isinstance(method, str) else "controller (" + "+".join(method) + ")")
    name += {None: "", False: ", bridged", True: ", bridged + head KV"}[bridged]
    return {"method": name, "tok_s": toks / secs, "per_forward": per_forward, "outs": outs,
            "accepted": st.accepted, "drafted": st.drafted}


def state_bytes(head_path: str, ids: list[int]) -> str:
    """What a prompt's drafter state takes per token as MLX holds it here (float32): the 3 layers' states the head
    reads, the head's own KV after its prefill over them, and the model's KV; the wire would carry bf16 or fp8."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from backends.decode.speculative.eagle3 import load_eagle3
    from backends.decode.speculative.hidden import HiddenTap, target_args

    model = load_model()
    t = target_args(model)
    head = load_eagle3(head_path, t)
    tap = HiddenTap(model, head.cfg.aux_layers(t))
    cache, hcache = make_prompt_cache(model), [KVCache()]
    _, aux = tap.forward(mx.array([ids]), cache)
    head(tap.embed(mx.array([ids[1:]])), head.fuse(aux[:, :-1]), hcache)
    mx.eval(aux, [c.keys for c in cache + hcache])
    n = len(ids)
    model_kv = sum(c.keys.nbytes + c.values.nbytes for c in cache) * n / cache[0].keys.shape[2] / n
    head_kv = (hcache[0].keys.nbytes + hcache[0].values.nbytes) / hcache[0].keys.shape[2]
    return (f"prompt state per token (float32): fused states {aux.nbytes / n:.0f} B, head KV {head_kv:.0f} B, "
            f"model KV {model_kv:.0f} B")


def node(method: str, draft: str) -> MLXModel:
    m = MLXModel("smollm2", str(MODEL), speculative=SpeculativeConfig(method=method, draft_path=draft))
    m.executor.submit(m.load).result()
    m.start()
    return m


def main() -> None:
    from backends.decode.speculative.dflash import untrained_dflash
    from backends.decode.speculative.eagle3 import untrained_eagle3
    from backends.decode.speculative.hidden import target_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-draft", type=int, default=3)
    p.add_argument("--head", default=str(HEAD), help="the EAGLE-3 head's folder (default: make draft-head's)")
    p.add_argument("--smoke", action="store_true", help="one prompt, 8 tokens (an untrained head if none is cached)")
    a = p.parse_args()
    prompts, n = (PROSE[:1], 8) if a.smoke else (PROSE, a.max_tokens)
    tmp = Path(tempfile.mkdtemp(prefix="bench-learned-"))
    target = target_args(load_model())
    trained = (Path(a.head) / "config.json").is_file()
    head = a.head if trained else untrained_eagle3(target, str(tmp / "eagle3"))
    eagle = node("eagle3", head)
    ids = [eagle.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
           for q in prompts]
    print(f"head: {head if trained else 'untrained (no cached head: make draft-head)'}; {len(prompts)} prose "
          f"prompts, {n} tokens each, greedy, k={a.num_draft}")
    methods = ["off", "prompt_lookup", "eagle3"] + ([] if a.smoke else [["prompt_lookup", "eagle3"]])  # smoke's time
    rows = [measure(eagle, meth, head, ids, n, a.num_draft) for meth in methods]
    # the split's case: the prompt's KV arrives; the head's prompt state with it (prefill_draft_path) or not
    rows += [measure(eagle, "eagle3", head, ids, n, a.num_draft, bridged) for bridged in (False, True)]
    eagle.stop()
    eagle.executor.shutdown(wait=True)  # its MLX thread ends first: a live one at exit is std::terminate (rc 134)
    df = node("dflash", untrained_dflash(target, str(tmp / "dflash"), block_size=a.num_draft + 1))
    rows.append(measure(df, "dflash", "untrained", ids, n, a.num_draft))
    df.stop()
    df.executor.shutdown(wait=True)
    print(state_bytes(head, ids[0]))
    base = rows[0]
    for r in rows:
        same = "same as off" if r["outs"] == base["outs"] else "DIFFERS from off"
        print(f"{r['method']:>36}: {r['per_forward']:.2f} tokens/target forward, {r['tok_s']:.2f} decode tok/s "
              f"({r['tok_s'] / base['tok_s']:.2f}x off), accepted {r['accepted']}/{r['drafted']} drafted, {same}")


def load_model():
    from mlx_lm import load

    return load(str(MODEL))[0]


if __name__ == "__main__":
    main()
    # Out without the interpreter's teardown: MLX's C++ threads can still be joinable then, and std::terminate
    # aborts a run whose results are already printed (rc -6 in a clean clone's smoke, after the executor's join)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
