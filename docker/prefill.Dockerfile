# Prefill node for the DGX Sparks (GB10: aarch64 + CUDA 13, compute capability 12.1): vLLM's own image of the release
# the connector is tested with (0.32), this project on top. Nothing is assumed about the tag's platforms: the build
# checks (backends/cli/doctor/gpu_arch.py --build) that the machine is the target (TARGETARCH), the installed vLLM
# wheel is built for it, and torch carries sm_121-compatible kernels, and fails naming the fix when one disagrees.
# Build on the Spark (or with buildx --platform linux/arm64):  docker build -f docker/prefill.Dockerfile -t disagg-prefill .
# NVIDIA's nvcr.io/nvidia/vllm images ship older vLLM releases (25.10: 0.10.2), which the connector refuses.
# Without that image: a base with Python and CUDA, e.g. --build-arg BASE=nvcr.io/nvidia/pytorch:25.11-py3, and
# `--build-arg WITH_VLLM=1` installs the `prefill` extra (PyPI's vllm-0.32.0-cp38-abi3-manylinux_2_28_aarch64.whl and
# the torch 2.13.0 it pins). CUDA images carry no Python. See docs/deploy.md section 3 and docs/kv_bridge.md.
ARG BASE=vllm/vllm-openai:v0.32.0
FROM ${BASE}
ARG WITH_VLLM=0
# BuildKit sets TARGETARCH (arm64 on a Spark); CUDA_CAPABILITY is the GPU the image must carry kernels for (GB10).
ARG TARGETARCH
ARG CUDA_CAPABILITY=12.1

WORKDIR /opt/disagg-src
COPY pyproject.toml README.md ./
COPY kv_bridge ./kv_bridge
COPY backends ./backends
COPY gateway ./gateway
# `make test-gpu` inside the image (docs/kv_bridge.md): its Makefile, the CUDA tests, make, and pytest beside the
# base's torch and numpy. `docker run --rm --gpus all --entrypoint make disagg-prefill test-gpu`.
COPY Makefile ./
COPY tests/kv_bridge/vllm/layouts/test_kv_cuda.py ./tests/kv_bridge/vllm/layouts/
COPY tests/backends/cli/doctor/test_gpu_arch_nodevice.py ./tests/backends/cli/doctor/
# The base's vLLM stays (base dependencies only unless WITH_VLLM=1). The connector's own version check runs here,
# so an image with a vLLM outside the tested range fails to build rather than restart-loop at engine start.
# DL3013: this installs the project itself; its dependencies are pinned in pyproject.toml. DL3008: make from the
# base's Ubuntu, whichever version it carries.
# hadolint ignore=DL3013,DL3008
RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/* \
 && if [ "$WITH_VLLM" = 1 ]; then spec=".[prefill]"; else spec="."; fi \
 && python3 -m pip install --no-cache-dir "$spec" pytest \
 && python3 -m kv_bridge.vllm.checks \
 && python3 -m backends.cli.doctor.gpu_arch --build --target-arch "${TARGETARCH}" --capability "${CUDA_CAPABILITY}" \
 && python3 -c "import numpy, pytest" \
 && python3 -c "import torch, kv_bridge.vllm.connector; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"

# The node listens on the HTTP port of its [[nodes]] entry; it sends KV out, so no KV port is opened here.
ENV DISAGG_CONFIG=/opt/disagg/config.toml
EXPOSE 8100
ENTRYPOINT ["disagg", "prefill"]
# Run (docs/deploy.md; `disagg config check` prints it per node): --network host (the KV sender reaches the Macs'
# 10GbE addresses), --ipc=host (PyTorch's shared memory), /opt/disagg read-only (config, secret, model folders), and a
# named volume for vLLM's and torch's compile caches so a restart does not recompile:
#   docker run -d --name disagg-prefill --restart unless-stopped --gpus all --network host --ipc=host \
#     -v /opt/disagg:/opt/disagg:ro -v disagg-cache:/root/.cache disagg-prefill --node spark-1
# `disagg` for models prepare / status on the Spark runs through the image too: --entrypoint disagg.
LABEL org.opencontainers.image.title="disagg-prefill"
CMD ["--help"]
