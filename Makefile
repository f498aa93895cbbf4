# eagle3build — drive the Snakemake workflow. `make` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTHON ?= python3
CONFIG ?= config.yaml
CORES ?= all
GPUS ?= $(shell $(PYTHON) -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
SNAKEMAKE ?= $(PYTHON) -m snakemake
# --configfile replaces the Snakefile's default config; targets go before --resources (see docs).
SMK = $(SNAKEMAKE) --configfile $(CONFIG) --cores $(CORES) $(SMK_ARGS)
SMK_RES = --resources gpu=$(if $(filter 0,$(GPUS)),1,$(GPUS))
TORCH_CPU ?= torch==2.13.0
MODEL_DIR ?= models/SmolLM2-135M-Instruct
PYTEST_ARGS ?=
SMK_ARGS ?=

.PHONY: help setup run dry-run unlock summary dag report test test-fast lint doctor show clean clean-hidden

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}'
	@echo "  variables: CONFIG=$(CONFIG) CORES=$(CORES) GPUS=$(GPUS)"

setup: ## install pinned dependencies (CPU torch where none is installed) and build the default target model
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install $(TORCH_CPU)
	$(PYTHON) -m pip install -r requirements.txt -r requirements-dev.txt
	$(PYTHON) -m pip install --no-deps -e .
	$(PYTHON) -m eagle3build.smollm2 $(MODEL_DIR)

run: ## build everything stale (the draft, its export and evaluation)
	$(SMK) $(SMK_RES)

dry-run: ## show the jobs a run would do, and why
	$(SMK) -n $(SMK_RES)

unlock: ## after a crash or kill: release Snakemake's lock on the work tree (outputs are kept)
	$(SMK) --unlock

summary: ## every output with its state and plan
	$(SMK) --summary

dag: ## the rule graph as dot (dag.dot) and, where graphviz is installed, dag.svg
	$(SMK) --rulegraph > dag.dot
	@command -v dot >/dev/null && dot -Tsvg dag.dot > dag.svg && echo "wrote dag.svg" || echo "wrote dag.dot"

report: ## snakemake's HTML report (evaluation plots) -> report.html
	$(SMK) --report report.html

doctor: ## preflight: check that model, tokenizer, layers, vLLM, GPUs and disk fit before a long run
	$(PYTHON) -m eagle3build.doctor --config $(CONFIG)

show: ## print one prepared sample with its trained tokens highlighted: make show SHARD=build/tokens/demo/00000.safetensors [INDEX=0]
	$(PYTHON) -m eagle3build.data.prepare show $(SHARD) --index $(or $(INDEX),0) --config $(CONFIG)

test: ## the whole test suite (what CI runs)
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

test-fast: ## the suite without the end-to-end workflow runs
	$(PYTHON) -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint: ## snakemake --lint, snakefmt, ruff, hadolint
	$(SMK) --lint
	$(PYTHON) -m snakefmt --check Snakefile rules/
	$(PYTHON) -m ruff check .
	$(MAKE) --no-print-directory lint-docker

clean: ## remove training/export/evaluation outputs and logs; keeps hidden states, tokens and data
	@$(CHECKED_ROOT); set -x; rm -rf -- "$$root/train" "$$root/export" "$$root/eval" "$$root/logs" report.html dag.dot dag.svg

clean-hidden: ## also delete hidden states (hours of GPU time): needs CONFIRM=yes
	@if [ "$(CONFIRM)" != "yes" ]; then echo "refusing: hidden states cost GPU hours; run 'make clean-hidden CONFIRM=yes'"; exit 1; fi
	@$(CHECKED_ROOT); set -x; rm -rf -- "$$root"

# The config's output_root, checked (eagle3build/config.py check_output_root: never /, a system or home
# folder, the working directory or above it, nor '..'), into the shell variable `root`: the value never
# passes through make's text or an unquoted shell word, and an empty or refused root deletes nothing.
CHECKED_ROOT = root="$$($(PYTHON) -m eagle3build.config output-root '$(CONFIG)')" || exit 1; \
	case "$$root" in ""|/|*/..|*/../*|../*|..) echo "refusing to clean output_root '$$root'"; exit 1;; esac

-include mk/docker.mk
