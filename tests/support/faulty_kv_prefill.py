"""A prefill node whose CPU KV layout adapter hands out a wrong KV, the fault named by DISAGG_TEST_KV_FAULT (or, read
at every gather so one engine serves every fault, the file DISAGG_TEST_KV_FAULT_FILE names): kv_swap
(K for V), heads (KV heads 0 and 1 exchanged), v_scale (V 20% too large), k_scale (K 25% too large: an fp8 scale
off by 25%), positions (each block's positions read one slot early); and two that only prompts longer than the canary
reach (issue #50): block_swap (the block table's entries for two blocks past position LATE exchanged, as each prefill
step reads it: the later block carries the earlier one's KV), shift (from position LATE on, the slot mapping one slot
early). Shapes unchanged, checksums pass. Run as a script in place of `python -m backends.cli.main`
(Stack.launchers), through the public layout registry."""

import os
import sys

from kv_bridge.vllm import layouts
from kv_bridge.vllm.layouts.cpu import CpuAttnLayout

FAULTS = ("kv_swap", "heads", "v_scale", "k_scale", "positions", "block_swap", "shift")
LATE = 256  # past the 255-token canary (and the tests' 136): a fault there is one only real prompts meet
FAULT_FILE = os.environ.get("DISAGG_TEST_KV_FAULT_FILE")


def fault() -> str:
    """The fault now: the file's content where one is named, else the environment's; empty: the right adapter."""
    if FAULT_FILE:
        with open(FAULT_FILE) as f:
            name = f.read().strip()
    else:
        name = os.environ.get("DISAGG_TEST_KV_FAULT", "")
    if name and name not in FAULTS:
        raise SystemExit(f"DISAGG_TEST_KV_FAULT must be one of {FAULTS}, got {name!r}")
    return name


def _values(k, v, name):
    if name == "kv_swap":
        return v, k
    if name == "v_scale":
        return k, v * 1.2
    if name == "k_scale":
        return k * 1.25, v
    return k, v


class FaultyKV(CpuAttnLayout):
    def rows(self, kv_layer, b, h, o):  # index arrays (torch or numpy) of the entries gathered -> (N, D) each
        name = fault()
        if name == "heads":
            h = h * 1
            h[h == 0], h[h == 1] = -1, 0
            h[h == -1] = 1
        if name == "positions":
            o = o - (o > 0) * 1
        return _values(*super().rows(kv_layer, b, h, o), name)

    def block_span(self, block_ids, start, end):  # every path (gather, rows) maps positions to slots through here
        name = fault()
        if name == "block_swap":
            a, b = LATE // self.block_size + 1, LATE // self.block_size + 3
            if len(block_ids) > b:
                block_ids = list(block_ids)
                block_ids[a], block_ids[b] = block_ids[b], block_ids[a]
        if name == "shift" and start >= LATE:
            blocks, off = super().block_span(block_ids, start - 1, end - 1)
            return blocks, off
        return super().block_span(block_ids, start, end)

    def gather(self, kv_layer, block_ids, start, end):  # (H, n, D) each
        k, v = super().gather(kv_layer, block_ids, start, end)
        name = fault()
        if name == "heads":
            k, v = (x[[1, 0, *range(2, x.shape[0])]] for x in (k, v))
        if name == "positions":
            k, v = (x[:, [0, *range(x.shape[1] - 1)]] for x in (k, v))
        return _values(k, v, name)


fault()  # a wrong name fails the start, not the first transfer
for key in list(layouts.CPU_ATTN_INTERIORS):
    layouts.CPU_ATTN_INTERIORS[key] = FaultyKV

if __name__ == "__main__":
    from backends.cli.main import main

    sys.exit(main(sys.argv[1:]))
