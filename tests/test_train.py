"""The trainer: learning, exact resume after SIGKILL, fresh start on changed params, input validation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3build.errors import UserError
from eagle3build.shards import HiddenShardWriter, _cu_seqlens, read_meta
from eagle3build.train.loop import train

torch.set_num_threads(2)
ROOT = Path(__file__).resolve().parents[1]


def write_hidden_shards(
    model_dir: Path,
    out: Path,
    n_shards=2,
    samples_per_shard=6,
    seed=0,
    min_len=8,
    max_len=20,
    model_id="tiny-llama",
    storage="bf16",
) -> list[str]:
    """Real hidden states of a small HF Llama on random token sequences, as hidden shards."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n_layers = model.config.num_hidden_layers
    layer_ids = [2, n_layers // 2, n_layers - 3, n_layers]
    g = torch.Generator().manual_seed(seed)
    paths = []
    for shard in range(n_shards):
        ids, masks = [], []
        for _ in range(samples_per_shard):
            n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
            # a small alphabet makes the target's next-token distribution learnable from few samples
            ids.append(torch.randint(0, 24, (n,), generator=g))
            mask = torch.zeros(n, dtype=torch.uint8)
            mask[n // 3 :] = 1  # "assistant" tail
            masks.append(mask)
        flat_ids = torch.cat(ids)
        cu = _cu_seqlens([len(x) for x in ids])
        path = out / f"{shard:05d}.safetensors"
        with HiddenShardWriter(
            path,
            flat_ids,
            torch.cat(masks),
            cu,
            model.config.hidden_size,
            storage,
            {"model": model_id, "revision": None, "layer_ids": layer_ids},
        ) as writer:
            for i, x in enumerate(ids):
                with torch.no_grad():
                    hs = model(x[None], output_hidden_states=True).hidden_states
                # hidden_states[N] is after the final norm in HF; the pre-norm stream is what we store
                pre_norm = _pre_norm_final(model, x)
                rows = torch.stack(
                    [hs[layer_ids[0]][0], hs[layer_ids[1]][0], hs[layer_ids[2]][0], pre_norm], 1
                )
                writer.write(int(cu[i]), rows)
        paths.append(str(path))
    return paths


def _pre_norm_final(model, x):
    captured = {}
    handle = model.model.norm.register_forward_hook(lambda m, inp, out: captured.setdefault("h", inp[0]))
    with torch.no_grad():
        model(x[None])
    handle.remove()
    return captured["h"][0]


def write_mapping(path: Path, vocab: int, kept: list[int]) -> str:
    kept_t = torch.tensor(sorted(kept))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept_t] = True
    save_file({"d2t": kept_t - torch.arange(len(kept_t)), "t2d": t2d}, str(path))
    return str(path)


def sharp_llama(path: Path) -> Path:
    """A random Llama (6 layers, hidden 32, vocab 128) whose next-token distribution is peaked, mostly on
    ids < 64 (a random Llama's is nearly uniform: nothing for a draft to learn)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
        model.lm_head.weight[64:].mul_(0.1)
    model.save_pretrained(path)
    return path


def make_inputs(root: Path, **shard_kwargs) -> dict:
    target = sharp_llama(root / "target")
    (root / "hidden").mkdir()
    shards = write_hidden_shards(target, root / "hidden", **shard_kwargs)
    mapping = write_mapping(root / "mapping.safetensors", 128, list(range(64)))
    return {"shards": shards, "mapping": mapping, "target": str(target), "root": root}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("train_inputs"))


FAST = {
    "epochs": 3,
    "batch_tokens": 48,
    "ttt_steps": 3,
    "lr": 3e-3,
    "log_every": 1,
    "checkpoint_every": 4,
    "val_fraction": 0.2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
}


def run(inputs, tmp_path, **params):
    out, state = tmp_path / "out", tmp_path / "state"
    summary = train(
        inputs["shards"], inputs["mapping"], inputs["target"], str(out), str(state), {**FAST, **params}
    )
    return summary, out, state


def test_training_lowers_the_loss_and_writes_outputs(inputs, tmp_path):
    summary, out, state = run(inputs, tmp_path, epochs=8)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if x["split"] == "train"]
    val_lines = [x for x in lines if x["split"] == "val"]
    assert len(train_lines) == summary["steps"] and val_lines
    first, last = train_lines[0], train_lines[-1]
    assert last["loss"] < 0.8 * first["loss"], (first["loss"], last["loss"])
    assert len(last["step_acc"]) == 3 and last["acceptance_length"] >= 1.0
    assert val_lines[-1]["loss"] < val_lines[0]["loss"]  # held-out samples improve too
    weights = load_file(str(out / "draft.safetensors"))
    assert "fc.weight" in weights and "midlayer.self_attn.q_proj.weight" in weights
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert "embed_tokens.weight" not in weights  # frozen copy of the target's: not a trained weight
    saved = json.loads((out / "summary.json").read_text())
    best = max(val_lines, key=lambda x: x["acceptance_length"])
    assert saved["best_step"] == best["step"]
    assert read_meta(out / "draft.safetensors")["step"] == best["step"]
    assert any((out / "tb").iterdir())
    assert not list(out.glob(".*tmp"))


def test_a_frozen_lm_head_keeps_the_targets_rows_and_ships_them(inputs, tmp_path):
    """train.freeze_lm_head (speculators' default): the lm_head stays the target's draft-vocab rows (no
    gradient, no AdamW state), the rest trains, the loss still falls, and the head it writes carries the
    rows; a run with it is another run (params hash). Without trained rows to start from it is refused."""
    from eagle3build.draft.target import load_target_head
    from eagle3build.errors import ConfigError

    frozen_summary, out, state = run(inputs, tmp_path / "frozen", epochs=4, freeze_lm_head=True)
    weights = load_file(str(out / "draft.safetensors"))
    kept = torch.arange(64)  # write_mapping keeps ids < 64: d2t is all zeros
    assert torch.equal(weights["lm_head.weight"], load_target_head(inputs["target"]).lm_head[kept].float())
    checkpoint = load_file(str(sorted(state.glob("*/ckpt-*.safetensors"))[-1]))
    assert "model.lm_head.weight" not in checkpoint and "model.fc.weight" in checkpoint  # no state to keep
    assert not any("lm_head" in k for k in checkpoint if k.startswith("optim."))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert lines[-1]["loss"] < 0.8 * lines[0]["loss"]
    plain_summary, _, _ = run(inputs, tmp_path / "plain", epochs=4)
    assert plain_summary["params_hash"] != frozen_summary["params_hash"]
    with pytest.raises(ConfigError, match="train.freeze_lm_head"):
        run(inputs, tmp_path / "random", freeze_lm_head=True, init_lm_head_from_target=False)


def _final_weights(out: Path) -> dict:
    state = sorted((out.parent / "state").glob("*/ckpt-*.safetensors"))[-1]
    return {k: v for k, v in load_file(str(state)).items() if k.startswith(("model.", "optim."))}


KILL_PARAMS = {**FAST, "epochs": 8, "checkpoint_every": 2, "eval_every": 1000, "keep_checkpoints": 100}


def test_sigkill_then_resume_equals_uninterrupted_run(inputs, tmp_path):
    # uninterrupted reference
    ref_dir = tmp_path / "ref"
    summary = train(
        inputs["shards"],
        inputs["mapping"],
        inputs["target"],
        str(ref_dir / "out"),
        str(ref_dir / "state"),
        KILL_PARAMS,
    )
    total = summary["steps"]
    # the same run in a subprocess, killed with SIGKILL once a few checkpoints exist
    run_dir = tmp_path / "killed"
    script = textwrap.dedent(f"""
        import torch; torch.set_num_threads(2)
        from eagle3build.train.loop import train
        train({inputs["shards"]!r}, {inputs["mapping"]!r}, {inputs["target"]!r}, {str(run_dir / "out")!r},
              {str(run_dir / "state")!r}, {KILL_PARAMS!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list((run_dir / "state").glob("*/ckpt-*.safetensors"))) < 2:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    done = sorted((run_dir / "state").glob("*/ckpt-*.safetensors"))
    assert done and int(done[-1].stem.split("-")[1]) < total, "the run finished before it could be killed"
    assert not (run_dir / "out" / "draft.safetensors").exists()
    summary2 = train(
        inputs["shards"],
        inputs["mapping"],
        inputs["target"],
        str(run_dir / "out"),
        str(run_dir / "state"),
        KILL_PARAMS,
    )
    assert 0 < summary2["resumed_from_step"] < total
    ref, resumed = _final_weights(ref_dir / "out"), _final_weights(run_dir / "out")
    assert set(ref) == set(resumed)
    for name in ref:
        assert torch.allclose(ref[name], resumed[name], atol=1e-6, rtol=1e-6), name
    ref_lines = (ref_dir / "out" / "metrics.jsonl").read_text().splitlines()
    resumed_lines = (run_dir / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in ref_lines] == [json.loads(x)["step"] for x in resumed_lines]


def test_changed_params_start_fresh_same_params_resume(inputs, tmp_path, capfd):
    params = {**FAST, "epochs": 1}
    first, out, state = run(inputs, tmp_path, **params)
    assert first["resumed_from_step"] == 0
    again, _, _ = run(inputs, tmp_path, **params)
    assert again["resumed_from_step"] == first["steps"]  # nothing left to do: same result, no retraining
    changed, _, _ = run(inputs, tmp_path, **{**params, "lr": 1e-3})
    assert changed["resumed_from_step"] == 0 and changed["params_hash"] != first["params_hash"]
    assert "starting fresh" in capfd.readouterr().err
    assert len([x for x in state.iterdir() if x.is_dir()]) == 2  # the other run's state is kept


def test_checkpoint_of_another_run_is_refused(inputs, tmp_path):
    summary, out, state = run(inputs, tmp_path, epochs=1)
    ckpt = sorted((state / summary["params_hash"]).glob("ckpt-*.safetensors"))[-1]
    other = {**FAST, "epochs": 1, "lr": 5e-4}
    from eagle3build.train.checkpoint import params_hash  # noqa: F401
    from eagle3build.train.loop import resolve_params  # noqa: F401

    # place the checkpoint where a run with other params looks for its state
    first = train(
        inputs["shards"],
        inputs["mapping"],
        inputs["target"],
        str(tmp_path / "o2"),
        str(tmp_path / "s2"),
        {**other, "max_steps": 1},
    )
    target_dir = tmp_path / "s2" / first["params_hash"]
    for old in target_dir.glob("ckpt-*"):
        old.unlink()
    (target_dir / "ckpt-99999999.safetensors").write_bytes(ckpt.read_bytes())
    with pytest.raises(UserError, match=r"ckpt-99999999.*params hash"):
        train(
            inputs["shards"],
            inputs["mapping"],
            inputs["target"],
            str(tmp_path / "o2"),
            str(tmp_path / "s2"),
            {**other, "max_steps": 1},
        )


def test_bad_inputs_raise_user_errors_naming_the_file(inputs, tmp_path):
    shards, mapping, target = inputs["shards"], inputs["mapping"], inputs["target"]
    root = tmp_path

    def expect(match, hidden=shards, mapping_path=mapping, target_path=target, params=None):
        with pytest.raises(UserError, match=match):
            train(
                hidden,
                mapping_path,
                target_path,
                str(root / "o"),
                str(root / "s"),
                {**FAST, **(params or {})},
            )

    # a shard from another model (other model id / layer ids)
    (root / "other").mkdir()
    odd = write_hidden_shards(
        Path(target), root / "other", n_shards=1, samples_per_shard=2, model_id="someone-else"
    )
    expect(r"other/00000.safetensors: model 'someone-else' differs", hidden=[shards[0], odd[0]])
    # mapping for another vocab size
    bad_map = write_mapping(root / "map200.safetensors", 200, list(range(10)))
    expect(r"map200.safetensors: t2d covers 200 ids but the target's vocab_size is 128", mapping_path=bad_map)
    # corrupted shard (truncated)
    broken = root / "broken.safetensors"
    broken.write_bytes(Path(shards[0]).read_bytes()[:5000])
    expect(r"broken.safetensors", hidden=[str(broken)])
    # no trainable sample (all loss masks zero)
    empty_dir = root / "empty"
    empty_dir.mkdir()
    ids = torch.randint(0, 24, (10,))
    path = empty_dir / "00000.safetensors"
    with HiddenShardWriter(
        path,
        ids,
        torch.zeros(10, dtype=torch.uint8),
        _cu_seqlens([10]),
        32,
        "bf16",
        {"model": "tiny-llama", "revision": None, "layer_ids": [2, 3, 3, 6]},
    ) as w:
        w.write(0, torch.randn(10, 4, 32))
    expect(r"no sample .* has an assistant token", hidden=[str(path)])
    # a target of another width
    from transformers import LlamaConfig, LlamaForCausalLM

    wide = root / "wide"
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        )
    ).save_pretrained(wide)
    expect(r"00000.safetensors: hidden_size 32 != the target's 48", target_path=str(wide))
    expect(r"train.nonsense", params={"nonsense": 1})
    assert not (root / "o" / "draft.safetensors").exists()


def test_fp8_states_travel_as_stored_and_are_dequantized_on_the_device(inputs, tmp_path):
    """The host reads fp8 rows as stored (a workflow job has one CPU thread, and dequantizing there could
    outlast the step) and `to` dequantizes them after the copy: the batch the step sees is exactly the
    host-dequantized one, padding included."""
    from eagle3build.train.data import BatchLoader, HiddenDataset
    from eagle3build.ttt.batch import pack, pad_batch

    (tmp_path / "h").mkdir()
    paths = write_hidden_shards(Path(inputs["target"]), tmp_path / "h", n_shards=1, storage="fp8")
    data = HiddenDataset(paths, 48)
    loader = BatchLoader(data, None, torch.device("cpu"), torch.float32, 3, True, 48)
    ids = [0, 1, 2]
    host = loader.load(ids)
    assert host.aux.dtype == host.final.dtype == torch.float8_e4m3fn
    assert host.aux_scale.shape == (host.num_tokens, 3) and host.final_scale.shape == (host.num_tokens,)
    moved = host.to("cpu", torch.float32)
    assert moved.aux_scale is None and moved.final_scale is None and moved.aux.dtype == torch.float32
    expected = pad_batch(pack([data.load(data.samples[i], torch.float32) for i in ids]), loader.length_multiple)
    assert host.num_tokens == expected.num_tokens > sum(data.lengths[i] for i in ids)  # padded
    assert torch.equal(moved.aux, expected.aux) and torch.equal(moved.final, expected.final)
    assert torch.equal(moved.loss_rows, host.loss_rows) and torch.equal(moved.input_ids, expected.input_ids)


def test_deterministic_on_cpu(inputs, tmp_path):
    a, out_a, _ = run(inputs, tmp_path / "a", epochs=1)
    b, out_b, _ = run(inputs, tmp_path / "b", epochs=1)
    wa, wb = load_file(str(out_a / "draft.safetensors")), load_file(str(out_b / "draft.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert os.path.getsize(out_a / "metrics.jsonl") > 0


def test_compiled_runs_pad_batches_on_the_host_and_train_the_same(inputs, tmp_path, monkeypatch):
    """A compiled run pads each batch to a length bucket while loading it: the padding adds no loss.

    torch.compile is replaced by the identity, so this runs the compiled run's batch path on CPU fast.
    """
    from eagle3build import compilation
    from eagle3build.ttt.batch import PackedBatch

    eager, out_e, _ = run(inputs, tmp_path / "eager", epochs=2)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(compilation, "COMPILED", {})
    padded_lengths = []
    to = PackedBatch.to
    monkeypatch.setattr(PackedBatch, "to", lambda self, *a, **kw: padded_lengths.append(self.num_tokens) or to(self, *a, **kw))
    compiled, out_c, _ = run(inputs, tmp_path / "compiled", epochs=2, compile=True)
    assert padded_lengths and all(n % 1024 == 0 for n in padded_lengths)  # padded before the device copy

    def losses(out):
        return [(x["step"], x["split"], x["loss"]) for x in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]

    for (step_e, split_e, loss_e), (step_c, split_c, loss_c) in zip(losses(out_e), losses(out_c), strict=True):
        assert (step_e, split_e) == (step_c, split_c)
        assert loss_c == pytest.approx(loss_e, rel=1e-4)


def test_validation_runs_the_training_steps_kernels_and_takes_no_gradient(inputs, tmp_path, monkeypatch):
    """Validation calls the TTT forward with gradients enabled: compiled kernels are guarded on the grad mode,
    so under no_grad each would compile again for every batch length. Its numbers are a no_grad pass's, and
    no parameter gets a gradient from it."""
    from eagle3build.train import loop

    calls = []
    forward = loop.ttt_forward

    def spy(model, *args, **kwargs):
        with torch.no_grad():
            reference = forward(model, *args, **kwargs)
        stats = forward(model, *args, **kwargs)
        calls.append(torch.is_grad_enabled())
        assert torch.equal(stats.loss_sum.detach(), reference.loss_sum)
        assert torch.equal(stats.correct, reference.correct) and torch.equal(stats.count, reference.count)
        return stats

    evaluate = loop.evaluate

    def evaluate_spy(ttt, *args, **kwargs):
        for p in ttt.parameters():
            p.grad = None  # the optimizer step before zeroes them to None as well
        result = evaluate(ttt, *args, **kwargs)
        assert all(p.grad is None for p in ttt.parameters())
        return result

    monkeypatch.setattr(loop, "ttt_forward", spy)
    monkeypatch.setattr(loop, "evaluate", evaluate_spy)
    run(inputs, tmp_path, epochs=1)
    assert calls and all(calls)


def _clip_problem(scale: float, fused: bool):
    """Three parameters with fixed gradients (global norm ≈ 4.3 * scale) and an AdamW over them."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((7, 5), (5,), (3, 3))]
    for q in params:
        q.grad = torch.randn(q.shape, generator=g) * scale
    return params, torch.optim.AdamW(params, lr=0.1, eps=1e-3, weight_decay=0.01, fused=fused)


@pytest.mark.parametrize("scale", [1.0, 0.01])  # the clip active (norm > 0.5) and not
def test_clipped_step_folds_the_clip_into_fused_adamw(scale, monkeypatch):
    """With a fused AdamW the clip coefficient rides in the optimizer's pass (grad_scale): the same
    update and norm as clip_grad_norm_ + step, without clip_grad_norm_'s own pass over the gradients."""
    from eagle3build.train import optim

    reference, optimizer = _clip_problem(scale, fused=False)
    norm_ref = torch.nn.utils.clip_grad_norm_(reference, 0.5)
    optimizer.step()

    params, optimizer = _clip_problem(scale, fused=True)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: pytest.fail("clipped in a separate pass"))
    norm = optim.clipped_step(optimizer, params, 0.5)
    assert float(norm) == pytest.approx(float(norm_ref), rel=1e-6)
    assert float(optimizer.grad_scale) == pytest.approx(max(1.0, float(norm_ref) / 0.5), rel=1e-5)
    for q, r in zip(params, reference, strict=True):
        torch.testing.assert_close(q, r, rtol=1e-5, atol=1e-6)
    moved = max(float((q - r).detach().abs().max()) for q, r in zip(params, _clip_problem(scale, False)[0], strict=True))
    assert moved > 1e-3  # the step did update the weights


def test_clipped_step_clips_the_usual_way_where_adamw_ignores_grad_scale(monkeypatch):
    """A torch whose fused AdamW stopped reading grad_scale would clip nothing silently: the one-time
    check sees it and the step clips with clip_grad_norm_ instead."""
    from eagle3build.train import optim

    reference, optimizer = _clip_problem(1.0, fused=False)
    torch.nn.utils.clip_grad_norm_(reference, 0.5)
    optimizer.step()

    step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: (self.__dict__.pop("grad_scale", None), step(self, *a, **k))[1])
    monkeypatch.setattr(optim, "_GRAD_SCALE_READ", {})
    assert not optim.fused_adamw_reads_grad_scale(torch.device("cpu"))
    params, optimizer = _clip_problem(1.0, fused=True)
    optim.clipped_step(optimizer, params, 0.5)
    for q, r in zip(params, reference, strict=True):
        torch.testing.assert_close(q, r, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    monkeypatch.setattr(optim, "_GRAD_SCALE_READ", {})
    assert optim.fused_adamw_reads_grad_scale(torch.device("cpu"))


def test_memory_switches_train_the_same_weights_and_keep_the_run(inputs, tmp_path):
    """train.activation_checkpointing (the same bits) and train.loss_chunk_tokens (fp32 rounding) train the
    plain run's weights, under the plain run's identity."""
    plain, out_a, _ = run(inputs, tmp_path / "a", epochs=1)
    switched, out_b, _ = run(inputs, tmp_path / "b", epochs=1, activation_checkpointing=True, loss_chunk_tokens=7)
    assert switched["params_hash"] == plain["params_hash"]
    wa, wb = load_file(str(out_a / "draft.safetensors")), load_file(str(out_b / "draft.safetensors"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6, msg=k)
