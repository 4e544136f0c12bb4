# DLO images, one Dockerfile, three targets:
#   engine     (default)  dlo with torch + diffusers on a CUDA (or other) base:   docker build .
#   slim                  the operator and the node agent, no torch:             docker build --target slim .
#   vllm-omni             vLLM-Omni as the engine (DLODeployment engine.kind: vllm-omni)
# The torch/CUDA base is a build argument, e.g. an Ascend CANN base with torch_npu:
#   docker build --build-arg ENGINE_BASE=... --build-arg TORCH_INDEX_URL=... .

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG ENGINE_BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
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

# ---- engine: dlo serve on a CUDA base with torch ----------------------------------------------
FROM ${ENGINE_BASE} AS engine
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive PIP_BREAK_SYSTEM_PACKAGES=1
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/dlo
ENV PATH=/opt/dlo/bin:$PATH
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY --from=build /src /src
# pip writes bytecode at install (its default; never pass --no-compile here): the user below cannot
# write it, and a start that compiles torch and diffusers from source takes twice as long to /ready
# (docs/engine.md, "Start-up").
RUN pip install --no-cache-dir "/src[engine]" \
    && rm -rf /src \
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
