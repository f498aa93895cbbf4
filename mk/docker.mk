# Docker targets, included by the Makefile (`-include mk/docker.mk`); also usable alone:
# `make -f mk/docker.mk docker-run`. The image is the official vLLM image, pinned by tag AND digest,
# plus this project (see Dockerfile); `make docker-run` runs `make run` inside it on every GPU.
#
#   make docker-build                     build $(IMAGE):$(IMAGE_TAG)
#   make docker-run [CONFIG=...]          make run inside the image (GPUs, work tree, model cache)
#   make docker-dry-run [CONFIG=...]      make dry-run inside the image
#   make lint-docker                      hadolint Dockerfile
#
# The engine image is pinned in ONE place, docker/base-image (repository:tag@digest): make splits it into
# VLLM_IMAGE, VLLM_TAG and VLLM_DIGEST (each may be overridden, e.g. to try another image) and passes them
# to the Dockerfile as build args; the workflow reads the same file for its `container:` directive.
#
# EAGLE3_IMAGE names the engine the hidden states come from: the image exports it (Dockerfile ENV, from
# the same build args); the workflow reads it (extract.image overrides it) and passes it as a param of the
# vLLM-dependent rules, so a new vLLM image re-extracts. make never sets it: a value of the user's (shell
# or make command line) reaches host runs as given and docker-run passes it into the container
# (`-e EAGLE3_IMAGE`); unset, host runs name none and the container keeps the image's own. A run naming none
# judges each hidden shard by the image the shard records (rules/common.smk extract_image): a host dry-run
# after `make docker-run` plans nothing, while another image re-extracts.

DOCKER ?= docker
, := ,
VLLM_BASE_IMAGE := $(strip $(shell cat $(dir $(lastword $(MAKEFILE_LIST)))../docker/base-image))
VLLM_BASE_REF := $(firstword $(subst @, ,$(VLLM_BASE_IMAGE)))
VLLM_BASE_TAG := $(lastword $(subst :, ,$(VLLM_BASE_REF)))
VLLM_IMAGE ?= $(patsubst %:$(VLLM_BASE_TAG),%,$(VLLM_BASE_REF))
VLLM_TAG ?= $(VLLM_BASE_TAG)
VLLM_DIGEST ?= $(lastword $(subst @, ,$(VLLM_BASE_IMAGE)))

DOCKER_PROJECT_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml 2>/dev/null)
IMAGE ?= eagle3build
IMAGE_TAG ?= $(DOCKER_PROJECT_VERSION)-vllm$(VLLM_TAG)

CONFIG ?= config.yaml
HF_CACHE ?= $(HOME)/.cache/huggingface
DOCKER_CACHE ?= $(HOME)/.cache/eagle3build
# Host variables handed to the container when they are set (a bare `-e NAME` copies the host's value).
DOCKER_ENV ?= HF_TOKEN HUGGING_FACE_HUB_TOKEN CUDA_VISIBLE_DEVICES
# plus EAGLE3_IMAGE and every NCCL_* / TORCH_NCCL_* / VLLM_* / TORCHINDUCTOR_* variable set in the environment
# or on the make command line.
# (VLLM_IMAGE, VLLM_TAG and VLLM_DIGEST are this file's build variables, not vLLM settings.)
DOCKER_ENV_ALL = $(sort $(DOCKER_ENV) $(foreach v,EAGLE3_IMAGE $(filter-out VLLM_IMAGE VLLM_TAG VLLM_DIGEST,\
	$(filter NCCL_% TORCH_NCCL_% VLLM_% TORCHINDUCTOR_%,$(.VARIABLES))),\
	$(if $(filter environment% command%,$(origin $(v))),$(v))))
DOCKER_RUN_ARGS ?=
# `--gpus $(DOCKER_GPUS)` (empty: no --gpus, for engines without the NVIDIA runtime, e.g. the CPU stand-in).
DOCKER_GPUS ?= all
# The container's user: the caller's, so files written to the bind-mounted work tree belong to the caller.
DOCKER_USER ?= $(shell id -u):$(shell id -g)
# The caller's uid has no account in the image: USER answers getpass.getuser() (Snakemake asks it).
DOCKER_USER_NAME ?= $(or $(shell id -un 2>/dev/null),uid$(shell id -u))
# Build: PIP_CERT_FILE (a CA bundle for pip behind a TLS-inspecting network) goes in as a BuildKit secret,
# never into a layer; DOCKER_BUILD_NETWORK=host where only the host's network reaches the package index.
PIP_CERT_FILE ?=
DOCKER_BUILD_NETWORK ?=
DOCKER_BUILD_ARGS ?=

