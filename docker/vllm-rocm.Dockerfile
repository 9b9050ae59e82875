# syntax=docker/dockerfile:1
# Hetmesh worker with the `vllm` engine on AMD Instinct GPUs: vLLM's ROCm build (the image AMD
# publishes for each vLLM release; pick the tag for your GPU family and ROCm version, on the vLLM
# 0.32 line the connector is written against) plus hetmesh.
#   docker build -f docker/vllm-rocm.Dockerfile --build-arg VLLM_IMAGE=rocm/vllm:<tag> -t hetmesh-vllm-rocm:dev .
ARG VLLM_IMAGE=rocm/vllm:latest
FROM ${VLLM_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
# Keep the image's ROCm torch and vLLM exactly as they are; add only what hetmesh needs.
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
ENTRYPOINT []
CMD ["python3", "-m", "hetmesh.worker", "--worker-id", "rocm-0"]
