"""Extraction (HF backend): stored states equal a direct forward; packing, fp8, servers, devices, disk."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle3build.config import resolve_section
from eagle3build.errors import UserError
from eagle3build.extraction.devices import device_slot, forget_devices, visible_devices
from eagle3build.extraction.disk import check_disk
from eagle3build.extraction.hf_server import Extractor, length_batches
from eagle3build.extraction.job import extract_shard, stop_servers
from eagle3build.extraction.plan import (
    mirrored_shards,
    pending_token_shards,
    planned_shards,
    untokenized_shards,
    write_shard_plan,
)
from eagle3build.shards import read_hidden, read_meta, write_tokens

ROOT = Path(__file__).resolve().parents[1]


def make_token_shard(path, vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    masks = [(torch.arange(n) >= n // 3).to(torch.uint8) for n in lengths]
    write_tokens(path, ids, masks, {"tokenizer": "test"})
    return ids


def reference_states(model_dir, ids, aux):
    """What the stored rows must equal: HF hidden_states[L] per aux id, and the final stream before the norm."""
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = lm(ids[None], output_hidden_states=True)
    hs = out.hidden_states
    # HF's last hidden state is post-norm; invert nothing — recompute pre-norm from the layers' output.
    n = lm.config.num_hidden_layers
    captured = {}
    lm.model.norm.register_forward_pre_hook(lambda m, a: captured.__setitem__("pre", a[0]))
    with torch.no_grad():
        lm(ids[None])
    assert torch.allclose(lm.model.norm(captured["pre"]), hs[n], atol=1e-5)  # pre-norm really is pre-norm
    return torch.stack([hs[i][0] for i in aux] + [captured["pre"][0]], dim=1)


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "stories260k"])
def test_stored_states_equal_direct_forward(model_fixture, request, tmp_path):
    model_dir = request.getfixturevalue(model_fixture)
    cfg = json.loads((model_dir / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    aux = [2, n // 2, n - 3] if n > 4 else [0, 1, 2]
    lengths = [17, 5, 40, 23, 1, 33]
    ids = make_token_shard(tmp_path / "t.safetensors", cfg["vocab_size"], lengths)
    ex = Extractor(str(model_dir), aux, "cpu", "float32")
    # A small budget forces several length-sorted, right-padded batches.
    stats = ex.extract_shard(str(tmp_path / "t.safetensors"), str(tmp_path / "h.safetensors"), "bf16", 64,
                             max_batch_size=64, progress=False)
    assert stats["tokens"] == sum(lengths)
    shard = read_hidden(tmp_path / "h.safetensors")
    assert shard.hidden.shape == (sum(lengths), 4, cfg["hidden_size"])
    assert shard.meta["layer_ids"] == aux + [n] and shard.meta["final_norm"] == "pre"
    for i, sample in enumerate(ids):
        got_ids, _, got = shard.sample(i)
        assert torch.equal(got_ids.long(), sample)
        want = reference_states(model_dir, sample, aux)
        torch.testing.assert_close(got, want.to(torch.bfloat16).float(), atol=2e-2, rtol=1e-2)


def test_fp8_halves_bytes_and_stays_close(tiny_llama, tmp_path):
    make_token_shard(tmp_path / "t.safetensors", 128, [300, 200])
    ex = Extractor(str(tiny_llama), [1, 3, 4], "cpu", "float32")
    ex.extract_shard(str(tmp_path / "t.safetensors"), str(tmp_path / "bf16.safetensors"), "bf16", 4096, 64,
                     progress=False)
    ex.extract_shard(str(tmp_path / "t.safetensors"), str(tmp_path / "fp8.safetensors"), "fp8", 4096, 64,
                     progress=False)
    b16, b8 = (os.path.getsize(tmp_path / f) for f in ("bf16.safetensors", "fp8.safetensors"))
    assert b8 < 0.6 * b16
    a, b = read_hidden(tmp_path / "bf16.safetensors").hidden, read_hidden(tmp_path / "fp8.safetensors").hidden
    rel = (a - b).norm() / a.norm()
    assert rel < 0.05, rel


def test_length_batches_respect_budget_and_cover_all():
    lengths = [5, 100, 7, 60, 60, 3, 1, 99]
    batches = length_batches(lengths, batch_tokens=128, max_batch_size=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3 and len(b) * max(lengths[i] for i in b) <= max(128, max(lengths[i] for i in b))


def test_bad_layer_id_names_config_key(tiny_llama):
    with pytest.raises(UserError, match="extract.aux_layer_ids"):
        Extractor(str(tiny_llama), [1, 2, 6], "cpu")


def test_disk_check_refuses_with_numbers(tmp_path):
    make_token_shard(tmp_path / "t.safetensors", 128, [1000])
    with pytest.raises(UserError, match=r"needs .* GB .* free"):
        check_disk(str(tmp_path / "h.safetensors"), [str(tmp_path / "t.safetensors")], 4096, "bf16", reserve_gb=1e6)
    need = check_disk(str(tmp_path / "h.safetensors"), [str(tmp_path / "t.safetensors")], 32, "bf16", 0.0)
    assert need > 0
    # The server remembers token counts per version of a file: a rewritten shard is read again.
    make_token_shard(tmp_path / "t.safetensors", 128, [1000, 1000])
    assert check_disk(str(tmp_path / "h.safetensors"), [str(tmp_path / "t.safetensors")], 32, "bf16", 0.0) == 2 * need


def test_shards_not_tokenized_yet_count_at_the_mean_of_the_tokenized(tmp_path):
    """The tokens stage runs beside extraction: a run's first extraction jobs see few token shards. The ones
    still to come count at the mean size of the others, so a run that cannot fit stops at its first job (on
    an H100, a bf16 run stopped only after extracting 18 of 56 shards)."""
    for i, n in enumerate((1000, 3000)):
        make_token_shard(tmp_path / f"t{i}.safetensors", 128, [n])
    tokens = [str(tmp_path / f"t{i}.safetensors") for i in range(2)]
    alone = check_disk(str(tmp_path / "h.safetensors"), tokens, 32, "bf16", 0.0)
    assert check_disk(str(tmp_path / "h.safetensors"), tokens, 32, "bf16", 0.0, untokenized=3) == alone * 5 // 2
    with pytest.raises(UserError, match=r"for 5 shard\(s\), 3 of them not tokenized yet and estimated"):
        check_disk(str(tmp_path / "h.safetensors"), tokens, 4096, "bf16", 1e6, untokenized=3)
    plan = [(str(tmp_path / f"t{i}.safetensors"), str(tmp_path / f"h{i}.safetensors")) for i in range(5)]
    (tmp_path / "h4.safetensors").touch()  # extracted, its tokens since deleted: not to come
    assert untokenized_shards(plan) == 2


def test_pending_shards_are_the_runs_token_shards_not_yet_extracted(tmp_path):
    run_dir = tmp_path / "run"
    tokens = [str(tmp_path / "tokens" / "d" / f"{i:05d}.safetensors") for i in range(3)]
    hidden = [str(tmp_path / "hidden" / "d" / f"{i:05d}.safetensors") for i in range(3)]
    assert planned_shards(run_dir) == []  # no plan (an API call): the disk check counts this shard alone
    write_shard_plan(run_dir, tokens, hidden)
    assert planned_shards(run_dir) == list(zip(tokens, hidden, strict=True))
    for path in (tokens[0], tokens[1], hidden[0]):  # shard 0 extracted, shard 2 not tokenized yet
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).touch()
    assert pending_token_shards(planned_shards(run_dir)) == [tokens[1]]
    assert pending_token_shards(planned_shards(run_dir), tokens[2]) == [tokens[1], tokens[2]]
    assert pending_token_shards(planned_shards(run_dir), tokens[1].replace("/tokens/", "/./tokens/")) == [tokens[1]]
    # The doctor, without a run: the token shards on disk against their hidden shards.
    assert pending_token_shards(mirrored_shards(tmp_path / "tokens", tmp_path / "hidden")) == [tokens[1]]


def _hold_slot(run_dir, devices, q, hold_s):
    with device_slot(run_dir, devices) as index:
        q.put((os.getpid(), index, time.monotonic()))
        time.sleep(hold_s)
        q.put((os.getpid(), index, time.monotonic()))


def test_device_slots_are_exclusive_across_processes(tmp_path):
    """4 concurrent jobs on 2 devices: never two on one device at once; both devices used."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_hold_slot, args=(tmp_path, ["cuda:0", "cuda:1"], q, 0.4)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    events = [q.get() for _ in range(8)]
    spans = {}
    for pid, index, t in events:
        spans.setdefault((pid, index), []).append(t)
    assert {index for _, index in spans} == {0, 1}
    for dev in (0, 1):
        intervals = sorted(v for (pid, index), v in spans.items() if index == dev)
        for (_, end), (start, _) in zip(intervals, intervals[1:], strict=False):
            assert start >= end  # the next holder starts only after the previous one released


