# DLO images, one Dockerfile, three targets:
#   engine     (default)  dlo serve with the locked package set (requirements/engine.lock): docker build .
#   slim                  the operator and the node agent, no torch:             docker build --target slim .
#   vllm-omni             vLLM-Omni as the engine (DLODeployment engine.kind: vllm-omni)
# The base and the torch build are build arguments, e.g. an Ascend CANN base with torch_npu:
#   docker build --build-arg ENGINE_BASE=... --build-arg TORCH_INDEX_URL=... .

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG ENGINE_BASE=ubuntu:24.04
ARG VLLM_OMNI_BASE=vllm/vllm-openai:v0.27.0

# ---- build: wheels of dlo and its base dependencies -------------------------------------------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli ./cli
COPY plan ./plan
COPY pagecache ./pagecache
COPY engine ./engine
COPY serving ./serving
COPY agent ./agent
COPY operator ./operator
COPY delivery ./delivery
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# ---- slim: operator + agent (no torch) ---------------------------------------------------------
FROM ${PYTHON_IMAGE} AS slim
ARG NVIDIA_ML_PY_VERSION=13.615.71
COPY --from=build /wheels /wheels
# nvidia-ml-py: the agent reads GPU topology through NVML when the node's runtime provides it.
RUN pip install --no-cache-dir /wheels/*.whl "nvidia-ml-py==${NVIDIA_ML_PY_VERSION}" \
    && rm -rf /wheels \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp dlo
USER 10001:10001
ENV HOME=/tmp PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
ENTRYPOINT ["dlo"]
CMD ["--help"]

# ---- engine: dlo serve, with exactly the committed package set ----------------------------------
# requirements/engine.lock (python -m bench lock) is the set the device measurements use too (bench/device.sh):
# every package pinned and hash-checked, installed without their dependencies, so nothing the serve does not
# import comes in (no scipy, scikit-learn, pandas, torchvision, onnxruntime, peft, kopf or kubernetes). torch
# then comes from its index at the locked build (cu130): its requirements are already met at the locked
# versions but its CUDA libraries and triton, which are that build's own pins. Those libraries are pip
# packages, so the base needs no CUDA toolkit: Ubuntu 24.04's Python 3.12 (the lock's), the driver from the
# node (the NVIDIA container runtime; a CUDA 13 driver, >= 580). Another accelerator: another base and index.
FROM ${ENGINE_BASE} AS engine
ARG TORCH_VERSION=2.11.0+cu130
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ENV DEBIAN_FRONTEND=noninteractive PIP_BREAK_SYSTEM_PACKAGES=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/dlo
ENV PATH=/opt/dlo/bin:$PATH
COPY requirements/engine.lock /tmp/engine.lock
# pip writes bytecode at install (its default; never pass --no-compile here): the user below cannot
# write it, and a start that compiles torch and diffusers from source takes twice as long to /ready
# (docs/engine.md, "Start-up").
RUN grep -v '^torch==' /tmp/engine.lock > /tmp/engine-pypi.lock \
    && pip install --no-cache-dir --no-deps --require-hashes -r /tmp/engine-pypi.lock \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && pip check \
    && rm /tmp/engine.lock /tmp/engine-pypi.lock
COPY --from=build /wheels /wheels
# dlo itself without its dependencies: the lock is the whole set (the operator's and agent's own
# requirements stay in the slim image)
RUN pip install --no-cache-dir --no-deps /wheels/dlo-*.whl \
    && rm -rf /wheels \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp dlo
USER 10001:10001
ENV HOME=/tmp PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
EXPOSE 8000
ENTRYPOINT ["dlo"]
CMD ["serve", "--help"]

# ---- vllm-omni: vLLM-Omni engine, with dlo for the warmer ---------------------------------------
FROM ${VLLM_OMNI_BASE} AS vllm-omni
ARG VLLM_OMNI_VERSION=0.27.0rc1
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "vllm-omni==${VLLM_OMNI_VERSION}" /wheels/*.whl \
    && rm -rf /wheels \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp dlo
USER 10001:10001
ENV HOME=/tmp PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
EXPOSE 8000
ENTRYPOINT []
CMD ["vllm", "serve", "--help"]

# The default target is the engine.
FROM engine
