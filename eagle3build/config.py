"""Config: validation against the JSON schema and values resolved from the target's own config.

The Snakefile validates with `snakemake.utils.validate` (which also fills defaults); tools that run
outside Snakemake (`doctor`, `prepare show`) call `load_config` for the same result.
"""

from __future__ import annotations

import copy
import sys
import warnings
from functools import lru_cache
from pathlib import Path

from eagle3build.errors import ConfigError, UserError
from eagle3build.trust import is_local, read_json, repo_file, target_path

SCHEMA = Path(__file__).resolve().parent / "config.schema.yaml"  # packaged with the code (package-data)
# Keys older configs may still set that no longer change anything: dropped with a warning, so such a
# config keeps working. Dotted key -> why it is not needed.
REMOVED_KEYS = {
    "extract.vllm.allow_mla": (
        "MLA targets (DeepSeek-V3, Kimi-K2/K2.5) are supported by vLLM's extract_hidden_states: a pure-MLA "
        "target forms one KV-cache group, which the connector handles (docs/PRODUCTION.md)"
    ),
}
# model_types whose vLLM decoder (deepseek_v2.py) adds a residual that does not exist before layer 0
DEEPSEEK_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25"})


class RemovedKeyWarning(UserWarning):
    """A config sets a key the schema no longer has; it is ignored."""


def drop_removed_keys(config: dict, section: str = "") -> None:
    """Remove REMOVED_KEYS from `config` (the whole config, or the section named), warning for each.
    Nested sections on the way are copied, not changed: a caller's own dicts stay as they were."""
    prefix = f"{section}." if section else ""
    for key, why in REMOVED_KEYS.items():
        if not key.startswith(prefix):
            continue
        *parents, name = key[len(prefix):].split(".")
        node = config
        for part in parents:
            if not isinstance(node.get(part), dict):
                break
            node[part] = node = dict(node[part])
        else:
            if name not in node:
                continue
            del node[name]
            warnings.warn(f"config key '{key}' is no longer needed and is ignored: {why}. Delete it.",
                          RemovedKeyWarning, stacklevel=3)


def load_config(path: str | Path) -> dict:
    import yaml
    from snakemake.utils import validate

    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML ({e})") from e
    validate_config(config, validate)
    return config


def validate_config(config: dict, validate) -> None:
    """Validate against the schema, naming the offending key; then let Snakemake fill the defaults.
    Keys an older schema had (REMOVED_KEYS) are dropped from `config` with a warning first."""
    drop_removed_keys(config)
    _check(_schema(), config, "")
    validate(config, str(SCHEMA))
    check_output_root(config["output_root"])


# Folders an output root must never be: `make clean-hidden` removes the root and every stage writes its
# own top-level folders (data/, tokens/, train/, logs/ ...) in it. PROTECTED_TREES: nothing under them either.
SYSTEM_FOLDERS = frozenset(
    {"/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/media", "/mnt",
     "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var"}
)
PROTECTED_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/sbin",
                   "/sys", "/usr")


def check_output_root(root: str, workdir: str | Path | None = None) -> Path:
    """The output root resolved (against `workdir`, default the working directory), refused when it is
    empty, climbs with `..`, or resolves to /, a system folder, the home folder, or the working directory
    or a folder above it: every output and every `make clean` stays inside a folder of its own."""
    def refuse(why: str) -> ConfigError:
        return ConfigError("output_root", f"{root!r} {why}; use a folder of its own such as 'build' or "
                                          "'/scratch/eagle3/build'")

    if not str(root).strip():
        raise refuse("is empty: outputs would land in the working directory's top level")
    if ".." in Path(root).parts:
        raise refuse("contains '..'")
    base = Path(workdir or Path.cwd()).resolve()
    resolved = Path("/" + str((base / root).resolve()).lstrip("/"))  # POSIX keeps a leading "//"
    if str(resolved) in SYSTEM_FOLDERS or any(resolved.is_relative_to(t) for t in PROTECTED_TREES):
        raise refuse(f"resolves to the system folder {resolved}")
    if resolved == Path.home().resolve():
        raise refuse(f"resolves to the home folder {resolved}")
    if resolved == base or base.is_relative_to(resolved):
        raise refuse(f"resolves to {resolved}, the working directory or a folder above it (its sources and "
                     "data would mix with outputs, and `make clean-hidden` would delete them)")
    return resolved


