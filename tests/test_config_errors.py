"""Bad config and hostile names: clear errors naming the key; nothing executed, nothing built is lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import STORIES
from snakemake.utils import validate
from workflow_util import copy_workflow, planned_jobs, snakemake, write_config

from eagle3build.config import load_config, resolve_aux_layer_ids, validate_config
from eagle3build.errors import ConfigError, UserError

TEMPLATE = str(Path(__file__).parent / "data" / "chat_template.jinja")


def minimal(tmp_path, **over) -> dict:
    data = tmp_path / "conv.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
                    + "\n")
    cfg = {"target": {"model": str(STORIES), "chat_template": TEMPLATE},
           "datasets": [{"name": "d", "path": str(data)}]}
    cfg.update(over)
    return cfg


def check(tmp_path, cfg) -> None:
    path = tmp_path / "c.yaml"
    import yaml

    path.write_text(yaml.safe_dump(cfg))
    load_config(path)


@pytest.mark.parametrize(
    "over, key",
    [
        ({"prepare": {"max_length": "long"}}, "prepare.max_length"),
        ({"prepare": {"shard_sise": 4}}, "prepare"),
        ({"extract": {"storage_dtype": "int4"}}, "extract.storage_dtype"),
        ({"vocab": {"draft_vocab_size": -1}}, "vocab.draft_vocab_size"),
        ({"train": {"activation_checkpointing": -1}}, "train.activation_checkpointing"),
        ({"train": {"activation_checkpointing": "all"}}, "train.activation_checkpointing"),
        ({"bogus": 1}, "(top level)"),
        ({"datasets": [{"name": "a{shard}", "path": "x.jsonl"}]}, "datasets[0].name"),  # would be a wildcard
    ],
)
def test_wrong_type_or_unknown_key_names_the_key(tmp_path, over, key):
    with pytest.raises(ConfigError) as e:
        check(tmp_path, minimal(tmp_path, **over))
    assert f"config key '{key}'" in str(e.value)
    if "shard_sise" in str(over) or "bogus" in str(over):
        assert "shard_sise" in str(e.value) or "bogus" in str(e.value)  # the unknown key itself is named


@pytest.mark.parametrize("value", [True, False, 0, 3])
def test_activation_checkpointing_takes_true_or_a_number_of_steps(tmp_path, value):
    check(tmp_path, minimal(tmp_path, train={"activation_checkpointing": value}))


@pytest.mark.parametrize("regenerate", [{"temperatur": 0.7}, {"temperature": -1}, "yes"])
def test_a_bad_per_dataset_regenerate_names_the_dataset_key(tmp_path, regenerate):
    cfg = minimal(tmp_path)
    cfg["datasets"][0]["regenerate"] = regenerate
    with pytest.raises(ConfigError) as e:
        check(tmp_path, cfg)
    assert "datasets" in str(e.value) and "regenerate" in str(e.value), str(e.value)


def test_defaults_fill_in(tmp_path):
    path = tmp_path / "c.yaml"
    import yaml

    path.write_text(yaml.safe_dump(minimal(tmp_path)))
    cfg = load_config(path)
    assert cfg["prepare"]["max_length"] == 2048 and cfg["extract"]["storage_dtype"] == "bf16"
    assert cfg["target"]["trust_remote_code"] is False


def test_layer_id_out_of_range_names_key():
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    target = {"path": str(STORIES)}
    assert resolve_aux_layer_ids(target, None) == [2, 2, 2]
    with pytest.raises(ConfigError, match=r"extract\.aux_layer_ids.*\[0, 4\] for this 5-layer target"):
        resolve_aux_layer_ids(target, [1, 2, 5])


def test_missing_model_names_key(tmp_path):
    with pytest.raises(UserError, match="target.model"):
        resolve_aux_layer_ids({"path": str(tmp_path)}, None)


def test_workflow_reports_config_error_with_key(tmp_path):
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    wd = copy_workflow(tmp_path / "wf")
    write_config(wd, minimal(tmp_path, prepare={"max_length": "long"}))
    proc = snakemake(wd, "-n", check=False)
    assert proc.returncode != 0
    assert "config key 'prepare.max_length'" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_hostile_dataset_names_and_paths_execute_nothing(tmp_path):
    """Spaces, quotes, `;` and `$(...)` in names and paths are data, never shell."""
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    wd = copy_workflow(tmp_path / "wf")
    canary = tmp_path / "pwned"
    odd_dir = wd / "my data; touch pwned $(touch pwned) 'q' \"qq\""
    odd_dir.mkdir()
    name = "evil; touch pwned $(touch pwned) `touch pwned` 'x' \"y\" & rm -rf ~ |"
    data = odd_dir / "conv $(id).jsonl"
    line = {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there, friend!"}]}
    data.write_text("\n".join(json.dumps(line) for _ in range(3)) + "\n")
    cfg = minimal(tmp_path, datasets=[{"name": name, "path": str(data)}], vocab={"draft_vocab_size": 32},
                  prepare={"max_length": 64, "shard_size": 2})
    write_config(wd, cfg)
    assert planned_jobs(wd, "build/vocab/mapping.safetensors")["tokens"] == 2
    snakemake(wd, "build/vocab/mapping.safetensors")
    assert (wd / "build" / "tokens" / name / "00001.safetensors").exists()
    assert not canary.exists() and not (wd / "pwned").exists()


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")))
def test_every_shipped_config_validates(name):
    """configs/*.yaml are documented entry points: each must pass the schema as shipped (a renamed or removed
    key would otherwise surface only on the GPU host)."""
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / name)
    assert cfg["datasets"] and cfg["output_root"] != "build"


OVERRIDES = Path(__file__).resolve().parents[1] / "configs" / "overrides"


@pytest.mark.parametrize("name", sorted(p.name for p in OVERRIDES.glob("*.yaml")))
def test_every_shipped_override_validates_over_the_config_it_names(name):
    """configs/overrides/<config>-<what>.yaml is merged over configs/<config>.yaml (`make run CONFIG="A B"`):
    the pair must pass the schema, and the override must keep its own output root."""
    from snakemake.utils import update_config

    configs = OVERRIDES.parent
    base = max((p for p in configs.glob("*.yaml") if name.startswith(p.stem + "-")), key=lambda p: len(p.stem))
    override, config = yaml.safe_load((OVERRIDES / name).read_text()), yaml.safe_load(base.read_text())
    assert override["output_root"] not in ("build", config["output_root"])
    update_config(config, override)
    validate_config(config, validate)


def test_template_text_given_as_chat_template_names_the_key(tmp_path):
    """A template's text where a file path belongs is refused naming the key (no 'File name too long')."""
    from eagle3build.data.chat import load_tokenizer

    with pytest.raises(ConfigError, match="target.chat_template.*not the template's text"):
        load_tokenizer(str(STORIES), chat_template="{% for m in messages %}" * 40)