def test_killed_holder_frees_its_slot(tmp_path):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_hold_slot, args=(tmp_path, ["cpu"], q, 60))
    p.start()
    q.get(timeout=20)
    p.kill()
    p.join()
    t0 = time.monotonic()
    with device_slot(tmp_path, ["cpu"]) as index:
        assert index == 0
    assert time.monotonic() - t0 < 5


def test_server_loads_once_and_serves_several_shards(tiny_llama, tmp_path):
    run_dir = tmp_path / "run"
    target = {"path": str(tiny_llama), "revision": None, "trust_remote_code": False, "dtype": "float32"}
    params = resolve_section("extract", {"aux_layer_ids": [1, 3, 4], "devices": ["cpu"], "storage_dtype": "bf16",
                                         "server_idle_s": 60, "batch_tokens": 8192})
    try:
        for i in range(2):
            make_token_shard(tmp_path / f"t{i}.safetensors", 128, [20, 30], seed=i)
            reply = extract_shard(str(tmp_path / f"t{i}.safetensors"), str(tmp_path / f"h{i}.safetensors"), target,
                                  params, str(run_dir))
            assert reply["ok"] and reply["tokens"] == 50
        log = (run_dir / "hf-server-0.log").read_text()
        assert log.count("extraction server ready") == 1  # loaded once for both shards
        assert read_meta(tmp_path / "h1.safetensors")["layer_ids"] == [1, 3, 4, 6]
        # Another layer set is another identity: the server is replaced, not reused.
        reply = extract_shard(str(tmp_path / "t0.safetensors"), str(tmp_path / "h2.safetensors"), target,
                              {**params, "aux_layer_ids": [0, 2, 5]}, str(run_dir))
        assert read_meta(tmp_path / "h2.safetensors")["layer_ids"] == [0, 2, 5, 6]
        # The disk check runs in the server (the job imports no torch): a refusal names the numbers and the fix,
        # writes nothing, and the server goes on serving. A shard of the run not tokenized yet counts too.
        write_shard_plan(run_dir, [str(tmp_path / "t1.safetensors"), str(tmp_path / "t9.safetensors")],
                         [str(tmp_path / "h3.safetensors"), str(tmp_path / "h9.safetensors")])
        with pytest.raises(UserError, match=r"needs .* GB for 2 shard\(s\), 1 of them not tokenized yet.* free.*fp8"):
            extract_shard(str(tmp_path / "t1.safetensors"), str(tmp_path / "h3.safetensors"), target,
                          {**params, "aux_layer_ids": [0, 2, 5], "disk_reserve_gb": 1e9}, str(run_dir))
        assert not (tmp_path / "h3.safetensors").exists()
        reply = extract_shard(str(tmp_path / "t1.safetensors"), str(tmp_path / "h3.safetensors"), target,
                              {**params, "aux_layer_ids": [0, 2, 5]}, str(run_dir))
        assert reply["ok"] and (run_dir / "hf-server-0.log").read_text().count("extraction server ready") == 2
    finally:
        assert stop_servers(run_dir) >= 1
    assert not list(run_dir.glob("hf-server-*.json"))


