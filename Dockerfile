# The Sluice image: one image for every part (`sluice dispatcher`, `sluice agent`,
# `sluice engine`, `sluice gateway`, and the admin commands such as `sluice drain`).
# Build:  docker build -t sluice:0.1.0 .
# Run:    docker run --rm sluice:0.1.0 --help
# NATS is not in it: deploy/compose and deploy/k8s run the official nats image.
ARG PYTHON_IMAGE=python:3.11-slim

# Wheels of Sluice and of every dependency, built once. Sluice's native cache index, scoring
# loop and worker orders (dispatcher/_cacheindex.c, _scoring.c, _orders.c) are compiled here,
# hence gcc in this stage only; the binary dependencies
# (tokenizers, pyzmq, uvloop, xxhash, msgpack) have manylinux wheels.
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY . .
RUN pip install --no-cache-dir --upgrade pip \
 && pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin sluice
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels sluice \
 && rm -rf /wheels
# Non-root: the Kubernetes manifests also say runAsUser 10001 and a read-only root filesystem
# (the parts write nothing but what a setting names, e.g. decision_log, and /tmp).
USER 10001:10001
# gateway 8080, metrics and probes 9464 (dispatcher) / 9465 (agent), sluice engine 8000
EXPOSE 8080 9464 9465 8000
ENTRYPOINT ["sluice"]
CMD ["--help"]
