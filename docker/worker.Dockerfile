# syntax=docker/dockerfile:1.7
# The GPU worker image: Celery worker(s) + training engine + Loraq's compiled CUDA kernels.
#
# CUDA 13.0 devel base because the locked torch is a CUDA 13.0 build (the two must agree on the CUDA major
# version; the host driver must be >= 580) and because nvcc must be present: the kernels are
# compiled ahead of time below for the architectures in CUDA_ARCHS, and a GPU of another
# architecture can still compile them at start instead of failing. Python is Ubuntu 24.04's 3.12.
#
# Build: docker build -f docker/worker.Dockerfile -t loraq-worker .
#        (add --build-arg CUDA_ARCHS="80 86 89 90 100" for more GPU generations)

ARG CUDA_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
WORKDIR /app
# Everything from the hashed lock requirements/cuda.txt (`make lock`, Python 3.12): torch is
# PyPI's CUDA build, whose nvidia-cuda-runtime pin names the CUDA it needs; its major.minor
# must be the base image's (tests/deploy/test_dockerfiles.py checks it).
COPY requirements/cuda.txt requirements/
RUN pip install --require-hashes --no-deps -r requirements/cuda.txt
COPY pyproject.toml README.md ./
COPY service ./service
COPY worker ./worker
COPY gpu_kernels ./gpu_kernels
COPY migrations ./migrations
RUN pip install --no-deps -e .
# Ahead-of-time kernel build: nvcc needs no GPU. gpu_kernels.build caches one library per
# architecture set under LORAQ_KERNEL_CACHE (the worker reads it through its settings), and a worker (pinned to one GPU) looks up its GPU's
# own architecture, so each architecture is built on its own; an architecture not listed here is
# compiled at the worker's first job instead.
ARG CUDA_ARCHS="80 86 89 90"
ENV LORAQ_KERNEL_CACHE=/opt/loraq/kernels
RUN for arch in ${CUDA_ARCHS}; do python -m gpu_kernels.build --arch "$arch" --cache-dir "$LORAQ_KERNEL_CACHE" || exit 1; done

FROM ${CUDA_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 loraq \
 && useradd --system --uid 10001 --gid loraq --home-dir /home/loraq --create-home loraq \
 && mkdir -p /data/models && chown -R loraq:loraq /data
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
# Owned by the worker user: a GPU architecture missing from the cache is built into it at run time.
COPY --from=build --chown=loraq:loraq /opt/loraq/kernels /opt/loraq/kernels
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    LORAQ_KERNEL_CACHE=/opt/loraq/kernels \
    LORAQ_DATA_DIR=/data \
    LORAQ_WORKER_METRICS_PORT=9108
WORKDIR /app
USER loraq
# /data: the artifact store and uploaded datasets, shared with the API (same volume, or the same
# network filesystem on every host). /data/models: base-model weights, a per-host cache.
VOLUME ["/data", "/data/models"]
# Prometheus /metrics: 9108 for the first worker process, 9108+i for the i-th (one per GPU).
EXPOSE 9108
# One Celery worker process per visible GPU; the queue comes from LORAQ_WORKER_QUEUE.
CMD ["loraq", "worker", "--gpus", "all"]
