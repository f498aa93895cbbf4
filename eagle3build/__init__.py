"""eagle3build: reproducible EAGLE-3 draft-head builds.

Each stage's on-disk format version lives here. Rules pass the version of their stage (and of every
stage upstream of it) as a Snakemake param, so bumping one reruns exactly that stage and what follows,
while ordinary code edits in this package rerun nothing.
"""

__version__ = "0.1.0"

FORMAT_VERSIONS = {
    "split": 1,
    "regenerate": 1,
    "tokens": 1,
    "hidden": 1,
    "vocab": 1,
    "train": 1,
    "export": 2,  # 2: SGLang's eagle_config ids; the target recorded as configured
    "evaluate": 2,  # 2: hf at T > 0: tau of every question and k from batched samples; step by step under "sequential"
}
