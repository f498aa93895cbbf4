# syntax=docker/dockerfile:1
# eagle3build image: the official vLLM OpenAI image, pinned by tag AND digest, plus this project.
# To move to another vLLM: `docker buildx imagetools inspect vllm/vllm-openai:<tag>` prints the index
# digest; change VLLM_TAG and VLLM_DIGEST here and in mk/docker.mk (which passes them as build args),
# then run `make doctor` inside the new image before a long run.
ARG VLLM_IMAGE=vllm/vllm-openai
ARG VLLM_TAG=v0.25.0
ARG VLLM_DIGEST=sha256:fc56161ee42a011aeee78b65d0a81b6683c7d04402fd40503d14d4d6c98f07cb
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

# The pinned requirements may add packages but never swap the engine: torch, vLLM and their kernels
# stay exactly as the base image built them, and the build fails if vLLM's own requirements break.
COPY requirements.txt ./
RUN python3 -m pip freeze | grep -iE '^(torch|torchvision|torchaudio|vllm|triton|xformers|flashinfer-python)==' \
        > /tmp/engine-constraints.txt \
 && python3 -m pip install --no-cache-dir -c /tmp/engine-constraints.txt -r requirements.txt \
 && { python3 -m pip check > /tmp/pip-check.txt || true; } \
 && if grep -iE '^(vllm|torch) ' /tmp/pip-check.txt; then exit 1; fi \
 && rm -f /tmp/engine-constraints.txt /tmp/pip-check.txt

COPY pyproject.toml ./
COPY eagle3build ./eagle3build
RUN python3 -m pip install --no-cache-dir --no-deps . \
 && python3 -c "import importlib.util as u, eagle3build; \
assert u.find_spec('vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector'), \
'this vLLM lacks the ExampleHiddenStatesConnector'"

# Non-root by default; `make docker-run` passes --user $(id -u):$(id -g) so files written to the
# bind-mounted work tree belong to the caller.
RUN useradd --create-home --uid 1000 eagle \
 && mkdir -p /cache /work \
 && chown eagle:eagle /cache /work
USER 1000:1000
WORKDIR /work

# The base image's entrypoint is `vllm serve`; here the command is whatever is asked (make run, bash).
ENTRYPOINT []
CMD ["bash"]
