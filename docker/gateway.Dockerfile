# Gateway: OpenAI + Ollama front, no torch, vLLM or MLX (the build fails if importing it pulls any of them in).
# docker build -f docker/gateway.Dockerfile -t disagg-gateway .
FROM python:3.12-slim

WORKDIR /opt/disagg
COPY pyproject.toml README.md ./
COPY kv_bridge ./kv_bridge
COPY backends ./backends
COPY gateway ./gateway
RUN pip install --no-cache-dir ".[gateway]" \
 && python -c "import sys, gateway.app; heavy = {'torch', 'vllm', 'mlx'} & set(sys.modules); assert not heavy, heavy"

ENV DISAGG_CONFIG=/etc/disagg/config.toml \
    DISAGG_GATEWAY__HOST=0.0.0.0
EXPOSE 8000
USER nobody
ENTRYPOINT ["disagg", "gateway"]
