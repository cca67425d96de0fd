# aps in a container. Build from the repository's root:
#
#   docker build -t aps:server .                       # the server: no torch
#   docker build --build-arg VARIANT=cpu -t aps:cpu .   # + PyTorch (CPU wheels) and the examples' datasets
#   docker build --build-arg VARIANT=cuda -t aps:cuda . # + PyTorch with CUDA and the examples' datasets
#
# BASE is any Debian-based image with Python 3.10+ and pip (python:3.11-slim-bookworm by
# default; where no registry is reachable, one made with debootstrap from Debian's archive:
# bookworm, --variant=minbase, with python3, python3-pip, python3-venv and ca-certificates;
# the server image built on it was 409 MB).
# The entrypoint (entrypoint.sh) turns what Kubernetes and Slurm say of a process into
# aps's variables, then runs its command: `aps serve` unless told otherwise.
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE}
ARG VARIANT=server
# Debian's own python3 is "externally managed" (PEP 668): let pip install here (build time only)
ARG PIP_BREAK_SYSTEM_PACKAGES=1
COPY --from=build /wheels /wheels
RUN wheel="$(echo /wheels/*.whl)" \
    && case "$VARIANT" in \
         server) pip install --no-cache-dir "$wheel" ;; \
         cpu) pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu \
                "$wheel[torch,examples]" ;; \
         cuda) pip install --no-cache-dir "$wheel[torch,examples]" ;; \
         *) echo "VARIANT is server, cpu or cuda, not $VARIANT" >&2; exit 2 ;; \
       esac \
    && rm -rf /wheels \
    && useradd --uid 10001 --create-home aps
COPY examples /opt/aps/examples
COPY examples/deploy/entrypoint.sh /usr/local/bin/aps-entrypoint
USER 10001
WORKDIR /home/aps
# In a container the server listens on every interface (so it needs a token, or --insecure said
# aloud); 7450: workers (TCP); 8080: the HTTP side (/metrics, /healthz, /readyz) when APS_HTTP_PORT
# says so.
ENV APS_HOST=0.0.0.0
EXPOSE 7450 8080
ENTRYPOINT ["aps-entrypoint"]
