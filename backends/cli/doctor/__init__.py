"""`disagg doctor --config F --node NAME`: the report (report), its shared check parts (checks), the engine and
machine checks (engines), the GPU's kernels (gpu_arch) and what it reads of the machine (host). May import backends.decode's memory model and
backends.cli's checkpoints and procenv; nothing else above it."""
