# transferd — multi-stage: wheels built in the first stage, installed offline into a slim runtime
# that runs as a non-root user. Build from the repository root:
#
#   docker build -t transferd:0.1.0 .
#
# Run (one container per role and rank; deploy/compose/ does this across two nodes):
#
#   docker run -d --name transferd-decode --network host --ipc host \
#     -v /run/transferd:/run/transferd -v /etc/transferd/keys:/etc/transferd/keys:ro \
#     --stop-timeout 45 transferd:0.1.0 receiver --config /etc/transferd/receiver.toml
#
# --ipc host: pools are files in /dev/shm that the engine maps too (or give both containers one
# shared, large enough --shm-size). The engine sockets live in /run/transferd (0700, sockets 0600,
# uid 10001): mount the host's directory there, and run the engine as uid 10001 too.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# extras to install, e.g. --build-arg EXTRAS=mooncake for data_plane = "mooncake"
# (deploy/compose/docker-compose.mooncake-rdma.yml builds transferd:0.1.0-mooncake that way)
ARG EXTRAS=""

FROM ${PYTHON_IMAGE} AS build
ARG EXTRAS
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY transferd ./transferd
# transferd's wheel and the wheels of all its dependencies (and of the extras asked for)
RUN pip wheel --wheel-dir /wheels ".${EXTRAS:+[$EXTRAS]}"

# the wheels installed, offline, into a venv that the runtime stage copies (no wheel left behind)
FROM ${PYTHON_IMAGE} AS install
ARG EXTRAS
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY --from=build /wheels /wheels
RUN python -m venv /opt/transferd \
    && /opt/transferd/bin/pip install --no-index --find-links /wheels "transferd${EXTRAS:+[$EXTRAS]}"

FROM ${PYTHON_IMAGE}
ARG EXTRAS
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/transferd/bin:$PATH
COPY --from=install /opt/transferd /opt/transferd
# Mooncake Transfer Engine's wheel links libibverbs (and RDMA NICs need their provider: rdma-core)
RUN case ",${EXTRAS}," in *,mooncake,*) apt-get update -qq \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 ibverbs-providers \
        && rm -rf /var/lib/apt/lists/* ;; esac
RUN groupadd --system --gid 10001 transferd \
    && useradd --system --uid 10001 --gid transferd --home-dir /var/lib/transferd --create-home \
       --shell /usr/sbin/nologin transferd \
    && install -d -o transferd -g transferd -m 0700 /run/transferd \
    && install -d -m 0755 /etc/transferd /etc/transferd/keys
COPY configs/ /etc/transferd/
# the engine sockets (unix://{run_dir}/...); the environment beats a config file's run_dir
ENV TRANSFERD_RUN_DIR=/run/transferd
# numeric, so that a runtime can tell it is not root (Kubernetes runAsNonRoot)
USER 10001:10001
WORKDIR /var/lib/transferd
# SIGTERM drains for up to drain_timeout_s (30 s): give `docker stop` more (--stop-timeout 45)
STOPSIGNAL SIGTERM
# Asks the daemon over its engine socket (not just "is the process there"): `transferd status`
# exits non-zero when the daemon does not answer. This one fits the default command (the
# receiver); a sender container overrides it with its --config and --cp-rank (compose does).
HEALTHCHECK --interval=15s --timeout=10s --start-period=30s --retries=3 \
    CMD ["transferd", "status", "--json", "--config", "/etc/transferd/receiver.toml"]
ENTRYPOINT ["transferd"]
CMD ["receiver", "--config", "/etc/transferd/receiver.toml"]
