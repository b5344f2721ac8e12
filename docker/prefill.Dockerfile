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
RUN pip install --no-cache-dir . \
 && python -c "import vllm, kv_bridge.vllm.connector; print('vllm', vllm.__version__)"

# The node listens on the HTTP port of its [[nodes]] entry; it sends KV out, so no KV port is opened here.
ENV DISAGG_CONFIG=/etc/disagg/config.toml
EXPOSE 8100
ENTRYPOINT ["disagg", "prefill"]
# docker run --gpus all --network host -v /srv/disagg:/srv/disagg -v /etc/disagg:/etc/disagg disagg-prefill --node spark-0
CMD ["--help"]
