"""Config: validation against the JSON schema and values resolved from the target's own config.

The Snakefile validates with `snakemake.utils.validate` (which also fills defaults); tools that run
outside Snakemake (`doctor`, `prepare show`) call `load_config` for the same result.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from eagle3build.errors import ConfigError, UserError

SCHEMA = Path(__file__).resolve().parents[1] / "schemas" / "config.schema.yaml"


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
    """Validate against the schema, naming the offending key; then let Snakemake fill the defaults."""
    _check(_schema(), config, "")
    validate(config, str(SCHEMA))


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
        raise ConfigError(key or "(top level)", f"{error.message} (see schemas/config.schema.yaml)")


def section_schema(section: str) -> dict:
    """The schema of one config section, by dotted name ('train', 'extract.vllm')."""
    node = _schema()
    for part in section.split("."):
        node = node["properties"][part]
    return node


def section_defaults(section: str) -> dict:
    """The defaults of one config section as the schema states them (the one source of every default)."""
    import copy

    props = section_schema(section).get("properties", {})
    return {k: copy.deepcopy(v["default"]) for k, v in props.items() if "default" in v}


def resolve_section(section: str, given: dict | None) -> dict:
    """A section as a stage uses it: the keys given (a rule's params, an API call's arguments) checked
    against the schema, over the schema's defaults. An unknown key or a bad value names its config key."""
    given = dict(given or {})
    schema = section_schema(section)
    known = schema.get("properties", {})
    unknown = sorted(set(given) - set(known))
    if unknown and schema.get("additionalProperties") is False:
        raise ConfigError(f"{section}.{unknown[0]}", f"unknown key; known keys: {sorted(known)}")
    _check(schema, given, section)
    return {**section_defaults(section), **given}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from e


@lru_cache(maxsize=8)
def _target_config(path: str, revision: str | None, trust_remote_code: bool) -> dict:
    local = Path(path) / "config.json"
    if local.is_file():
        return _read_json(local)
    if Path(path).exists():
        raise UserError(f"config key 'target.model': {path} has no config.json")
    from transformers import AutoConfig  # a hub id: resolved through the local HF cache

    try:
        return AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code).to_dict()
    except Exception as e:
        raise UserError(f"config key 'target.model': cannot read the config of '{path}' ({e}). For a local "
                        f"model give its folder; run `make setup` to build the default model") from e


def target_text_config(target: dict) -> dict:
    """The text model's config (multimodal configs nest it under text_config)."""
    cfg = _target_config(str(target["path"]), target.get("revision"), bool(target.get("trust_remote_code")))
    return cfg.get("text_config") or cfg


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers (2, N//2, N-3), shared by the reference code, vLLM and SGLang."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(target: dict, configured: list[int] | None) -> list[int]:
    return check_aux_layer_ids(configured, int(target_text_config(target)["num_hidden_layers"]))


def check_aux_layer_ids(configured: list[int] | None, n: int) -> list[int]:
    """Three ids low to high in [0, N); repeats are allowed (tiny targets, single-stream ablations)."""
    ids = list(configured) if configured else default_aux_layer_ids(n)
    if len(ids) != 3 or sorted(ids) != ids or not all(0 <= i < n for i in ids):
        raise ConfigError("extract.aux_layer_ids", f"{ids} must be three layer ids, low to high, in [0, {n - 1}] "
                          f"for this {n}-layer target (default {default_aux_layer_ids(n)})")
    return ids