# `train` keys that trade compute for memory and change no trained weight (eagle3build/ttt/recompute.py): a
# run resumes across them, and the train rule's params carry them only where they differ from the
# defaults, so turning one on and off again plans nothing.
TRAIN_MEMORY_KEYS = ("activation_checkpointing", "loss_chunk_tokens")


def train_rule_params(given: dict, train: dict) -> dict:
    """The train rule's `train` params: the keys the config gives (`given`), less the logging and
    resume-point knobs and the memory switches at their defaults (`train`: the section with its defaults)."""
    progress, defaults = train_progress_keys(train), section_defaults("train")
    return {k: v for k, v in given.items()
            if k not in progress and not (k in TRAIN_MEMORY_KEYS and v == defaults[k])}


def train_progress_keys(train: dict) -> tuple[str, ...]:
    """The `train` keys that change no trained weight, only logs and resume points: the train rule's params
    leave them out (changing one retrains nothing) and so does a run's identity (it resumes). `train`: the
    section with its defaults. log_every: metric lines; keep_checkpoints: resume points on disk;
    checkpoint_every: resume points too, unless it also sets the validation steps (eval_every null), among
    which the best step, the weights the stage writes, is chosen."""
    keys = ("log_every", "keep_checkpoints")
    return keys if train.get("eval_every") is None else (*keys, "checkpoint_every")


def main(argv: list[str] | None = None) -> int:
    """`python -m eagle3build.config output-root CONFIG`: the checked output root (for `make clean`)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m eagle3build.config")
    parser.add_argument("command", choices=["output-root"])
    parser.add_argument("config")
    args = parser.parse_args(argv)
    import yaml

    try:
        given = yaml.safe_load(Path(args.config).read_text()) or {}
        root = given.get("output_root", section_schema("output_root")["default"]) if isinstance(given, dict) else None
        if not isinstance(root, str):
            raise ConfigError("output_root", f"must be a string, got {root!r}")
        check_output_root(root)
    except (OSError, yaml.YAMLError, UserError) as e:
        print(f"{args.config}: {e}", file=sys.stderr)
        return 2
    print(root)
    return 0


@lru_cache(maxsize=1)
def _schema() -> dict:
    import yaml

    return yaml.safe_load(SCHEMA.read_text())


def _check(schema: dict, value: dict, prefix: str) -> None:
    import jsonschema

    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(value))
    if error is not None:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        key = (prefix + path).lstrip(".")
        raise ConfigError(key or "(top level)", f"{error.message} (see eagle3build/config.schema.yaml)")


def section_schema(section: str) -> dict:
    """The schema of one config section, by dotted name ('train', 'extract.vllm')."""
    node = _schema()
    for part in section.split("."):
        node = node["properties"][part]
    return node


def section_defaults(section: str) -> dict:
    """The defaults of one config section as the schema states them (the one source of every default)."""
    props = section_schema(section).get("properties", {})
    return {k: copy.deepcopy(v["default"]) for k, v in props.items() if "default" in v}


def resolve_section(section: str, given: dict | None) -> dict:
    """A section as a stage uses it: the keys given (a rule's params, an API call's arguments) checked
    against the schema, over the schema's defaults. An unknown key or a bad value names its config key."""
    given = dict(given or {})
    drop_removed_keys(given, section)
    schema = section_schema(section)
    known = schema.get("properties", {})
    unknown = sorted(set(given) - set(known))
    if unknown and schema.get("additionalProperties") is False:
        raise ConfigError(f"{section}.{unknown[0]}", f"unknown key; known keys: {sorted(known)}")
    _check(schema, given, section)
    return {**section_defaults(section), **given}


def _model_config(path: str, revision: str | None) -> dict:
    file = repo_file(path, "config.json", revision, download=True)
    if file is None:
        where = "folder" if is_local(path) else f"hub repo (revision {revision})"
        raise UserError(f"config key 'target.model': the {where} '{path}' has no config.json; "
                        "give a Hugging Face model (run `make setup` to build the default model)")
    return read_json(file)


# A hub id's file is looked up once per process (a download, or the cache's refs); a local file is re-read.
_hub_model_config = lru_cache(maxsize=8)(_model_config)


