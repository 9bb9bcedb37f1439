# The peerd daemon image: `peerd start` as a non-root user, state in the /var/lib/peerd volume.
#
#   docker build -t peerd:dev .
#   docker run -d --name peerd -p 31337:31337 -p 127.0.0.1:9400:9400 -v peerd-data:/var/lib/peerd \
#     peerd:dev --run demo --announce /ip4/PUBLIC_IP/tcp/31337
#
# Build arguments:
#   BASE_IMAGE      any image with python3 >= 3.11 and the venv module (python:3.11-slim, or a
#                   Debian bookworm with python3 + python3-venv); both stages use it.
#   PIP_EXTRA_ARGS  extra arguments for both pip installs. Wheels put in the build context under
#                   .wheels/ are visible at /src/.wheels, so "--find-links /src/.wheels" installs
#                   from them (how a CPU build of torch gets in: PyPI's torch==2.13.0 on x86_64 is
#                   the CUDA build). docs/operations.md shows the commands.

ARG BASE_IMAGE=python:3.11-slim

# ---- build: a self-contained venv in /opt/peerd --------------------------------------------------
FROM ${BASE_IMAGE} AS build
ARG PIP_EXTRA_ARGS=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
# A venv behaves the same whether the base has pip on PATH (python:3.11-slim) or not (Debian's python3).
RUN python3 -m venv /opt/peerd
ENV PATH=/opt/peerd/bin:$PATH
COPY . /src
WORKDIR /src
# torch first and pinned exactly: a looser requirement lets pip pick another build than the one
# the project is tested with. Then peerd itself (a regular install, not editable: /src is dropped).
# pip's cache lives in a cache mount, outside the layers, so a rebuild after a source change (which
# re-runs both steps) need not download torch again.
RUN --mount=type=cache,target=/root/.cache/pip pip install $PIP_EXTRA_ARGS "torch==2.13.0"
RUN --mount=type=cache,target=/root/.cache/pip pip install $PIP_EXTRA_ARGS . \
 && peerd --version

# ---- runtime: the venv, a user, a volume ---------------------------------------------------------
FROM ${BASE_IMAGE}
# Fixed IDs so a host directory or a volume shared between containers can be chowned in advance.
ARG PEERD_UID=10001
RUN groupadd --gid ${PEERD_UID} peerd \
 && useradd --no-log-init --uid ${PEERD_UID} --gid peerd --home-dir /var/lib/peerd --no-create-home \
      --shell /usr/sbin/nologin peerd \
 && mkdir -p /var/lib/peerd \
 && chown peerd:peerd /var/lib/peerd \
 && chmod 0700 /var/lib/peerd
COPY --from=build /opt/peerd /opt/peerd
# Listen on every interface of the container; UPnP and AutoNAT stay off (peerd's defaults).
ENV PATH=/opt/peerd/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PEERD_DATA_DIR=/var/lib/peerd \
    PEERD_HOST=0.0.0.0 \
    PEERD_METRICS_HOST=0.0.0.0
USER peerd
WORKDIR /var/lib/peerd
# Declared after the chown so a fresh named volume starts out owned by peerd.
VOLUME ["/var/lib/peerd"]
# 31337: libp2p (TCP). 9400: Prometheus /metrics. The control API is a unix socket in the volume.
EXPOSE 31337/tcp 9400/tcp
# SIGTERM drains (leave runs, stop servers) within drain_timeout (10 s by default); give
# `docker stop` more than that, e.g. `docker stop -t 15` (compose: stop_grace_period).
STOPSIGNAL SIGTERM
# The standard gRPC health service over the control socket: exit 0 only when the daemon is READY.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["peerd", "health", "--data-dir", "/var/lib/peerd"]
ENTRYPOINT ["peerd", "start"]
