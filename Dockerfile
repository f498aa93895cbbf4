# eagle3build image: the official vLLM OpenAI image, pinned by tag AND digest, plus this project.
# The pin has one home, docker/base-image; `make docker-build` reads it and passes it here as build args
# (so these ARGs have no defaults: build through make). To move to another vLLM,
# `docker buildx imagetools inspect vllm/vllm-openai:<tag>` prints the index digest: write
# `vllm/vllm-openai:<tag>@<digest>` into docker/base-image, then run `make doctor` inside the new image
# before a long run.
# Build with BuildKit (RUN --mount); no `# syntax=` line: the builder's own Dockerfile frontend is used, so
# a build needs no registry beyond the one holding the base image.
ARG VLLM_IMAGE
ARG VLLM_TAG
ARG VLLM_DIGEST
FROM ${VLLM_IMAGE}:${VLLM_TAG}@${VLLM_DIGEST}

ARG VLLM_IMAGE
ARG VLLM_TAG
ARG VLLM_DIGEST
LABEL org.opencontainers.image.title="eagle3build" \
      org.opencontainers.image.description="EAGLE-3 draft-head builds (Snakemake workflow) on vLLM" \
      org.opencontainers.image.base.name="${VLLM_IMAGE}:${VLLM_TAG}@${VLLM_DIGEST}"

# EAGLE3_IMAGE names the engine the hidden states come from: the workflow passes it as a param of the
# vLLM-dependent rules, so a new vLLM re-extracts while a rebuilt project layer does not.
# Caches live under /cache (mount a volume there) so that any --user can write them.
ENV EAGLE3_IMAGE="${VLLM_IMAGE}:${VLLM_TAG}@${VLLM_DIGEST}" \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/cache/huggingface \
    XDG_CACHE_HOME=/cache \
    VLLM_CACHE_ROOT=/cache/vllm \
    TRITON_CACHE_DIR=/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/cache/torchinductor

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/eagle3build

# The image keeps its own engine: torch, transformers, vLLM and every other package it has stay as the
# base image built them. docker/image_requirements.py skips each requirement the image already has (the
# image's version wins), holds every installed package at its version (constraints) and refuses
# requirements that contradict vLLM's declared ones; the build then fails if `pip check` reports a
# problem the base image did not already have. Each failure names the package.
# A network that inspects TLS needs its CA bundle for pip: `make docker-build PIP_CERT_FILE=...` hands it
# over as a build secret, present during the RUNs that mount it (no layer, no build arg keeps it).
COPY requirements.txt docker/image_requirements.py ./
RUN --mount=type=secret,id=pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
 && python3 -m pip list --format=freeze > /tmp/image-installed.txt \
 && { python3 -m pip check > /tmp/pip-check-before.txt || true; } \
 && python3 image_requirements.py plan --requirements requirements.txt --installed /tmp/image-installed.txt \
        --install-out /tmp/image-install.txt --constraints-out /tmp/image-constraints.txt \
 && python3 -m pip install --no-cache-dir -c /tmp/image-constraints.txt -r /tmp/image-install.txt \
 && { python3 -m pip check > /tmp/pip-check-after.txt || true; } \
 && python3 image_requirements.py check --before /tmp/pip-check-before.txt --after /tmp/pip-check-after.txt \
 && rm -f /tmp/image-*.txt /tmp/pip-check-*.txt image_requirements.py

COPY pyproject.toml ./
COPY eagle3build ./eagle3build
# The hidden-states connector is located, not imported: importing vllm.distributed loads the engine's whole
# stack (CUDA libraries, its dependencies), which is the runtime's business, not the build's.
RUN --mount=type=secret,id=pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
 && python3 -m pip install --no-cache-dir --no-deps . \
 && python3 -c "import importlib.util as u, pathlib, eagle3build; \
f = pathlib.Path(u.find_spec('vllm').submodule_search_locations[0], 'distributed', 'kv_transfer', \
'kv_connector', 'v1', 'example_hidden_states_connector.py'); \
assert f.is_file(), f'this vLLM lacks the ExampleHiddenStatesConnector ({f})'"

# `make docker-run` runs `make run` in the image: install make where the engine image lacks it (from the
# engine image's own distribution, whatever version it carries: no pin to hold).
# hadolint ignore=DL3008
RUN if ! command -v make >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*; \
    fi

# Non-root by default; `make docker-run` passes --user $(id -u):$(id -g) so files written to the
# bind-mounted work tree belong to the caller.
# /cache is writable by every uid (sticky, like /tmp): XDG_CACHE_HOME points there, and a caller's uid has
# no account in the image (Snakemake's source cache, torch's and Triton's caches go there).
RUN useradd --create-home --uid 1000 eagle \
 && mkdir -p /cache /work \
 && chown eagle:eagle /cache /work \
 && chmod 1777 /cache
USER 1000:1000
WORKDIR /work

# The base image's entrypoint is `vllm serve`; here the command is whatever is asked (make run, bash).
ENTRYPOINT []
CMD ["bash"]
