"""Bad inputs that used to pass silently or crash without a name: unsafe names and output roots, non-finite
hidden states and weights, datasets and evaluation sets that yield nothing, target configs without the
keys the build needs, and logging knobs that retrained."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, STORIES
from safetensors import safe_open
from safetensors.torch import save_file
from workflow_util import copy_workflow, planned_params, snakemake, write_config

from eagle3build.config import check_output_root, load_config, resolve_aux_layer_ids, target_config_int
from eagle3build.errors import ConfigError, UserError

TEMPLATE = str(Path(__file__).parent / "data" / "chat_template.jinja")
GOOD = {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there, friend!"}]}


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def config(tmp_path: Path, **over) -> dict:
    data = write_jsonl(tmp_path / "conv.jsonl", [GOOD])
    cfg = {"target": {"model": str(STORIES), "chat_template": TEMPLATE}, "datasets": [{"name": "d", "path": data}]}
    cfg.update(over)
    return cfg


def load(tmp_path: Path, cfg: dict) -> dict:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path)


def need_stories():
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")


# ------------------------------------------------------------------ names and the output root
UNSAFE_NAMES = ["..", ".", ".hidden", "a/b", "a\\b", "a{shard}", "{x}", "line\nbreak"]


@pytest.mark.parametrize("name", UNSAFE_NAMES)
def test_a_dataset_name_must_be_one_safe_folder_name(tmp_path, name):
    """`..` made tokens/.. and hidden/.. the same folder: extraction overwrote the token shards."""
    cfg = config(tmp_path)
    cfg["datasets"][0]["name"] = name
    with pytest.raises(ConfigError) as e:
        load(tmp_path, cfg)
    assert e.value.key == "datasets[0].name", str(e.value)


@pytest.mark.parametrize("name", UNSAFE_NAMES)
def test_an_eval_set_name_must_be_one_safe_folder_name(tmp_path, name):
    cfg = config(tmp_path, evaluate={"sets": [{"name": "ok", "path": "q.jsonl"}, {"name": name, "path": "q.jsonl"}]})
    with pytest.raises(ConfigError) as e:
        load(tmp_path, cfg)
    assert e.value.key == "evaluate.sets[1].name", str(e.value)


@pytest.mark.parametrize("name", ["demo", "my.data-1", "ShareGPT_v3 (clean)", "x..y", "evil; $(id) 'q' & |"])
def test_ordinary_and_odd_but_harmless_names_still_pass(tmp_path, name):
    cfg = config(tmp_path, evaluate={"sets": [{"name": name, "path": "q.jsonl"}]})
    cfg["datasets"][0]["name"] = name
    assert load(tmp_path, cfg)["datasets"][0]["name"] == name


def test_the_workflow_names_the_key_of_an_eval_set_name_with_braces(tmp_path):
    """It was a WildcardError naming no config key."""
    need_stories()
    wd = copy_workflow(tmp_path / "wf")
    write_config(wd, config(tmp_path, evaluate={"sets": [{"name": "mt{bench}", "path": "q.jsonl"}]}))
    proc = snakemake(wd, "-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "config key 'evaluate.sets[0].name'" in out, out[-3000:]
    assert "WildcardError" not in out


@pytest.mark.parametrize("root", ["", " ", "/", "//", "..", "../elsewhere", "build/../..", ".", "./", "/usr",
                                  "/usr/local/build", "/etc/eagle3", "/proc/x", "/tmp", "/home", "/var"])
def test_an_output_root_outside_a_folder_of_its_own_is_refused(tmp_path, monkeypatch, root):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load(tmp_path, config(tmp_path, output_root=root))
    assert e.value.key == "output_root", str(e.value)


def test_the_home_folder_and_folders_above_the_working_directory_are_refused(tmp_path, monkeypatch):
    work = tmp_path / "project" / "run"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "me"))
    (tmp_path / "me").mkdir()
    for root in (str(tmp_path / "me"), str(tmp_path / "project"), str(tmp_path)):
        with pytest.raises(ConfigError, match="output_root"):
            check_output_root(root)
    link = work / "out"
    link.symlink_to("/")  # a root that resolves to / through a link
    with pytest.raises(ConfigError, match="system folder /"):
        check_output_root("out")
    assert check_output_root("build") == work / "build"
    assert check_output_root(str(tmp_path / "me" / "eagle3")) == tmp_path / "me" / "eagle3"
    assert check_output_root("/tmp/eagle3-build") == Path("/tmp/eagle3-build").resolve()


def run_make_clean(tmp_path: Path, output_root, target: str = "clean") -> tuple[subprocess.CompletedProcess, list]:
    """`make clean` in a fresh folder, with an `rm` that only records its arguments: whatever the Makefile
    would delete, nothing is."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    calls = tmp_path / "rm-calls.jsonl"
    (fake / "rm").write_text(f"#!{sys.executable}\nimport json, sys\n"
                             f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    (fake / "rm").chmod(0o755)
    cfg = {"target": {"model": "m"}, "datasets": [{"name": "d", "path": "x.jsonl"}]}
    if output_root is not None:
        cfg["output_root"] = output_root
    (work / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["make", "-s", "-f", str(ROOT / "Makefile"), target, "CONFIG=c.yaml", "CONFIRM=yes",
                           f"PYTHON={sys.executable}"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=120)
    recorded = [json.loads(x) for x in calls.read_text().splitlines()] if calls.exists() else []
    calls.unlink(missing_ok=True)
    return proc, recorded


@pytest.mark.parametrize("target", ["clean", "clean-hidden"])
@pytest.mark.parametrize("root", ["", "/", "..", "."])
def test_make_clean_never_deletes_outside_the_output_root(tmp_path, root, target):
    """It ran `rm -rf /train /export /eval /logs` for output_root "" or "/" (and `rm -rf /` for clean-hidden)."""
    proc, recorded = run_make_clean(tmp_path, root, target)
    assert proc.returncode != 0 and recorded == [], (proc.stdout, proc.stderr, recorded)
    assert "output_root" in proc.stderr


def test_make_clean_deletes_inside_the_output_root_with_the_name_as_one_word(tmp_path):
    proc, recorded = run_make_clean(tmp_path, "my build")
    assert proc.returncode == 0, proc.stderr
    assert recorded == [["-rf", "--", "my build/train", "my build/export", "my build/eval", "my build/logs",
                         "report.html", "dag.dot", "dag.svg"]]
    proc, recorded = run_make_clean(tmp_path, None, "clean-hidden")  # the default root
    assert proc.returncode == 0 and recorded == [["-rf", "--", "build"]], proc.stderr


# ------------------------------------------------------------------ non-finite training and weights
def corrupt_hidden_rows(path: str, rows: int) -> None:
    """Bit rot: the first `rows` hidden rows of a shard become NaN in place (bf16 0x7fc0)."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(n))["hidden"]
        assert entry["dtype"] == "BF16"
        rows, row_bytes = min(rows, entry["shape"][0]), 2 * entry["shape"][1] * entry["shape"][2]
        f.seek(8 + n + entry["data_offsets"][0])
        f.write(b"\xc0\x7f" * (rows * row_bytes // 2))


@pytest.fixture(scope="module")
def train_inputs(tmp_path_factory):
    from test_train import make_inputs

    return make_inputs(tmp_path_factory.mktemp("nan_inputs"))


def test_training_on_a_rotten_shard_stops_naming_the_step_and_the_shard(train_inputs, tmp_path):
    """It trained to NaN weights, exported them with rc 0, and evaluation reported tau = 1.0."""
    from test_train import FAST

    from eagle3build.train.loop import train

    shards = []
    for path in train_inputs["shards"]:
        copy = tmp_path / "hidden" / Path(path).name
        copy.parent.mkdir(exist_ok=True)
        copy.write_bytes(Path(path).read_bytes())
        shards.append(str(copy))
    corrupt_hidden_rows(shards[1], 10_000)  # the whole second shard
    out = tmp_path / "out"
    with pytest.raises(UserError) as e:
        train(shards, train_inputs["mapping"], train_inputs["target"], str(out), str(tmp_path / "state"),
              {**FAST, "epochs": 1})
    message = str(e.value)
    assert shards[1] in message and shards[0] not in message, message
    assert "step " in message and "not finite" in message
    assert not (out / "draft.safetensors").exists()


def test_a_diverged_run_from_finite_inputs_says_so(train_inputs, tmp_path):
    from test_train import FAST

    from eagle3build.train.loop import train

    with pytest.raises(UserError, match=r"step 2: .*not finite.*from finite hidden states: the run diverged"):
        train(train_inputs["shards"], train_inputs["mapping"], train_inputs["target"], str(tmp_path / "out"),
              str(tmp_path / "state"), {**FAST, "epochs": 1, "lr": 1e30, "grad_clip": 0.0, "warmup_ratio": 0.0,
                                        "checkpoint_every": 1})


@pytest.fixture(scope="module")
def trained(train_inputs, tmp_path_factory):
    from test_train import FAST

    from eagle3build.train.loop import train

    root = tmp_path_factory.mktemp("trained")
    train(train_inputs["shards"], train_inputs["mapping"], train_inputs["target"], str(root / "train"),
          str(root / "state"), {**FAST, "epochs": 1})
    return root / "train" / "draft.safetensors"


def rewrite_weights(src: Path, dst: Path, name: str, value: float) -> str:
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = value
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst), metadata=meta)
    return str(dst)


def test_export_refuses_non_finite_weights_naming_the_file(trained, train_inputs, tmp_path):
    from eagle3build.draft.export import export

    bad = rewrite_weights(trained, tmp_path / "train" / "draft.safetensors", "fc.weight", float("nan"))
    with pytest.raises(UserError, match=r"train/draft\.safetensors: tensors \['fc\.weight'\] hold NaN/inf"):
        export(bad, train_inputs["mapping"], train_inputs["target"], str(tmp_path / "export"))
    assert not (tmp_path / "export" / "eagle3").exists()
    # finite in float32, beyond float16's range: the cast would write inf
    big = rewrite_weights(trained, tmp_path / "big" / "draft.safetensors", "fc.weight", 1e6)
    with pytest.raises(UserError, match=r"export\.dtype float16"):
        export(big, train_inputs["mapping"], train_inputs["target"], str(tmp_path / "export"), {"dtype": "float16"})
    export(big, train_inputs["mapping"], train_inputs["target"], str(tmp_path / "export"), {"dtype": "float32"})
    assert (tmp_path / "export" / "eagle3" / "model.safetensors").exists()


# ------------------------------------------------------------------ datasets that yield nothing
def test_a_split_shard_whose_records_are_all_invalid_fails_naming_the_dataset_and_the_counts(tmp_path):
    from eagle3build.data.prepare import split_dataset

    good = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    src = write_jsonl(tmp_path / "bad.jsonl", [good] * 4 + [{"conversations": []}] * 4)
    # the workflow's job for shard 1 of 2 (only a single-job split of the whole dataset failed before)
    with pytest.raises(UserError) as e:
        split_dataset(src, "auto", [str(tmp_path / "00001.jsonl")], 4, None, None, "bad", first_shard=1,
                      total_shards=2)
    message = str(e.value)
    assert "dataset 'bad'" in message and "shard 1" in message and "yields no samples" in message, message
    assert "all 4 records were skipped" in message and "empty: 4" in message, message


def test_a_tokens_shard_that_keeps_no_sample_fails_naming_the_dataset_and_the_reasons(tmp_path):
    need_stories()
    from eagle3build.data.prepare import tokenize_shard

    conv = tmp_path / "data" / "prompts" / "00000.jsonl"
    conv.parent.mkdir(parents=True)
    write_jsonl(conv, [{"id": f"prompts:{i}", "messages": [{"role": "user", "content": "q"}]} for i in range(3)])
    tokenizer = {"path": str(STORIES), "revision": None, "trust_remote_code": False, "chat_template": TEMPLATE}
    out = tmp_path / "tokens" / "00000.safetensors"
    with pytest.raises(UserError) as e:
        tokenize_shard(str(conv), str(out), str(out.with_suffix(".json")), tokenizer, 64)
    message = str(e.value)
    assert "dataset 'prompts'" in message and "all 3 conversations were dropped" in message, message
    assert "no_assistant_turn: 3" in message and "regenerate: true" in message
    assert not out.exists()


@pytest.mark.slow
def test_the_workflow_fails_on_an_empty_dataset_next_to_a_good_one(tmp_path):
    """It passed with rc 0, training on the good dataset alone."""
    need_stories()
    wd = copy_workflow(tmp_path / "wf")
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD] * 3)
    (tmp_path / "empty.jsonl").write_text("")
    write_config(wd, config(tmp_path, datasets=[{"name": "good", "path": good},
                                                {"name": "empty", "path": str(tmp_path / "empty.jsonl")}],
                            prepare={"max_length": 64, "shard_size": 4}, vocab={"draft_vocab_size": 32}))
    proc = snakemake(wd, "--keep-going", "build/tokens/good/00000.safetensors",
                     "build/tokens/empty/00000.safetensors", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "dataset 'empty'" in out and "the source has no records" in out, out[-3000:]
    assert (wd / "build" / "tokens" / "good" / "00000.safetensors").exists()
    assert not (wd / "build" / "tokens" / "empty" / "00000.safetensors").exists()


# ------------------------------------------------------------------ evaluation sets
def test_an_empty_eval_set_is_refused_naming_its_key_before_any_model_loads(tmp_path):
    from eagle3build.evaluate import hf, vllm

    empty = tmp_path / "q.jsonl"
    empty.write_text("")
    eval_set = {"name": "heldout", "path": str(empty), "max_samples": None, "index": 2}
    target = {"path": str(tmp_path / "no-model"), "revision": None}
    for backend, params in ((hf, {}), (vllm, {"backend": "vllm"})):
        with pytest.raises(ConfigError) as e:
            backend.evaluate(str(tmp_path / "no-draft"), target, [eval_set], str(tmp_path / "e.json"),
                             str(tmp_path / "e.png"), params)
        assert e.value.key == "evaluate.sets[2]" and "'heldout'" in str(e.value) and "no question" in str(e.value)
    assert not (tmp_path / "e.json").exists()


def test_the_hf_backend_honours_a_sets_own_max_samples(tmp_path, monkeypatch):
    """evaluate.sets[].max_samples was ignored (evaluate.max_samples applied to every set)."""
    from eagle3build.evaluate import hf

    questions = write_jsonl(tmp_path / "q.jsonl", [{"question_id": i, "turns": [f"q{i}"]} for i in range(6)])
    seen = {}

    class Loaded(Exception):
        pass

    def no_model(target):
        raise Loaded

    monkeypatch.setattr(hf, "load_target_tokenizer", no_model)
    original = hf.read_questions
    monkeypatch.setattr(hf, "read_questions", lambda path, n=None: seen.setdefault(path, original(path, n)))
    sets = [{"name": "own", "path": questions, "max_samples": 2},
            {"name": "global", "path": write_jsonl(tmp_path / "g.jsonl", [{"turns": ["x"]}] * 6), "max_samples": None}]
    with pytest.raises(Loaded):
        hf.evaluate("draft", {"path": "m"}, sets, "e.json", "e.png", {"max_samples": 4})
    assert [len(seen[s["path"]]) for s in sets] == [2, 4]


def test_the_vllm_backend_honours_a_sets_own_max_samples(tmp_path):
    from test_evaluate_vllm import QUESTIONS, TARGET, fake_export, params, write_questions

    from eagle3build.evaluate.vllm import evaluate

    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS)
    result = evaluate(fake_export(tmp_path), TARGET, [{"name": "set", "path": questions, "max_samples": 1}],
                      str(tmp_path / "set.json"), str(tmp_path / "set.png"),
                      {**params(tmp_path, k=[2], baseline=False), "max_samples": 3})
    assert result["sets"]["set"]["questions"] == 1


def test_the_evaluate_rule_keeps_its_params_and_carries_a_sets_max_samples(tmp_path):
    need_stories()
    wd = copy_workflow(tmp_path / "wf")
    sets = [{"name": "a", "path": "q.jsonl"}, {"name": "b", "path": "q.jsonl", "max_samples": 3}]
    write_config(wd, config(tmp_path, evaluate={"sets": sets}))
    planned = [eval(x) for x in planned_params(wd)["evaluate"]]  # noqa: S307 (reprs of plain dicts)
    assert sorted((p["eval_set"]["name"], p["eval_set"]["max_samples"]) for p in planned) == [("a", None), ("b", 3)]
    assert all(p["settings"]["max_samples"] is None for p in planned)


# ------------------------------------------------------------------ target configs
@pytest.mark.parametrize("key", ["num_hidden_layers", "vocab_size"])
def test_a_target_config_without_a_needed_key_names_the_file_and_the_key(tmp_path, key):
    cfg = {"model_type": "llama", "num_hidden_layers": 6, "vocab_size": 128, "hidden_size": 32}
    del cfg[key]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    target = {"path": str(tmp_path), "revision": None}
    with pytest.raises(ConfigError) as e:
        resolve_aux_layer_ids(target, None)
        target_config_int(target, "vocab_size")
    assert e.value.key == "target.model"
    assert f"{tmp_path}/config.json has no '{key}'" in str(e.value), str(e.value)


def test_the_workflow_names_a_target_config_without_vocab_size(tmp_path):
    """It was a bare KeyError: 'vocab_size' from the Snakefile."""
    need_stories()
    model = tmp_path / "model"
    model.mkdir()
    cfg = json.loads((STORIES / "config.json").read_text())
    del cfg["vocab_size"]
    (model / "config.json").write_text(json.dumps(cfg))
    wd = copy_workflow(tmp_path / "wf")
    write_config(wd, config(tmp_path, target={"model": str(model), "chat_template": TEMPLATE}))
    proc = snakemake(wd, "-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "config key 'target.model'" in out and "'vocab_size'" in out, out[-3000:]


# ------------------------------------------------------------------ logging knobs do not retrain
def train_params(tmp_path: Path, name: str, **train) -> dict:
    wd = copy_workflow(tmp_path / name)
    write_config(wd, config(tmp_path, train={"epochs": 1, **train}))
    (planned,) = planned_params(wd)["train"]
    return eval(planned)["train"]  # noqa: S307 (the repr of a plain dict)


def test_logging_and_resume_point_knobs_leave_the_train_params_alone(tmp_path):
    """train.log_every (even at its default) retrained: it was part of the train rule's params."""
    need_stories()
    base = train_params(tmp_path, "base")
    assert base == {"epochs": 1, "gpus": 1}
    assert train_params(tmp_path, "logs", log_every=10, keep_checkpoints=5) == base
    # with eval_every set, checkpoint_every only places resume points
    with_eval = train_params(tmp_path, "eval", eval_every=50)
    assert train_params(tmp_path, "ckpt", eval_every=50, checkpoint_every=7) == with_eval
    # without it, checkpoint_every also places the validation steps, among which the best weights are chosen
    assert train_params(tmp_path, "ckpt-val", checkpoint_every=7) == {"epochs": 1, "checkpoint_every": 7, "gpus": 1}


def test_a_run_resumes_across_logging_knobs_and_keeps_its_identity():
    from eagle3build.train.loop import hashed_params, resolve_params

    default = hashed_params(resolve_params({"epochs": 1}), False)
    assert hashed_params(resolve_params({"epochs": 1, "log_every": 1, "keep_checkpoints": 9}), False) == default
    assert hashed_params(resolve_params({"epochs": 1, "checkpoint_every": 3}), False) != default
    assert hashed_params(resolve_params({"epochs": 1, "lr": 1e-3}), False) != default


def test_the_train_job_reads_the_logging_knobs_from_config(tmp_path):
    """Left out of the params, log_every and keep_checkpoints still reach the trainer."""
    spec = tmp_path / "train.job.json"
    named = lambda **kw: {"items": list(kw.values()), "names": kw}  # noqa: E731
    spec.write_text(json.dumps({
        "rule": "train", "input": named(hidden=["h.safetensors"], mapping="m.safetensors"),
        "output": named(weights=str(tmp_path / "train" / "draft.safetensors")),
        "params": named(train={"epochs": 1, "gpus": 0}, target={"path": "t", "revision": None}, state_dir="s"),
        "log": [str(tmp_path / "train.log")], "wildcards": {},
        "config": {"train": {"log_every": 3, "keep_checkpoints": 4, "checkpoint_every": 500, "eval_every": None}},
    }))
    stub = ("import json, sys, types\n"
            "m = types.ModuleType('eagle3build.train.launch')\n"
            f"m.launch = lambda **kw: open({str(tmp_path / 'params.json')!r}, 'w').write(json.dumps(kw['params']))\n"
            "sys.modules['eagle3build.train.launch'] = m\n"
            f"sys.argv = ['train.py', {str(spec)!r}]\n"
            f"import runpy; runpy.run_path({str(ROOT / 'scripts' / 'train.py')!r}, run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", stub], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "params.json").read_text()) == {"epochs": 1, "gpus": 0, "log_every": 3,
                                                                  "keep_checkpoints": 4}


def test_torch_is_not_needed_for_the_rule_helpers():
    """rules/train.smk imports train_progress_keys from eagle3build.config: no torch at DAG-build time."""
    proc = subprocess.run([sys.executable, "-c", "import sys; import eagle3build.config as c; "
                           "c.train_progress_keys({}); print('torch' in sys.modules)"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr
