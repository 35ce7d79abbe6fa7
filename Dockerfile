# syntax=docker/dockerfile:1.7
#
# qworker image. One file, two variants chosen by a build argument:
#
#   CPU (slim Debian + Python 3.11, torch 2.13.0 CPU build):
#     docker build -t qworker:0.1.0-cpu .
#   GPU (CUDA runtime on Ubuntu 24.04, torch 2.11 CUDA build + triton):
#     docker build --build-arg VARIANT=cuda -t qworker:0.1.0-cuda .
#
# The model is never downloaded at run time. Either mount a Hugging Face
# folder and point QWORKER_MODEL at it (the Helm chart's default), or bake a
# local folder into the image:
#     docker build --build-arg MODEL_SOURCE=baked \
#                  --build-arg MODEL_DIR=models/smollm2-135m -t qworker:0.1.0-cpu-smollm2 .
#
# Python dependencies come from requirements.lock (exact pins, used as pip
# constraints so one lock serves both variants); torch is installed first and
# pinned, from the PyTorch index of the variant, because an unpinned resolve
# pulls whatever CUDA build is newest.
#
# Needs BuildKit (the default builder since Docker 23): unused stages are
# skipped, so the model folder is only read when MODEL_SOURCE=baked.

ARG VARIANT=cpu
ARG MODEL_SOURCE=volume
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---------------------------------------------------------------------------
# Base images. Builder and runtime share one, so the virtualenv copied from
# the builder finds the same interpreter at the same path.
# ---------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base-cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# tini runs as PID 1: it forwards SIGTERM to the worker (which then drains)
# and reaps the compiler and tokenizer children the worker may spawn.
# gcc: the CPU engine compiles its C kernels (kernels/csrc) on first start for
# the node's own CPU (-march=native), into $XDG_CACHE_HOME; without a
# compiler it runs the slower torch references.
# Reason for DL3008: apt package versions in a Debian point release move with
# security updates; pinning them breaks the build within weeks. The base
# image tag is what pins the OS.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

FROM ${CUDA_IMAGE} AS base-cuda
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The CUDA image has no Python; Ubuntu 24.04 ships 3.12. Triton compiles
# its launcher stubs on first use, so gcc and the Python headers stay in the
# runtime image.
# Reason for DL3008: as above; the CUDA base image tag pins the OS packages.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev gcc libc6-dev tini ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# ---------------------------------------------------------------------------
# Builder: a virtualenv with torch, the locked dependencies and qworker.
# ---------------------------------------------------------------------------
# Reason for DL3006: base-${VARIANT} and model-${MODEL_SOURCE} name stages of
# this file (tagged images above), not registry images; hadolint cannot
# resolve a stage name built from an ARG and asks for a tag.
# hadolint ignore=DL3006
FROM base-${VARIANT} AS builder
ARG VARIANT
ARG TORCH_CPU_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_CUDA_VERSION=2.11.0
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv "$VIRTUAL_ENV"
RUN case "$VARIANT" in \
      cpu)  pip install --no-cache-dir --index-url "$TORCH_CPU_INDEX" "torch==${TORCH_CPU_VERSION}" ;; \
      cuda) pip install --no-cache-dir --index-url "$TORCH_CUDA_INDEX" "torch==${TORCH_CUDA_VERSION}" ;; \
      *)    echo "VARIANT must be cpu or cuda, got '$VARIANT'" >&2; exit 1 ;; \
    esac
WORKDIR /src
COPY requirements.lock ./
COPY pyproject.toml README.md ./
COPY qworker ./qworker
COPY kernels ./kernels
# The gpu extra adds triton; torch's CUDA wheel already depends on the
# matching triton, so the constraint file never pins it.
RUN if [ "$VARIANT" = cuda ]; then target=".[gpu]"; else target="."; fi \
 && pip install --no-cache-dir --constraint requirements.lock "$target" \
 && qworker --help > /dev/null

# ---------------------------------------------------------------------------
# Model stages: exactly one of them is used, chosen by MODEL_SOURCE.
# ---------------------------------------------------------------------------
# hadolint ignore=DL3006
FROM base-${VARIANT} AS model-volume
# Empty: the model arrives as a volume at run time.
RUN mkdir -p /model

# hadolint ignore=DL3006
FROM base-${VARIANT} AS model-baked
ARG MODEL_DIR=models/smollm2-135m
COPY ${MODEL_DIR}/ /model/

# hadolint ignore=DL3006
FROM model-${MODEL_SOURCE} AS model

# ---------------------------------------------------------------------------
# Runtime.
# ---------------------------------------------------------------------------
# hadolint ignore=DL3006
FROM base-${VARIANT} AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="qworker" \
      org.opencontainers.image.description="Queue-driven LLM inference worker (Kafka in, continuous batching, streamed results out)" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed non-root uid/gid; the Helm chart runs the pod as the same ids.
RUN groupadd --system --gid 10001 qworker \
 && useradd --system --uid 10001 --gid qworker --create-home \
      --home-dir /home/qworker --shell /usr/sbin/nologin qworker
COPY --from=builder /opt/venv /opt/venv
COPY --from=model --chown=10001:10001 /model/ /opt/qworker/model/
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    QWORKER_MODEL=/opt/qworker/model \
    QWORKER_DEVICE=${VARIANT} \
    QWORKER_HTTP_PORT=8080
USER 10001:10001
WORKDIR /home/qworker
EXPOSE 8080
# SIGTERM starts the worker's drain (bounded by QWORKER_DRAIN_TIMEOUT_S);
# give `docker stop` a matching --time, as the chart does with its grace period.
STOPSIGNAL SIGTERM
# Kubernetes uses its own probes; this one serves plain `docker run`.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('QWORKER_HTTP_PORT', '8080'), timeout=4)"]
# Exec form: tini is PID 1 and the worker its direct child, with no shell
# in between to swallow the signal.
ENTRYPOINT ["tini", "--", "qworker", "run"]
CMD []
