# syntax=docker/dockerfile:1.7
# The API image: FastAPI control plane, database migrations on start. No CUDA, no torch.
#
# Why no torch: the `loraq` distribution's own dependencies are the control plane; torch,
# transformers, safetensors and gguf are the `worker` extra, which the API never
# imports (import-linter contract "API never imports torch"; tests/deploy/test_api_image_deps.py
# imports the app with those modules blocked). They would add about 1 GB for nothing. `tokenizers`
# (a few MB, no torch) is the control plane's: the API counts tokens at submit.
# Dependencies come from the hashed lock requirements/api.txt (`make lock`): every image built
# from one commit gets the same bytes. The package itself is installed with --no-deps.
#
# Build: docker build -f docker/api.Dockerfile -t loraq-api .

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /app
# Dependencies first, in their own layer: a source change does not reinstall them.
COPY requirements/api.txt requirements/
RUN pip install --require-hashes --no-deps -r requirements/api.txt
COPY pyproject.toml README.md ./
COPY service ./service
COPY worker ./worker
COPY gpu_kernels ./gpu_kernels
COPY migrations ./migrations
COPY docker/api-entrypoint.sh docker/
# Editable: migrations/ is found next to the source, and /app is copied whole into the runtime stage.
RUN pip install --no-deps -e .

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 loraq \
 && useradd --system --uid 10001 --gid loraq --home-dir /home/loraq --create-home loraq \
 && mkdir -p /data && chown loraq:loraq /data
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    LORAQ_DATA_DIR=/data \
    LORAQ_HOST=0.0.0.0 \
    LORAQ_PORT=8000
WORKDIR /app
USER loraq
# Uploaded datasets and the artifact store (adapters, checkpoints): shared with the workers.
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('LORAQ_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["/app/docker/api-entrypoint.sh"]
