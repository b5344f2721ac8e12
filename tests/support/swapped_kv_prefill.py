"""A prefill node whose CPU KV layout adapter hands K for V and V for K (shapes unchanged): the fault an operator
would not see (checksums pass, /health says ok) and the fidelity canary must catch. Run as a script in place of
`python -m backends.cli.main` (Stack.launchers); the swap is made before the engine reads the registry."""

import sys

from kv_bridge.vllm import layouts
from kv_bridge.vllm.layouts.cpu import CpuAttnLayout


class SwappedKV(CpuAttnLayout):
    def split(self, blocks, off, n):
        k, v = super().split(blocks, off, n)
        return v, k

    def rows(self, kv_layer, b, h, o):
        k, v = super().rows(kv_layer, b, h, o)
        return v, k

    def gather(self, kv_layer, block_ids, start, end):
        k, v = super().gather(kv_layer, block_ids, start, end)
        return v, k


for key in list(layouts.CPU_ATTN_INTERIORS):
    layouts.CPU_ATTN_INTERIORS[key] = SwappedKV

if __name__ == "__main__":
    from backends.cli.main import main

    sys.exit(main(sys.argv[1:]))
