# Gateway: OpenAI + Ollama front, no torch, vLLM or MLX (the build fails if importing it pulls any of them in).
# docker build -f docker/gateway.Dockerfile -t disagg-gateway .   (compose.yaml builds it; .dockerignore keeps
# .venv, models and .git out of the context)
FROM python:3.12-slim

LABEL org.opencontainers.image.title="disagg-gateway" \
      org.opencontainers.image.description="disagg gateway: OpenAI/Ollama/Anthropic API in front of the nodes"

WORKDIR /opt/disagg-src
COPY pyproject.toml README.md ./
COPY kv_bridge ./kv_bridge
COPY backends ./backends
COPY gateway ./gateway
# The project itself, with the versions its pyproject.toml names (litellm within its tested range there).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[gateway]" \
 && python -c "import sys, gateway.app; heavy = {'torch', 'vllm', 'mlx'} & set(sys.modules); assert not heavy, heavy"

# The config's [gateway] host and ports decide where it listens (compose runs it with host networking).
ENV DISAGG_CONFIG=/opt/disagg/config.toml
EXPOSE 8000 11434
# Numeric: compose runs it as the owner of /opt/disagg on the host (DISAGG_UID/GID) so it reads the 0600 secrets.
USER 10001:10001
ENTRYPOINT ["disagg", "gateway"]
