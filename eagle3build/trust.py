"""The trust policy: when a model repository's own Python code may run, and reading its files without it.

A model repo can ship Python modules that transformers (`auto_map` in config.json or tokenizer_config.json)
and vLLM (`--trust-remote-code`) import when they load it. That code runs with the user's rights, so:

- it runs only with `target.trust_remote_code: true`;
- for a hub id, only with `target.revision` pinned to a 40-hex commit: a branch or tag can point at new
  code tomorrow, a commit cannot (a local folder is what the user reviewed; no pin applies);
- with trust off, a repo that needs its code is refused with the key to set, rather than loaded without
  it (transformers would fall back to a built-in class or fail somewhere less clear).

`check_trust(target)` is called before anything that may import repo code: building the workflow's DAG
(also a dry-run), every transformers load of a tokenizer, config or model, vLLM's command line, the doctor
and `prepare show`. The files it reads (config.json, tokenizer_config.json) are parsed as JSON: reading
them never runs code, and for hub ids it only looks into the local Hugging Face cache (no network).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from eagle3build.errors import ConfigError, UserError

COMMIT = re.compile(r"^[0-9a-f]{40}$")
# Files whose `auto_map` names classes transformers imports from the repo's own modules.
CODE_MAPS = ("config.json", "tokenizer_config.json")


def target_path(target: dict) -> str:
    """The model as configured: `path` in the workflow's target dict, `model` in the config section."""
    path = target.get("path") or target.get("model")
    if not path:
        raise ConfigError("target.model", "is empty; give a local model dir or a hub id")
    return str(path)


def trusted(target: dict) -> bool:
    """Only a real `true` grants remote code (a string such as "yes" does not)."""
    return target.get("trust_remote_code") is True


def is_local(path: str) -> bool:
    return Path(path).exists()


def repo_file(path: str, filename: str, revision: str | None, download: bool = False) -> Path | None:
    """A file of a local model folder or of a hub repo at `revision` (None: not there). Hub files come from
    the local cache; `download` lets huggingface_hub fetch a missing one (a data file, never code), and
    then a failure to reach it raises UserError naming target.model."""
    if is_local(path):
        file = Path(path) / filename
        return file if file.is_file() else None
    if not download:
        from huggingface_hub import try_to_load_from_cache

        try:
            found = try_to_load_from_cache(path, filename, revision=revision)
        except Exception:  # not a repo id either (a missing folder): the loader reports it
            return None
        return Path(found) if isinstance(found, str) else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(path, filename, revision=revision))
    except EntryNotFoundError:
        return None
    except Exception as e:  # offline and not cached, unknown repo, gated, no network...
        raise UserError(
            f"config key 'target.model': cannot read {filename} of '{path}' (revision {revision}): "
            f"{type(e).__name__}: {e}. For a local model give its folder; for a hub id download it first "
            "(`huggingface-cli download <id> --revision <commit>`), HF_TOKEN for gated models"
        ) from e


def read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{file}: line {e.lineno}: invalid JSON ({e.msg})") from e
    if not isinstance(data, dict):
        raise UserError(f"{file}: expected a JSON object, found {type(data).__name__}")
    return data


def remote_code_classes(path: str, revision: str | None = None) -> list[str]:
    """The classes a repo's `auto_map`s load from its own modules ('file: Auto -> module.Class'), read from
    the local folder or the local hub cache ([] when unknown: then transformers, without trust, refuses)."""
    found = []
    for filename in CODE_MAPS:
        file = repo_file(path, filename, revision)
        auto_map = (read_json(file).get("auto_map") or {}) if file else {}
        for auto, refs in auto_map.items():
            refs = refs if isinstance(refs, list) else [refs]
            found += [f"{filename}: {auto} -> {ref}" for ref in refs if isinstance(ref, str) and ref]
    return found


def unpinned_remote_code(target: dict) -> bool:
    """Remote code trusted for a hub id whose revision is not a commit."""
    path = target_path(target)
    return trusted(target) and not is_local(path) and not COMMIT.match(str(target.get("revision") or ""))


def check_trust(target: dict) -> None:
    """Refuse (ConfigError naming the key to set) when loading `target` could run code the policy does not
    allow. `target`: the workflow's target dict or the config's `target` section."""
    path = target_path(target)
    revision = target.get("revision")
    if trusted(target) and not is_local(path) and (path.startswith(("/", ".", "~")) or path.count("/") > 1):
        raise ConfigError("target.model", f"the folder '{path}' does not exist (a hub id is 'org/name')")
    if unpinned_remote_code(target):
        raise ConfigError(
            "target.revision",
            f"is {revision!r}, not a commit, and target.trust_remote_code is true for the hub model '{path}': "
            "its Python code would run from a revision that can change under you. Set target.revision to the "
            "40-character commit sha whose code you reviewed (the repo's 'Files' history), or set "
            "target.trust_remote_code: false",
        )
    if trusted(target):
        return
    classes = remote_code_classes(path, revision)
    if classes:
        pin = "" if is_local(path) else ", with target.revision pinned to a 40-character commit"
        raise ConfigError(
            "target.trust_remote_code",
            f"is false, but '{path}' loads through its own Python code ({'; '.join(classes)}), which is "
            f"never run without trust. Review that code, then set target.trust_remote_code: true{pin}",
        )