# The work tree is bind-mounted at the same path, so `.snakemake/` (Snakemake's provenance records)
# and every output persist between runs and absolute paths in logs stay valid on the host.
# --ipc=host: NCCL and vLLM's workers share memory through /dev/shm. --init reaps the vLLM server's
# orphaned workers; TINI_KILL_PROCESS_GROUP makes that init hand a signal (Ctrl-C, proxied by the client)
# to the whole process group like a terminal does: to make alone, make would wait forever for Snakemake.
DOCKER_RUN_FLAGS = --rm --init -e TINI_KILL_PROCESS_GROUP=1 \
	$(if $(DOCKER_GPUS),--gpus $(DOCKER_GPUS)) --ipc=host \
	--user $(DOCKER_USER) -e HOME=/tmp -e USER=$(DOCKER_USER_NAME) \
	-v "$(CURDIR):$(CURDIR)" -w "$(CURDIR)" \
	-v "$(HF_CACHE):/cache/huggingface" -e HF_HOME=/cache/huggingface \
	-v "$(DOCKER_CACHE):/cache/build" -e VLLM_CACHE_ROOT=/cache/build/vllm -e TRITON_CACHE_DIR=/cache/build/triton \
	$(foreach v,$(DOCKER_ENV_ALL),-e $(v)) \
	$(DOCKER_RUN_ARGS)
DOCKER_RUN = $(DOCKER) run $(DOCKER_RUN_FLAGS) $(IMAGE):$(IMAGE_TAG)

.PHONY: docker-build docker-run docker-dry-run docker-shell lint-docker docker-standin docker-standin-demo

# The Dockerfile uses BuildKit (RUN --mount): a client without the buildx plugin needs DOCKER_BUILDKIT=1 and
# the engine's own client (Debian's docker.io: DOCKER=/usr/bin/docker).
docker-build: export DOCKER_BUILDKIT = 1
docker-build: ## build the image: the pinned vLLM image + this project
	$(DOCKER) build \
		--build-arg VLLM_IMAGE=$(VLLM_IMAGE) --build-arg VLLM_TAG=$(VLLM_TAG) --build-arg VLLM_DIGEST=$(VLLM_DIGEST) \
		$(if $(PIP_CERT_FILE),--secret id=pip_cert$(,)src=$(PIP_CERT_FILE)) \
		$(if $(DOCKER_BUILD_NETWORK),--network $(DOCKER_BUILD_NETWORK)) $(DOCKER_BUILD_ARGS) \
		-t $(IMAGE):$(IMAGE_TAG) .

docker-run: ## `make run` inside the image on every GPU
	@mkdir -p "$(HF_CACHE)" "$(DOCKER_CACHE)"
	$(DOCKER_RUN) make run CONFIG=$(CONFIG)

docker-dry-run: ## `make dry-run` inside the image
	@mkdir -p "$(HF_CACHE)" "$(DOCKER_CACHE)"
	$(DOCKER_RUN) make dry-run CONFIG=$(CONFIG)

docker-shell: ## an interactive shell in the image
	@mkdir -p "$(HF_CACHE)" "$(DOCKER_CACHE)"
	$(DOCKER) run -it $(DOCKER_RUN_FLAGS) $(IMAGE):$(IMAGE_TAG) bash

lint-docker: ## hadolint the Dockerfile
	hadolint Dockerfile

# The CPU stand-in for the vLLM image (docker/standin/): on a machine without a registry or GPU (run as root),
# `make docker-standin` sets up the engine (docker/standin/engine.sh: Debian's docker.io, dockerd started by
# hand), builds the stand-in and pushes it to a registry on localhost (docker/standin/build.sh, which prints
# its pin), then builds this project's image on it through docker-build, as $(STANDIN_IMAGE):$(IMAGE_TAG) so
# that it is never taken for the real one. `make docker-standin-demo` also runs the CPU demo in it
# (docker-run without --gpus), then shows that a second run plans nothing. The Dockerfile is the real one.
STANDIN_IMAGE ?= eagle3build-standin
STANDIN_PIN = pin="$$(DOCKER=$$client docker/standin/build.sh)" && ref="$${pin%@*}" && \
	set -- DOCKER=$$client VLLM_IMAGE="$${ref%:*}" VLLM_TAG="$${ref\#\#*:}" VLLM_DIGEST="$${pin\#*@}" \
	IMAGE=$(STANDIN_IMAGE) DOCKER_GPUS= PIP_CERT_FILE=$(or $(PIP_CERT_FILE),$(wildcard /etc/ssl/certs/ca-certificates.crt)) \
	DOCKER_BUILD_NETWORK=host

docker-standin: ## CPU machines: engine + stand-in vLLM image (local registry) + this project's image on it
	client="$$(docker/standin/engine.sh)" && $(STANDIN_PIN) && $(MAKE) --no-print-directory docker-build "$$@"

docker-standin-demo: docker-standin ## CPU machines: the demo inside the stand-in image, then a rerun that plans nothing
	client="$$(docker/standin/engine.sh)" && $(STANDIN_PIN) && \
	$(MAKE) --no-print-directory docker-run "$$@" && $(MAKE) --no-print-directory docker-dry-run "$$@"

