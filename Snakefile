# EAGLE-3 draft-head build: split -> (regenerate) -> tokens -> extract -> vocab -> train -> export -> evaluate.
# Each stage is one .smk in rules/; its logic lives in the eagle3build package. See docs/DESIGN.md.
from snakemake.utils import min_version

min_version("9.0")


# `--configfile X` replaces the default instead of being merged over it (a test or cluster config
# must not inherit datasets or eval sets from config.yaml).
if not workflow.config_settings.configfiles:

    configfile: "config.yaml"


include: "rules/common.smk"


# The pinned image every job runs in (make docker-run); with --sdm apptainer Snakemake uses it itself.
container: CONTAINER_IMAGE


wildcard_constraints:
    ds="[^/]+",
    shard=r"\d{5}",
    evalset="[^/]+",


include: "rules/prepare.smk"
include: "rules/regenerate.smk"
include: "rules/extract.smk"
include: "rules/vocab.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"


rule all:
    default_target: True
    input:
        final_targets(),


onstart:
    sigterm_as_ctrl_c()
    preflight()


onsuccess:
    stop_extraction_servers()


onerror:
    stop_extraction_servers()
