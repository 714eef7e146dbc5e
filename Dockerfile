# transferd — multi-stage: build a wheel, install it into a slim runtime as a non-root user.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY transferd ./transferd
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /var/lib/transferd --create-home transferd
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY configs /etc/transferd
USER transferd
ENV TRANSFERD_RUN_DIR=/run/transferd
# pools live in /dev/shm: run with --ipc=host (or a shared tmpfs) so engines can attach them
ENTRYPOINT ["transferd"]
CMD ["receiver", "--config", "/etc/transferd/local.toml"]