def test_server_start_failure_reports_log(tmp_path):
    target = {"path": str(tmp_path / "no-such-model"), "revision": None, "trust_remote_code": False, "dtype": "auto"}
    (tmp_path / "no-such-model").mkdir()
    (tmp_path / "no-such-model" / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 4}))
    make_token_shard(tmp_path / "t.safetensors", 16, [4])
    with pytest.raises(UserError, match="exited with code"):
        extract_shard(str(tmp_path / "t.safetensors"), str(tmp_path / "h.safetensors"), target,
                      resolve_section("extract", {"aux_layer_ids": [0, 1, 2], "devices": ["cpu"]}),
                      str(tmp_path / "run"))
    assert not (tmp_path / "h.safetensors").exists()


def test_shard_job_side_imports_no_torch(tmp_path):
    """A shard job is a client of the server: importing torch would idle the GPU for that long every shard."""
    code = ("import sys, eagle3build.extraction.job, eagle3build.extraction.plan as e; "
            "e.pending_token_shards(e.planned_shards('.'), 't'); "
            "assert 'torch' not in sys.modules, 'the job side imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_device_list_is_looked_up_once_per_run_and_host(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    first = visible_devices("auto", tmp_path)  # torch's answer here: ["cuda:0"] on a GPU host, ["cpu"] on CI
    (cache,) = tmp_path.glob("devices-*.json")
    assert json.loads(cache.read_text())["devices"] == [d for d in first if d != "cpu"]
    # Later jobs read the list without torch; a file for this host and these variables says what they get.
    known = json.loads(cache.read_text())
    cache.write_text(json.dumps({**known, "devices": ["cuda:0", "cuda:1"]}))
    code = ("import sys, eagle3build.extraction.devices as e; print(e.visible_devices('auto', sys.argv[1])); "
            "assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert out.strip() == "['cuda:0', 'cuda:1']"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")  # other GPUs selected: looked up again
    visible_devices("auto", tmp_path)
    assert json.loads(cache.read_text())["key"]["CUDA_VISIBLE_DEVICES"] == "1,0"
    assert visible_devices(["cuda:3", 1], tmp_path) == ["cuda:3", "cuda:1"]  # an explicit list is taken as is
    forget_devices(tmp_path)  # at the start of every run, and by stop_servers at its end
    assert not list(tmp_path.glob("devices-*.json"))
