# Docker targets, included by the Makefile (`-include mk/docker.mk`); also usable alone:
# `make -f mk/docker.mk docker-run`. The image is the official vLLM image, pinned by tag AND digest,
# plus this project (see Dockerfile); `make docker-run` runs `make run` inside it on every GPU.
#
#   make docker-build                     build $(IMAGE):$(IMAGE_TAG)
#   make docker-run [CONFIG=...]          make run inside the image (GPUs, work tree, model cache)
#   make docker-dry-run [CONFIG=...]      make dry-run inside the image
#   make lint-docker                      hadolint Dockerfile
#
# EAGLE3_IMAGE (= $(VLLM_IMAGE):$(VLLM_TAG)@$(VLLM_DIGEST)) names the engine the hidden states come
# from. The image exports it (Dockerfile ENV, from the same build args); the workflow reads it
# (extract.image overrides it) and passes it as a param of the vLLM-dependent rules, so a new vLLM
# image re-extracts. It is not exported to host runs: those do not run in the image.

DOCKER ?= docker
VLLM_IMAGE ?= vllm/vllm-openai
VLLM_TAG ?= v0.25.0
VLLM_DIGEST ?= sha256:fc56161ee42a011aeee78b65d0a81b6683c7d04402fd40503d14d4d6c98f07cb
EAGLE3_IMAGE := $(VLLM_IMAGE):$(VLLM_TAG)@$(VLLM_DIGEST)

DOCKER_PROJECT_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml 2>/dev/null)
IMAGE ?= eagle3build
IMAGE_TAG ?= $(DOCKER_PROJECT_VERSION)-vllm$(VLLM_TAG)

CONFIG ?= config.yaml
HF_CACHE ?= $(HOME)/.cache/huggingface
DOCKER_CACHE ?= $(HOME)/.cache/eagle3build
# Host variables handed to the container when they are set (a bare `-e NAME` copies the host's value).
DOCKER_ENV ?= HF_TOKEN HUGGING_FACE_HUB_TOKEN CUDA_VISIBLE_DEVICES
# plus every NCCL_* / TORCH_NCCL_* / VLLM_* / TORCHINDUCTOR_* variable set in the environment or on the make command line.
DOCKER_ENV_ALL = $(sort $(DOCKER_ENV) $(foreach v,$(filter NCCL_% TORCH_NCCL_% VLLM_% TORCHINDUCTOR_%,$(.VARIABLES)),\
	$(if $(filter environment% command%,$(origin $(v))),$(v))))
DOCKER_RUN_ARGS ?=

# The work tree is bind-mounted at the same path, so `.snakemake/` (Snakemake's provenance records)
# and every output persist between runs and absolute paths in logs stay valid on the host.
# --ipc=host: NCCL and vLLM's workers share memory through /dev/shm. --init reaps the vLLM server's
# orphaned workers.
DOCKER_RUN_FLAGS = --rm --init \
	--gpus all --ipc=host \
	--user $(shell id -u):$(shell id -g) -e HOME=/tmp \
	-v "$(CURDIR):$(CURDIR)" -w "$(CURDIR)" \
	-v "$(HF_CACHE):/cache/huggingface" -e HF_HOME=/cache/huggingface \
	-v "$(DOCKER_CACHE):/cache/build" -e VLLM_CACHE_ROOT=/cache/build/vllm -e TRITON_CACHE_DIR=/cache/build/triton \
	$(foreach v,$(DOCKER_ENV_ALL),-e $(v)) \
	$(DOCKER_RUN_ARGS)
DOCKER_RUN = $(DOCKER) run $(DOCKER_RUN_FLAGS) $(IMAGE):$(IMAGE_TAG)

.PHONY: docker-build docker-run docker-dry-run docker-shell lint-docker

docker-build: ## build the image: the pinned vLLM image + this project
	$(DOCKER) build \
		--build-arg VLLM_IMAGE=$(VLLM_IMAGE) --build-arg VLLM_TAG=$(VLLM_TAG) --build-arg VLLM_DIGEST=$(VLLM_DIGEST) \
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
