# syntax=docker/dockerfile:1
# geotrain images, one file, two targets:
#   runtime  the training runtime that Kubernetes pods run (infra/render/k8s.py):
#            docker build --target runtime --build-arg VARIANT=cpu  -t ghcr.io/geotrain/runtime:0.1.0-cpu .
#            docker build --target runtime --build-arg VARIANT=cuda -t ghcr.io/geotrain/runtime:0.1.0-cuda .
#            (cuda: PyPI's torch wheel with its CUDA libraries; the driver comes from
#            the node through the NVIDIA container toolkit / GPU Operator)
#   gateway  WireGuard + FRR + socat for a region's gateway pod and route agents:
#            docker build --target gateway -t ghcr.io/geotrain/gateway:0.1.0 .
# Set the image, tag and variant per region in the stack (geotrain:regions[].pool.kubernetes).

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first (the largest layer, changed least): the CPU build from PyTorch's CPU index,
# the CUDA build from the default index
RUN case "$VARIANT" in \
      cpu) pip install --index-url "$TORCH_CPU_INDEX" "torch==${TORCH_VERSION}" ;; \
      cuda) pip install "torch==${TORCH_VERSION}" ;; \
      *) echo "VARIANT must be cpu or cuda, not $VARIANT" >&2; exit 1 ;; \
    esac
# the runtime's own dependencies (pyproject.toml's, less the Pulumi ones pods never import)
RUN pip install "numpy>=1.26" "zstandard>=0.22" "cryptography>=44" "prometheus-client>=0.20" \
      "pydantic>=2.6" "pyyaml>=6" "click>=8.1" "rich>=13.7" "opacus>=1.6" "torchft>=0.2.0"
COPY pyproject.toml README.md /src/
COPY training /src/training
COPY geotrain /src/geotrain
RUN pip install --no-deps /src && rm -rf /src
# the user of infra/render/k8s.py's pods (runAsUser/fsGroup 10001); its home is the
# pods' volume, where relative paths of the launch spec resolve
RUN groupadd --gid 10001 geotrain \
    && useradd --uid 10001 --gid 10001 --home-dir /var/lib/geotrain --no-create-home geotrain \
    && install -d -o 10001 -g 10001 /var/lib/geotrain
USER 10001:10001
WORKDIR /var/lib/geotrain
# the pod's entry point: torchrun for this pod's node of the mounted launch spec
CMD ["python", "-m", "training.launch.torchrun", "--spec", "/etc/geotrain/spec/launch-spec.json"]

FROM debian:bookworm-slim AS gateway
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
      wireguard-tools frr iproute2 iptables socat procps \
    && rm -rf /var/lib/apt/lists/*
# the gateway's files come from its ConfigMap, mounted at /etc/geotrain/gateway
CMD ["/bin/sh", "/etc/geotrain/gateway/gateway.sh"]
