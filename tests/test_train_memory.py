"""The step's memory estimate as training uses it (eagle3build/train/memory.py): the note logged before
the first step, and the switches it proposes when a configured step would not fit its device."""

from __future__ import annotations

import re

from eagle3build.draft.model import DraftConfig
from eagle3build.train.loop import resolve_params
from eagle3build.train.memory import FIT_SHARE, fitting_switches, memory_estimate, memory_note, shape_of

# Kimi-K2.5's width and vocab with peer-train-bench's GQA layer (the shape of BENCHMARKS §2's measured peaks)
KIMI = DraftConfig(hidden_size=7168, num_attention_heads=56, num_key_value_heads=8, head_dim=128,
                   intermediate_size=18432, rms_norm_eps=1e-6, rope_theta=50000.0, max_position_embeddings=131072,
                   vocab_size=163840, draft_vocab_size=32000, target_hidden_size=7168)
H100_GIB = 79.2


def test_a_step_that_fits_is_noted_without_advice():
    note = memory_note(KIMI, resolve_params({"batch_tokens": 8192}), H100_GIB)
    assert "estimated peak of a step 38.3 GiB at train.batch_tokens 8192" in note  # measured 38.6 (H100); 39.3 with the merge's stacks
    assert "may run out" not in note


def test_a_step_that_would_not_fit_names_the_cheapest_keys_that_do():
    note = memory_note(KIMI, resolve_params({"batch_tokens": 24576}), H100_GIB)
    # one or two checkpointed steps cost less recomputation than the chunked loss at this shape; where they
    # do not suffice, the chunked loss does (three steps would cost more than it)
    assert "may run out of memory; set train.activation_checkpointing: 1 (estimate 71.2 GiB" in note, note
    note = memory_note(KIMI, resolve_params({"batch_tokens": 24576}), 76.0)
    assert "may run out of memory; set train.activation_checkpointing: 2 (estimate 68.2 GiB" in note, note
    note = memory_note(KIMI, resolve_params({"batch_tokens": 24576}), 72.0)
    assert "set train.loss_chunk_tokens: 2048 (estimate 55.4 GiB" in note, note
    note = memory_note(KIMI, resolve_params({"batch_tokens": 32768}), H100_GIB)
    assert "set train.loss_chunk_tokens: 2048 (estimate 66.4 GiB" in note, note
    note = memory_note(KIMI, resolve_params({"batch_tokens": 262144}), H100_GIB)
    assert note.endswith("may run out of memory; lower train.batch_tokens")


def test_ddp_counts_its_gradient_buckets_in_the_note_and_the_advice():
    p = resolve_params({"batch_tokens": 16384})
    alone, ddp = (float(re.search(r"step ([\d.]+) GiB", memory_note(KIMI, p, H100_GIB, n)).group(1))
                  for n in (1, 2))  # one process; two with DDP (train.fsdp off)
    assert 3.5 < ddp - alone < 3.7  # 4 bytes x 963M trainable weights (the lm_head's 229M included)
    note = memory_note(KIMI, p, 64.0, world_size=2)
    est = float(re.search(r"\(estimate ([\d.]+) GiB", note).group(1))
    assert est <= FIT_SHARE * 64.0


def test_the_proposed_switches_fit_and_more_recomputation_never_costs_memory():
    shape = shape_of(KIMI)
    for T in (16384, 24576, 32768, 65536):
        fit = fitting_switches(shape, T, 7, 70.0)
        assert fit is not None and fit["estimate_gib"] <= 70.0
        estimates = [memory_estimate(shape, T, 7, 1.0, n)["total"] for n in range(7)]
        assert estimates == sorted(estimates, reverse=True)  # each checkpointed step saves memory
        assert memory_estimate(shape, T, 7, 1.0, True)["total"] >= estimates[6]  # the last step's saves nothing


def test_fsdp_holds_a_shard_of_the_trained_weights_state_not_of_the_frozen_ones():
    shape = shape_of(KIMI)
    whole, sharded = (memory_estimate(shape, 8192, 7, weight_shards=n)["static"] for n in (1, 8))
    frozen = (4 * 163840 * 7168 + 2 * (163840 + 32000) * 7168) / 2**30  # embedding fp32, target head bf16
    assert abs((whole - frozen) / 8 - (sharded - frozen)) < 0.02
    p = resolve_params({"batch_tokens": 24576})
    assert "may run out" in memory_note(KIMI, p, H100_GIB)
    assert "may run out" in memory_note(KIMI, p, H100_GIB, world_size=8)  # DDP: whole state on each
    assert "may run out" not in memory_note(KIMI, {**p, "fsdp": True}, H100_GIB, world_size=8)