def read_model_config(path: str, revision: str | None = None) -> dict:
    """A model's config.json as a dict: a local folder's file, or a hub id's at `revision` (the local HF
    cache, else downloaded as a file). Parsed as JSON, never through AutoConfig: no repository code runs,
    whatever the trust policy, so the workflow can read it while it builds its DAG."""
    path = str(path)
    if is_local(path):
        return _model_config(path, revision)
    return copy.deepcopy(_hub_model_config(path, revision))


def target_text_config(target: dict) -> dict:
    """The text model's config (multimodal configs nest it under text_config)."""
    cfg = read_model_config(target_path(target), target.get("revision"))
    return cfg.get("text_config") or cfg


def target_config_int(target: dict, key: str, config: dict | None = None) -> int:
    """An integer the build needs from the target's config.json (a multimodal config's text_config):
    one that is missing or not a positive integer names the file, the key and the config key. `config`: the
    config.json already read (default: read it)."""
    full = config if config is not None else read_model_config(target_path(target), target.get("revision"))
    value = (full.get("text_config") or full).get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        where = f"{target_path(target)}/config.json"
        found = "has no" if value is None else f"has {value!r} for"
        raise ConfigError("target.model", f"{where} {found} '{key}' (nor its text_config), which the build "
                                          "needs: not the config of a causal language model? Point target.model "
                                          "at the model's own folder or hub id")
    return value


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers (2, N//2, N-3), shared by the reference code, vLLM and SGLang."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(target: dict, configured: list[int] | None, vllm: str | None = None) -> list[int]:
    """The aux ids for the target (`check_aux_layer_ids`); `vllm`: see `vllm_serves_target`."""
    full = read_model_config(target_path(target), target.get("revision"))
    n = target_config_int(target, "num_hidden_layers", full)
    return check_aux_layer_ids(configured, n, vllm, deepseek_family(full) if vllm else None)


def vllm_serves_target(config: dict) -> str | None:
    """The setting that makes vLLM capture the aux states ("extract.backend: vllm"), or None: what
    `check_aux_layer_ids` checks beyond the HF rules."""
    if (config.get("extract") or {}).get("backend") == "vllm":
        return "extract.backend: vllm"
    return None


def deepseek_family(config: dict) -> str | None:
    """Why a target's config.json makes vLLM run it with its DeepSeek decoder (or None)."""
    for cfg in (config, config.get("text_config") or {}):
        if cfg.get("model_type") in DEEPSEEK_MODEL_TYPES:
            return f"model_type {cfg['model_type']}"
        for arch in cfg.get("architectures") or []:
            if "Deepseek" in arch or "Kimi" in arch:
                return f"architecture {arch}"
    return None


def check_aux_layer_ids(configured: list[int] | None, n: int, vllm: str | None = None,
                        family: str | None = None) -> list[int]:
    """Three ids low to high in [0, N). The HF backend allows repeats (tiny targets, single-stream
    ablations). When vLLM captures them (`vllm`: the setting that makes it, e.g. "extract.backend: vllm"),
    ids must be distinct (vLLM returns one state per distinct layer: the engine crashes on the first request
    in 0.25/0.26, 0.34 refuses to start) and, on a DeepSeek-family target (`family`: why it is one), not 0
    (its decoder adds a residual that is None before layer 0: the engine crashes)."""
    default = default_aux_layer_ids(n)
    ids = list(configured) if configured else default
    if len(ids) != 3 or sorted(ids) != ids or not all(0 <= i < n for i in ids):
        raise ConfigError("extract.aux_layer_ids", f"{ids} must be three layer ids, low to high, in [0, {n - 1}] "
                          f"for this {n}-layer target (default {default})")
    given = "" if configured else f" (the default (2, N//2, N-3) for N = {n})"
    if vllm and len(set(ids)) != len(ids):
        raise ConfigError(
            "extract.aux_layer_ids",
            f"{ids}{given} repeats a layer, which vLLM cannot capture ({vllm}): it returns one state per distinct "
            f"layer and the engine crashes on the first request; set three distinct ids in [1, {n - 1}], "
            "or use the hf backend",
        )
    if vllm and family and ids[0] == 0:
        raise ConfigError(
            "extract.aux_layer_ids",
            f"{ids}{given} captures layer 0, which vLLM's DeepSeek decoder cannot ({family}, {vllm}): it adds a "
            f"residual that does not exist before layer 0 and the engine crashes on the first request; use ids "
            f">= 1 (e.g. the default {default}), or the hf backend",
        )
    return ids


if __name__ == "__main__":
    sys.exit(main())
