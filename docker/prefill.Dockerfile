# Prefill node for the DGX Sparks (GB10: aarch64 + CUDA): NVIDIA's vLLM image, this project on top.
# Build on the Spark (or with buildx --platform linux/arm64):  docker build -f docker/prefill.Dockerfile -t disagg-prefill .
# NVIDIA's container ships a vLLM built for its CUDA and torch; pip keeps it (the project's base dependencies only,
# not the `prefill` extra, which could pull a PyPI vLLM over it). See docs/deploy.md.
ARG BASE=nvcr.io/nvidia/vllm:25.10-py3
FROM ${BASE}

WORKDIR /opt/disagg
COPY pyproject.toml README.md ./
COPY kv_bridge ./kv_bridge
COPY backends ./backends
COPY gateway ./gateway
# The project itself (its base dependencies); vLLM stays the base image's.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir . \
 && python -c "import vllm, kv_bridge.vllm.connector; print('vllm', vllm.__version__)"

# The node listens on the HTTP port of its [[nodes]] entry; it sends KV out, so no KV port is opened here.
ENV DISAGG_CONFIG=/opt/disagg/config.toml
EXPOSE 8100
ENTRYPOINT ["disagg", "prefill"]
# Run (docs/deploy.md; `disagg config check` prints it per node): --network host (the KV sender reaches the Macs'
# 10GbE addresses), --ipc=host (PyTorch's shared memory), /opt/disagg read-only (config, secret, model folders), and a
# named volume for vLLM's and torch's compile caches so a restart does not recompile:
#   docker run -d --name disagg-prefill --restart unless-stopped --gpus all --network host --ipc=host \
#     -v /opt/disagg:/opt/disagg:ro -v disagg-cache:/root/.cache disagg-prefill --node spark-0
# `disagg` for models prepare / status on the Spark runs through the image too: --entrypoint disagg.
LABEL org.opencontainers.image.title="disagg-prefill"
CMD ["--help"]