def test_the_runs_peaks_go_to_the_log_and_the_summary(monkeypatch, capsys):
    import torch

    from eagle3build.train.distributed import Dist
    from eagle3build.train.loop import gpu_memory_peaks

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 39.31 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 44.0 * 2**30)
    d = Dist(rank=0, local_rank=0, world_size=1)
    assert gpu_memory_peaks(torch.device("cpu"), d) == {"peak_memory_gib": 39.31, "peak_reserved_gib": 44.0}
    assert "peak GPU memory 39.31 GiB allocated, 44.0 GiB reserved" in capsys.readouterr().err


def test_a_norm_before_fc_adds_what_its_backward_keeps_of_the_aux_states():
    """12 H bytes per token (the Kimi config trains norm_before_fc): 0.66 GiB at the Kimi width and T = 8192."""
    import dataclasses

    plain, normed = shape_of(KIMI), shape_of(dataclasses.replace(KIMI, norm_before_fc=True))
    assert normed["aux_norm"] and not plain["aux_norm"]
    for T in (4096, 8192):
        extra = memory_estimate(normed, T, 7)["data"] - memory_estimate(plain, T, 7)["data"]
        assert abs(extra - 12 * 7168 * T / 2**30) < 0.011


def test_backward_holds_every_steps_key_value_gradients_which_an_mha_draft_feels_most():
    """Backward accumulates the gradients of the keys and values that later steps read (step 0's at every
    token, each diagonal's at its rows) from the last step's backward until each step's own. At the MHA
    draft Kimi's config derives (64 KV heads x 112) they outweigh what a step's rows keep: with both switches
    it ran out of memory on an H100 (79.2 GiB) at 49,152 tokens and peaked at 70.7 GiB at 40,960
    (bench/results/train_throughput_kimi_derived.json); the estimate without them was 69.8 and 62.2."""
    import dataclasses

    derived = dataclasses.replace(KIMI, num_attention_heads=64, num_key_value_heads=64, head_dim=112,
                                  norm_before_fc=True)
    gqa, mha = shape_of(KIMI), shape_of(derived)
    p = resolve_params({"batch_tokens": 40960, "activation_checkpointing": True, "loss_chunk_tokens": 2048})
    assert "may run out" not in memory_note(derived, p, H100_GIB)
    assert "may run out" in memory_note(derived, {**p, "batch_tokens": 49152}, H100_GIB)
    for T in (8192, 40960):  # all steps checkpointed: backward recomputes step 6 beside the k/v gradients
        both = [memory_estimate(shape, T, 7, 1.0, True, 2048)["layers"] for shape in (gqa, mha)]
        kept = 7 * T * 2 * (7168 + 2 * 64 * 112) + T * (2 * (2 * 7168 + 64 * 112 + 2 * 18432) + 2 * 4 * 64 * 112
                                                        + 4 * 64)
        assert abs(both[1] - (kept + 7 * T * 4 * 64 * 112) / 2**30) < 0.011, (T, both)
        assert both[1] - both[0] > T * 7 * 4 * (64 * 112 - 8 * 128) / 2**30  # the gradients grow with kv width


def test_ddp_that_no_switch_fits_is_told_to_shard_with_fsdp():
    """The derived Kimi head at 65,536 tokens on the 8 x 96 GB host: no switch makes DDP's step fit (97.1 GiB
    with both, its gradient buckets besides), FSDP's shards with five checkpointed steps and the chunked loss
    do; one process, or a batch nothing fits, is still told to lower train.batch_tokens."""
    import dataclasses

    derived = dataclasses.replace(KIMI, num_attention_heads=64, num_key_value_heads=64, head_dim=112,
                                  norm_before_fc=True)
    p = resolve_params({"batch_tokens": 65536})
    note = memory_note(derived, p, 95.6, world_size=8)
    assert "set train.fsdp: true, train.activation_checkpointing: 5, train.loss_chunk_tokens: 2048 (estimate 81.6" in note
    assert "sharded over the processes and some recomputation in backward" in note
    est = float(re.search(r"\(estimate ([\d.]+) GiB", note).group(1))
    assert est <= FIT_SHARE * 95.6
    assert note.endswith("or lower train.batch_tokens")
    assert memory_note(derived, p, 95.6).endswith("may run out of memory; lower train.batch_tokens")
    assert "train.fsdp" not in memory_note(derived, {**p, "batch_tokens": 32768}, 95.6, world_size=8)
    assert memory_note(derived, {**p, "batch_tokens": 131072}, 95.6, world_size=8).endswith(
        "may run out of memory; lower train.batch_tokens")
