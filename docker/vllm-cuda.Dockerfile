# syntax=docker/dockerfile:1
# Hetmesh worker with the `vllm` engine on NVIDIA GPUs: vLLM's official CUDA image plus hetmesh.
# The KV connector (hetmesh.engines.vllm_connector) is written against vLLM 0.32's
# KVConnectorBase_V1: keep VLLM_IMAGE on that release line. NixlConnector (RDMA) ships in this
# image: set `kv_connector = "nixl"` under [workers.vllm] to move KV GPU to GPU.
#   docker build -f docker/vllm-cuda.Dockerfile -t hetmesh-vllm-cuda:dev .
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
# Whatever the image already has (torch, vllm, their CUDA builds) stays exactly as it is; pip only
# adds what hetmesh needs on top (nats-py, redis, tenacity, OpenTelemetry, ...).
RUN python3 -m pip freeze > /tmp/image.txt \
 && python3 -m pip install -c /tmp/image.txt . \
 && python3 -c "import hetmesh.worker, hetmesh.engines.vllm_connector, vllm"
COPY ops/clusters /app/ops/clusters
WORKDIR /app
ENV HETMESH_CLUSTER=/app/ops/clusters/vllm-compose.toml \
    HETMESH_NATS_URL=nats://nats:4222 \
    HETMESH_REDIS_URL=redis://redis:6379/0 \
    HETMESH_METRICS_PORT=9464
EXPOSE 9464
# The base image's entrypoint is `vllm serve`; a Hetmesh worker runs AsyncLLM in its own process.
ENTRYPOINT []
CMD ["python3", "-m", "hetmesh.worker", "--worker-id", "cuda-0"]
