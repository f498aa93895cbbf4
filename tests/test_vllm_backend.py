"""The vLLM backend against tests/fake_vllm_server.py: command, lifecycle, sharing, retries, conversion."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from eagle3build.engine import process
from eagle3build.errors import ConfigError, UserError
from eagle3build.extraction import vllm as vllm_backend
from eagle3build.extraction.plan import write_shard_plan
from eagle3build.extraction.vllm import VllmServer, build_command, extract_shard_vllm, stop_servers
from eagle3build.shards import read_hidden, read_tokens, write_tokens

sys.path.insert(0, str(Path(__file__).parent))
import fake_vllm_server  # noqa: E402

torch.set_num_threads(1)
FAKE = str(Path(__file__).with_name("fake_vllm_server.py"))
REPO = Path(__file__).resolve().parents[1]
HIDDEN = 16
LAYER_IDS = [2, 4, 5, 8]


def expected_hidden(token_ids) -> torch.Tensor:
    """What the fake server sends for these ids: its float32 values rounded to bf16, as float32."""
    values = fake_vllm_server.expected_hidden(token_ids.numpy(), LAYER_IDS, HIDDEN)
    return torch.from_numpy(values).to(torch.bfloat16).float()


def make_params(run_dir: Path, **vllm_overrides) -> dict:
    env = {"FAKE_VLLM_HIDDEN_SIZE": str(HIDDEN), "FAKE_VLLM_CONTROL": str(run_dir / "control.json")}
    env.update(vllm_overrides.pop("env", {}))
    vllm = {
        "executable": [sys.executable, FAKE],
        "env": env,
        "startup_timeout_s": 30,
        "request_timeout_s": 10,
        "idle_timeout_s": 600,
        "concurrency": 3,
        "retries": 2,
        **vllm_overrides,
    }
    return {
        "model": "org/fake-target",
        "revision": None,
        "trust_remote_code": False,
        "layer_ids": list(LAYER_IDS),
        "hidden_size": HIDDEN,
        "storage_dtype": "bf16",
        "image": "vllm/vllm-openai:v0-test@sha256:abc",
        "vllm": vllm,
    }


def set_fault(run_dir: Path, fault: str | None, count: int = -1) -> None:
    (run_dir / "control.json").write_text(json.dumps({"fault": fault, "remaining": count}))


def make_token_shard(path: Path, lengths=(5, 17, 1, 33, 9), seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32) for n in lengths]
    masks = [torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8) for n in lengths]
    write_tokens(path, ids, masks, {"dataset": "t"})


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    yield d
    stop_servers(d)


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """One healthy fake server reused by the tests that only vary the injected faults."""
    d = tmp_path_factory.mktemp("shared") / "run"
    d.mkdir()
    yield d
    stop_servers(d)


def _server_state(run_dir: Path):
    return VllmServer(run_dir, make_params(run_dir)).read_state()


def _alive(pid: int) -> bool:
    return process.start_ticks(pid) is not None


def _wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def _worker_pid(log: Path) -> int:
    lines = [ln for ln in log.read_text().splitlines() if "worker pid" in ln]
    return int(lines[-1].split()[-1])


# ---------------------------------------------------------------- command line
def test_command_has_the_extraction_flags_and_no_shell(tmp_path):
    params = make_params(tmp_path, tensor_parallel_size=8, max_model_len=4096, extra_args=["--enforce-eager"])
    params["vllm"]["executable"] = "vllm"
    cmd = build_command(params, 1234, "/dev/shm/hs")
    assert cmd[:3] == ["vllm", "serve", "org/fake-target"]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "8"
    assert cmd[cmd.index("--max-model-len") + 1] == "4096"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[-1] == "--enforce-eager"
    # Chunked prefill stays on: turning it off may give wrong outputs and sizes the step to max_model_len.
    assert not any("chunked-prefill" in arg for arg in cmd)
    assert "--trust-remote-code" not in cmd and "--revision" not in cmd
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "ExampleHiddenStatesConnector" and kv["kv_role"] == "kv_producer"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == "/dev/shm/hs"

    params.update(trust_remote_code=True, revision="a" * 40)
    cmd = build_command(params, 1234, "/x")
    assert "--trust-remote-code" in cmd
    for flag in ("--revision", "--code-revision", "--tokenizer-revision"):
        assert cmd[cmd.index(flag) + 1] == "a" * 40
    params["trust_remote_code"] = "yes"  # only a real `true` grants remote code
    assert "--trust-remote-code" not in build_command(params, 1, "/x")


def test_workflow_params_read_n_and_h_from_the_target_config(tmp_path):
    model = tmp_path / "target"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": HIDDEN}))
    params = make_params(tmp_path)
    for key in ("model", "revision", "trust_remote_code", "layer_ids", "hidden_size"):
        del params[key]
    params.update(
        target={"path": str(model), "revision": None, "trust_remote_code": False}, aux_layer_ids=[2, 4, 5]
    )
    resolved = vllm_backend.resolve_params(params)
    assert resolved["layer_ids"] == LAYER_IDS and resolved["hidden_size"] == HIDDEN
    cmd = build_command(params, 1, "/x")
    assert resolved["model"] == str(model) and cmd[cmd.index("serve") + 1] == str(model)


def test_max_model_len_is_derived_from_prepare_max_length(tmp_path):
    """Not the model's own limit (Kimi-K2.5: 262,144): the longest sample plus the generated token."""
    params = make_params(tmp_path)
    params["vllm"]["executable"] = "vllm"
    params["max_length"] = 4096
    cmd = build_command(params, 1, "/x")
    assert cmd[cmd.index("--max-model-len") + 1] == "4097"
    del params["max_length"]  # not given: the schema's prepare.max_length (2048)
    cmd = build_command(params, 1, "/x")
    assert cmd[cmd.index("--max-model-len") + 1] == "2049"
    params.update(max_length=4096, vllm={**params["vllm"], "max_model_len": 8192})  # more is allowed
    cmd = build_command(params, 1, "/x")
    assert cmd[cmd.index("--max-model-len") + 1] == "8192"
    params["vllm"]["max_model_len"] = 4096  # no room for the generated token
    with pytest.raises(ConfigError, match=r"extract\.vllm\.max_model_len.*>= 4097"):
        build_command(params, 1, "/x")


def test_an_old_config_with_allow_mla_still_works_and_is_told_to_drop_it(tmp_path):
    from eagle3build.config import RemovedKeyWarning

    params = make_params(tmp_path, allow_mla=True)
    with pytest.warns(RemovedKeyWarning, match=r"extract\.vllm\.allow_mla.*no longer needed.*Delete it"):
        cmd = build_command(params, 1, "/x")
    assert params["vllm"]["allow_mla"] is True  # the caller's dict is left alone
    assert "allow_mla" not in " ".join(cmd)


def test_a_workflow_config_with_allow_mla_loads_without_it(tmp_path):
    import yaml

    from eagle3build.config import RemovedKeyWarning, load_config

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "target": {"model": "org/m"}, "datasets": [{"name": "d", "path": "d.jsonl"}],
        "extract": {"backend": "vllm", "vllm": {"allow_mla": True, "tensor_parallel_size": 8}},
    }))
    with pytest.warns(RemovedKeyWarning, match="extract.vllm.allow_mla"):
        config = load_config(path)
    assert config["extract"]["vllm"]["tensor_parallel_size"] == 8 and "allow_mla" not in config["extract"]["vllm"]
    path.write_text(path.read_text().replace("allow_mla", "allow_mlaa"))  # a typo is still an error
    with pytest.raises(ConfigError, match="extract.vllm"):
        load_config(path)


def write_target(tmp_path: Path, config: dict) -> Path:
    model = tmp_path / "target"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    return model


def workflow_params(tmp_path: Path, model: Path, aux: list[int]) -> dict:
    params = make_params(tmp_path)
    for key in ("model", "revision", "trust_remote_code", "layer_ids", "hidden_size"):
        del params[key]
    params.update(target={"path": str(model), "revision": None, "trust_remote_code": False}, aux_layer_ids=aux)
    return params


DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 8,
               "hidden_size": HIDDEN, "kv_lora_rank": 16}
KIMI_K25 = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": {"model_type": "deepseek_v3", "num_hidden_layers": 8, "hidden_size": HIDDEN}}


@pytest.mark.parametrize("config", [DEEPSEEK_V3, KIMI_K25], ids=["deepseek_v3", "kimi_k25"])
def test_aux_ids_vllm_cannot_capture_are_refused_before_a_server_starts(tmp_path, config):
    model = write_target(tmp_path, config)
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"extract\.aux_layer_ids.*layer 0.*DeepSeek.*>= 1"):
        VllmServer(run_dir, workflow_params(tmp_path, model, [0, 3, 5]))
    with pytest.raises(ConfigError, match=r"extract\.aux_layer_ids.*repeats a layer"):
        VllmServer(run_dir, workflow_params(tmp_path, model, [2, 4, 4]))
    assert not (run_dir / "vllm").exists()  # nothing was started
    # An MLA target with ids vLLM captures is served: no refusal for the architecture.
    cmd = build_command(workflow_params(tmp_path, model, [1, 4, 5]), 1, "/x")
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 4, 5, 8]


def test_layer_0_is_fine_on_other_targets_but_repeats_never_are(tmp_path):
    model = write_target(tmp_path, {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                    "num_hidden_layers": 8, "hidden_size": HIDDEN})
    assert vllm_backend.resolve_params(workflow_params(tmp_path, model, [0, 4, 5]))["layer_ids"] == [0, 4, 5, 8]
    flat = make_params(tmp_path)
    flat["layer_ids"] = [2, 2, 5, 8]
    with pytest.raises(ConfigError, match=r"extract\.aux_layer_ids.*repeat"):
        build_command(flat, 1, "/x")


@pytest.mark.parametrize(
    "override, key",
    [
        ({"extra_args": "--enforce-eager"}, "extra_args"),
        ({"concurrency": 0}, "concurrency"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_server_config_names_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError, match=f"extract.vllm.{key}"):
        build_command(make_params(tmp_path, **override), 1, "/x")


# ---------------------------------------------------------------- conversion
@pytest.mark.parametrize("storage_dtype", ["bf16", "fp8"])
def test_extract_writes_the_hidden_shard_format(shared_run, tmp_path, storage_dtype):
    set_fault(shared_run, None)
    tokens, out = tmp_path / "00000.safetensors", tmp_path / "hidden" / "00000.safetensors"
    make_token_shard(tokens)
    params = make_params(shared_run)
    params["storage_dtype"] = storage_dtype
    extract_shard_vllm(str(tokens), str(out), params, str(shared_run))

    src, got = read_tokens(tokens), read_hidden(out)
    assert torch.equal(got.input_ids, src.input_ids) and torch.equal(got.loss_mask, src.loss_mask)
    assert torch.equal(got.cu_seqlens, src.cu_seqlens)
    assert got.hidden.shape == (src.input_ids.numel(), 4, HIDDEN)
    for i in range(src.num_samples):
        ids, _ = src.sample(i)
        want = expected_hidden(ids)
        if storage_dtype == "bf16":
            assert torch.equal(got.sample(i)[2], want)
        else:  # e4m3 with one scale per (token, slot) row: ~2^-4 relative error
            torch.testing.assert_close(got.sample(i)[2], want, atol=0.07, rtol=0.07)
    assert got.meta["layer_ids"] == LAYER_IDS and got.meta["backend"] == "vllm"
    assert got.meta["model"] == "org/fake-target" and got.meta["image"] == params["image"]
    assert got.meta["storage_dtype"] == storage_dtype and got.meta["format"] == "eagle3build.hidden"
    connector = VllmServer(shared_run, params).storage_path
    assert list(connector.iterdir()) == []  # every connector file and lock was deleted


def test_the_run_wide_disk_check_refuses_before_any_request(tmp_path):
    """As the HF backend: the disk must hold this shard and the run's others not yet extracted (those not
    tokenized yet at the tokenized ones' mean), checked before the job starts or asks a server anything."""
    run_dir = tmp_path / "run"
    tokens = [tmp_path / "tokens" / f"{i}.safetensors" for i in range(3)]
    tokens[0].parent.mkdir()
    make_token_shard(tokens[0], lengths=(4, 6, 8))
    write_shard_plan(run_dir, [str(t) for t in tokens], [str(tmp_path / "hidden" / t.name) for t in tokens])
    params = {**make_params(run_dir), "disk_reserve_gb": 1e6}
    with pytest.raises(UserError, match=r"extraction needs .* for 3 shard\(s\), 2 of them not tokenized yet"):
        extract_shard_vllm(str(tokens[0]), str(tmp_path / "hidden" / "0.safetensors"), params, str(run_dir))
    assert not VllmServer(run_dir, params).state_path.exists()  # no server was started


def test_transient_faults_are_retried(shared_run, tmp_path):
    set_fault(shared_run, "corrupt", 2)
    tokens, out = tmp_path / "t.safetensors", tmp_path / "h.safetensors"
    make_token_shard(tokens, lengths=(4, 6, 8))
    extract_shard_vllm(str(tokens), str(out), make_params(shared_run), str(shared_run))
    assert json.loads((shared_run / "control.json").read_text())["remaining"] == 0
    assert read_hidden(out).hidden.isfinite().all()


@pytest.mark.parametrize(
    "fault, message",
    [
        ("corrupt", "unreadable connector file"),
        ("wrong_ids", "other token ids"),
        ("nan", "non-finite"),
        ("bad_shape", "expected \\[T, n_ids, H\\]"),
        ("http500", "HTTP 500"),
        ("no_params", "hidden_states_path"),
    ],
)
def test_persistent_faults_fail_naming_the_sample(shared_run, tmp_path, fault, message):
    set_fault(shared_run, fault)
    tokens, out = tmp_path / "t.safetensors", tmp_path / "h.safetensors"
    make_token_shard(tokens, lengths=(7,))
    params = make_params(shared_run, retries=1)
    with pytest.raises(UserError, match=f"sample 0 \\(7 tokens\\).*2 attempts.*{message}"):
        extract_shard_vllm(str(tokens), str(out), params, str(shared_run))
    assert not out.exists() and not list(tmp_path.glob(".h.safetensors*"))  # no partial output
    set_fault(shared_run, None)


def test_a_file_outside_the_connector_folder_is_neither_read_nor_deleted(shared_run, tmp_path):
    set_fault(shared_run, "outside_path")
    tokens, out = tmp_path / "t.safetensors", tmp_path / "h.safetensors"
    make_token_shard(tokens, lengths=(3,))
    with pytest.raises(UserError, match="outside"):
        extract_shard_vllm(str(tokens), str(out), make_params(shared_run, retries=0), str(shared_run))
    storage = VllmServer(shared_run, make_params(shared_run)).storage_path
    deadline = time.monotonic() + 5  # the fake writes it just after answering
    while not list(storage.parent.glob("cmpl-*.safetensors")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    assert list(storage.parent.glob("cmpl-*.safetensors"))  # left alone
    set_fault(shared_run, None)


def test_a_hanging_request_times_out(shared_run, tmp_path):
    set_fault(shared_run, "hang", 1)
    tokens, out = tmp_path / "t.safetensors", tmp_path / "h.safetensors"
    make_token_shard(tokens, lengths=(3,))
    with pytest.raises(UserError, match="timed out"):
        extract_shard_vllm(
            str(tokens), str(out), make_params(shared_run, retries=0, request_timeout_s=1), str(shared_run)
        )


def test_a_rejected_prompt_is_not_retried_and_names_max_model_len(run_dir, tmp_path):
    tokens, out = tmp_path / "t.safetensors", tmp_path / "h.safetensors"
    make_token_shard(tokens, lengths=(3, 40))
    params = make_params(run_dir)
    params["max_length"] = 31  # a token shard longer than prepare.max_length: the server says no
    with pytest.raises(UserError, match="sample 1 .*max_model_len"):
        extract_shard_vllm(str(tokens), str(out), params, str(run_dir))


# ---------------------------------------------------------------- lifecycle
CLIENT = textwrap.dedent(
    """
    import json, sys
    from eagle3build.extraction.vllm import extract_shard_vllm
    extract_shard_vllm(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4])
    """
)


def test_concurrent_jobs_share_one_server_and_stop_kills_its_group(run_dir, tmp_path):
    params = make_params(run_dir, env={"FAKE_VLLM_STARTUP": "delay:1"})  # both jobs arrive during startup
    procs = []
    for k in range(2):
        make_token_shard(tmp_path / f"t{k}.safetensors", seed=k)
        argv = [str(tmp_path / f"t{k}.safetensors"), str(tmp_path / f"h{k}.safetensors"), json.dumps(params)]
        procs.append(subprocess.Popen([sys.executable, "-c", CLIENT, *argv, str(run_dir)], cwd=REPO))
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    for k in range(2):
        src, got = read_tokens(tmp_path / f"t{k}.safetensors"), read_hidden(tmp_path / f"h{k}.safetensors")
        want = expected_hidden(src.sample(1)[0])
        assert torch.equal(got.sample(1)[2], want)

    state = _server_state(run_dir)
    log = Path(state.log).read_text()
    assert log.count("fake vllm serve: starting") == 1  # the second job reused the first one's server
    assert _alive(state.pid)  # the server outlives the jobs: the Snakefile hooks stop it
    worker = _worker_pid(Path(state.log))
    assert stop_servers(run_dir) is True
    assert _wait_dead(state.pid) and _wait_dead(worker)  # SIGTERM reached the whole process group
    assert _server_state(run_dir) is None and stop_servers(run_dir) is False


def test_a_server_with_another_identity_is_not_reused(run_dir):
    first = VllmServer(run_dir, make_params(run_dir))
    other_params = make_params(run_dir)
    other_params["layer_ids"] = [1, 3, 5, 8]
    other = VllmServer(run_dir, other_params)
    with first.lease():
        old = first.read_state()
        with pytest.raises(UserError, match="serves another extraction.*still using it"):
            with other.lease():
                pass
    with other.lease():  # nobody uses the first one any more: it is replaced
        new = other.read_state()
    assert new.pid != old.pid and new.identity["layer_ids"] == [1, 3, 5, 8]
    assert _wait_dead(old.pid)
    with VllmServer(run_dir, other_params).lease():  # same identity: reused
        assert other.read_state().pid == new.pid


def test_sigkill_when_sigterm_is_ignored(run_dir, monkeypatch):
    server = VllmServer(run_dir, make_params(run_dir, env={"FAKE_VLLM_IGNORE_SIGTERM": "1"}))
    with server.lease():
        pid = server.read_state().pid
    real = process.terminate
    monkeypatch.setattr(process, "terminate", lambda p, t, grace_s=30.0: real(p, t, grace_s=0.5))
    assert stop_servers(run_dir) and _wait_dead(pid)


def test_startup_crash_reports_the_log_tail(run_dir):
    server = VllmServer(run_dir, make_params(run_dir, env={"FAKE_VLLM_STARTUP": "crash"}))
    with pytest.raises(UserError, match=r"(?s)exited with status 1.*vllm-server\.log.*CUDA out of memory"):
        with server.lease():
            pass
    assert server.read_state() is None


def test_startup_timeout_kills_the_server(run_dir):
    server = VllmServer(
        run_dir, make_params(run_dir, startup_timeout_s=1, env={"FAKE_VLLM_STARTUP": "delay:60"})
    )
    with pytest.raises(UserError, match="startup_timeout_s=1"):
        with server.lease():
            pass
    started = [ln for ln in server.log_path.read_text().splitlines() if "fake vllm serve: starting" in ln]
    assert _wait_dead(int(started[-1].split()[5]))


def test_missing_executable_names_the_key(run_dir):
    server = VllmServer(run_dir, make_params(run_dir, executable=["/nonexistent/vllm"]))
    with pytest.raises(ConfigError, match="extract.vllm.executable"):
        with server.lease():
            pass


def test_idle_watchdog_stops_an_unused_server(run_dir):
    server = VllmServer(run_dir, make_params(run_dir, idle_timeout_s=1))
    with server.lease():
        state = server.read_state()
        time.sleep(2)  # in use: the watchdog must leave it running
        assert _alive(state.pid)
    assert _wait_dead(state.pid, timeout=15)
    assert _wait_dead(state.watchdog_pid)  # it exits right after removing the state
    assert server.read_state() is None
    assert os.path.exists(server.log_path)


# ---------------------------------------------------------------- aborts (vLLM < 0.33 crashes on a queued one)
def post_and_leave(port: int, prompt: list[int], wait_s: float = 0.3) -> None:
    """Send a completion and close the connection before the answer: what a client timeout, Ctrl-C or a
    killed job does."""
    import socket

    body = json.dumps({"model": "eagle3build-target", "prompt": prompt, "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(wait_s)


def _post(port: int, prompt: list[int], timeout: float = 30) -> dict:
    import requests

    body = {"model": "eagle3build-target", "prompt": prompt, "max_tokens": 1}
    return requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=timeout).json()


@pytest.mark.parametrize("version, crashes", [("0.25.0", True), ("0.33.0", False)])
def test_the_fake_engine_dies_when_a_queued_request_is_aborted_before_0_33(run_dir, version, crashes):
    """The fake reproduces the crash (so the tests below can catch a regression): a client that leaves
    while its request waits in the engine's queue takes vLLM < 0.33 down for every client."""
    import threading

    server = VllmServer(run_dir, make_params(run_dir, env={"FAKE_VLLM_MAX_RUNNING": "1",
                                                            "FAKE_VLLM_VERSION": version}))
    set_fault(run_dir, "slow:1.5", 1)
    with server.lease():
        state = server.read_state()
        def run_first():
            with contextlib.suppress(OSError):  # a crashed engine answers nothing
                _post(state.upstream_port, [1, 2, 3])

        first = threading.Thread(target=run_first, daemon=True)
        first.start()  # runs for 1.5 s in the only slot
        time.sleep(0.3)
        post_and_leave(state.upstream_port, [4, 5, 6])  # straight to vLLM: queued, then disconnected
        first.join(timeout=10)
        if crashes:
            assert _wait_dead(state.pid)  # the relay exits with vLLM: the server is gone for everyone
            assert "KeyError" in Path(state.log).read_text()
        else:
            assert _alive(state.pid) and _post(state.port, [7, 8])["kv_transfer_params"]


def test_a_client_timeout_while_queued_leaves_the_server_running(run_dir, tmp_path):
    """Requests reach vLLM through the relay, which keeps each one until vLLM answers: a client timing out
    while its request is queued costs a retry, not the server."""
    params = make_params(run_dir, request_timeout_s=1, retries=4, concurrency=3,
                         env={"FAKE_VLLM_MAX_RUNNING": "1"})
    set_fault(run_dir, "slow:2", 1)  # the first request holds the only slot past every client's timeout
    tokens, out = tmp_path / "t.safetensors", tmp_path / "h.safetensors"
    make_token_shard(tokens, lengths=(5, 6, 7))
    extract_shard_vllm(str(tokens), str(out), params, str(run_dir))

    src, got = read_tokens(tokens), read_hidden(out)
    for i in range(src.num_samples):
        assert torch.equal(got.sample(i)[2], expected_hidden(src.sample(i)[0]))
    state = _server_state(run_dir)
    log = Path(state.log).read_text()
    assert _alive(state.pid) and "KeyError" not in log and log.count("fake vllm serve: starting") == 1
    assert "the client left before its answer" in log  # the timed-out requests did reach the engine
    connector = VllmServer(run_dir, params).storage_path
    deadline = time.monotonic() + 10  # the relay deletes the files of answers nobody waited for
    while list(connector.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(connector.iterdir()) == []


def test_a_killed_job_leaves_the_server_running(run_dir, tmp_path):
    """SIGKILL closes a job's sockets with its requests queued: the server keeps serving the next job."""
    import signal

    params = make_params(run_dir, env={"FAKE_VLLM_MAX_RUNNING": "1"})
    set_fault(run_dir, "slow:1.5", 1)
    make_token_shard(tmp_path / "t0.safetensors", lengths=(4, 5, 6, 7))
    argv = [str(tmp_path / "t0.safetensors"), str(tmp_path / "h0.safetensors"), json.dumps(params)]
    job = subprocess.Popen([sys.executable, "-c", CLIENT, *argv, str(run_dir)], cwd=REPO)
    deadline = time.monotonic() + 30
    while (_server_state(run_dir) is None or not _server_state(run_dir).upstream_port) and (
            time.monotonic() < deadline):
        time.sleep(0.1)
    time.sleep(0.8)  # its requests are running and queued
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=10)
    state = _server_state(run_dir)
    make_token_shard(tmp_path / "t1.safetensors", seed=1)
    extract_shard_vllm(str(tmp_path / "t1.safetensors"), str(tmp_path / "h1.safetensors"), params, str(run_dir))
    assert _server_state(run_dir).pid == state.pid and _alive(state.pid)
    assert "KeyError" not in Path(state.log).read_text()


# ---------------------------------------------------------------- the fake against the real engine
FIXTURES = Path(__file__).parent / "fixtures"


def recorded(name: str) -> dict:
    """An answer of the real vLLM 0.25.0 (`vllm serve` started by build_command on an H100, SmolLM2)."""
    return json.loads((FIXTURES / f"vllm_0.25.0_{name}.json").read_text())


def _shape(value):
    """A JSON value's structure: dict keys (recursively), list element structure, and the type of leaves."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


def _words(message: str) -> str:
    return re.sub(r"\d+", "N", message)


def _ask(port: int, method: str, path: str, body: dict | None = None):
    import requests

    response = requests.request(method, f"http://127.0.0.1:{port}{path}", json=body, timeout=30)
    return response, (response.json() if response.content else None)


@pytest.fixture(scope="module")
def fake_as_served(tmp_path_factory):
    """The fake behind the relay, as the client reaches it (max_model_len = prepare.max_length + 1 = 8192)."""
    d = tmp_path_factory.mktemp("recorded") / "run"
    d.mkdir()
    params = make_params(d)
    params["max_length"] = 8191
    server = VllmServer(d, params)
    with server.lease():
        yield server, server.read_state()
    stop_servers(d)


def test_the_fake_answers_completions_like_vllm_0_25_0(fake_as_served):
    server, state = fake_as_served
    real = recorded("completions_extract")
    response, body = _ask(state.port, "POST", "/v1/completions", real["request"]["body"])
    assert response.status_code == real["status"] == 200
    assert response.headers["content-type"] == real["headers"]["content-type"]
    expected = _shape(real["json"])
    expected["choices"][0]["text"] = "str"
    assert _shape(body) == expected  # every field, nested, with the same JSON types (nulls included)
    # The file is named by vLLM's internal request id, not the response id: only the path names it.
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", body["id"]) and re.fullmatch(r"cmpl-[0-9a-f]{16}", real["json"]["id"])
    path = Path(body["kv_transfer_params"]["hidden_states_path"])
    pattern = r"(cmpl-[0-9a-f]{16})-0-[0-9a-f]{8}\.safetensors"
    assert re.fullmatch(pattern, path.name).group(1) == body["id"]
    real_name = Path(real["json"]["kv_transfer_params"]["hidden_states_path"]).name
    assert re.fullmatch(pattern, real_name).group(1) == real["json"]["id"]
    assert path.parent == server.storage_path

    layout = recorded("connector_layout")
    lock = Path(f"{path}.lock")
    assert lock.exists()  # held with LOCK_EX before the answer, like the real connector
    with process.flock(lock, fcntl.LOCK_SH):
        header_len = int.from_bytes(path.read_bytes()[:8], "little")
        header = json.loads(path.read_bytes()[8:8 + header_len])
    real_header = layout["safetensors_header"]
    assert list(header) == list(real_header)  # token_ids first, then hidden_states
    n = len(real["request"]["body"]["prompt"])
    assert [header[k]["dtype"] for k in header] == [real_header[k]["dtype"] for k in real_header]
    assert header["token_ids"]["shape"] == real_header["token_ids"]["shape"] == [n]
    assert header["hidden_states"]["shape"][:2] == real_header["hidden_states"]["shape"][:2] == [n, 4]
    assert lock.exists() and layout["files_after_1s"][1].endswith(".lock")  # the server leaves the lock
    path.unlink()
    lock.unlink()


@pytest.mark.parametrize("name", ["err_too_long", "err_empty_prompt", "err_wrong_model", "err_bad_token_id"])
def test_the_fake_refuses_like_vllm_0_25_0(fake_as_served, name):
    _, state = fake_as_served
    real = recorded(name)
    request = dict(real["request"]["body"])
    if name == "err_too_long":  # recorded with its 8,192 ids stripped: as long as max_model_len
        request["prompt"] = [5] * 8192
    response, body = _ask(state.port, "POST", "/v1/completions", request)
    assert response.status_code == real["status"]
    assert _shape(body) == _shape(real["json"])
    got, want = body["error"], real["json"]["error"]
    assert (got["type"], got["param"], got["code"]) == (want["type"], want["param"], want["code"])
    assert _words(got["message"]) == _words(want["message"])


def test_the_fake_serves_health_version_models_and_longer_answers_like_vllm_0_25_0(fake_as_served):
    _, state = fake_as_served
    real = recorded("health")
    response, _ = _ask(state.port, "GET", "/health")
    assert response.status_code == real["status"] and response.content == b"" == real["text"].encode()
    assert "content-type" not in response.headers and "content-type" not in real["headers"]
    response, body = _ask(state.port, "GET", "/version")
    assert body == recorded("version")["json"]
    response, body = _ask(state.port, "GET", "/v1/models")
    real = recorded("models")["json"]
    assert set(body) == set(real) and set(body["data"][0]) == set(real["data"][0])
    assert body["data"][0]["id"] == real["data"][0]["id"] == "eagle3build-target"
    assert body["data"][0]["max_model_len"] == real["data"][0]["max_model_len"] == 8192
    real = recorded("max_tokens_2")  # accepted: the file still holds the prompt's states only
    response, body = _ask(state.port, "POST", "/v1/completions", real["request"]["body"])
    assert response.status_code == real["status"] and body["usage"] == real["json"]["usage"]
    path = Path(body["kv_transfer_params"]["hidden_states_path"])
    with process.flock(Path(f"{path}.lock"), fcntl.LOCK_SH):
        assert read_safetensors_shapes(path) == {"token_ids": [17], "hidden_states": [17, 4, HIDDEN]}
    path.unlink()
    Path(f"{path}.lock").unlink()


def read_safetensors_shapes(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}


def test_a_rejection_quotes_vllm_and_names_what_to_change(run_dir, tmp_path):
    """The error's own message, and a hint that fits it (not a length hint for every 4xx)."""
    tokens, out = tmp_path / "t.safetensors", tmp_path / "h.safetensors"
    make_token_shard(tokens, lengths=(3, 4))  # ids < 1000
    params = make_params(run_dir, env={"FAKE_VLLM_VOCAB_SIZE": "500"}, retries=0)
    with pytest.raises(UserError, match=r"HTTP 400: Token id \d+ is out of vocabulary\); the token shards hold ids"):
        extract_shard_vllm(str(tokens), str(out), params, str(run_dir))


# ---------------------------------------------------------------- the client's threads
def reference_shard(tokens: Path, out: Path, storage_dtype: str) -> None:
    """The hidden shard the fake's states make through the writer's queue path, sample by sample in order."""
    from eagle3build.shards import HiddenShardWriter

    src = read_tokens(tokens)
    meta = {"model": "org/fake-target", "revision": "", "layer_ids": LAYER_IDS, "backend": "vllm",
            "image": make_params(tokens.parent)["image"]}
    with HiddenShardWriter(out, src.input_ids, src.loss_mask, src.cu_seqlens, HIDDEN, storage_dtype, meta) as w:
        for i in range(src.num_samples):
            ids, _ = src.sample(i)
            w.write(int(src.cu_seqlens[i]), expected_hidden(ids).to(torch.bfloat16))


@pytest.mark.parametrize("storage_dtype", ["bf16", "fp8"])
def test_rows_land_at_their_offsets_whatever_order_samples_finish(shared_run, tmp_path, storage_dtype):
    set_fault(shared_run, "slow:0.5", 1)  # the first sample finishes after the others
    tokens, out, ref = tmp_path / "t.safetensors", tmp_path / "h.safetensors", tmp_path / "ref.safetensors"
    make_token_shard(tokens, lengths=(40, 3, 17, 1, 29, 8, 64, 5, 11))
    params = make_params(shared_run, concurrency=2)
    params["storage_dtype"] = storage_dtype
    extract_shard_vllm(str(tokens), str(out), params, str(shared_run))
    reference_shard(tokens, ref, storage_dtype)
    assert out.read_bytes() == ref.read_bytes()  # the bytes the one-writer-thread path writes
    assert list(VllmServer(shared_run, params).storage_path.iterdir()) == []


def test_a_failed_write_fails_the_job_at_once_and_cleans_up(shared_run, tmp_path, monkeypatch):
    from eagle3build.shards import HiddenShardWriter

    set_fault(shared_run, None)
    calls = []
    real = HiddenShardWriter._pwrite_rows

    def failing(self, offset, data, scale):  # the disk fills up at the third sample's rows
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(self, offset, data, scale)

    monkeypatch.setattr(HiddenShardWriter, "_pwrite_rows", failing)
    tokens, out = tmp_path / "t.safetensors", tmp_path / "h.safetensors"
    make_token_shard(tokens, lengths=(4,) * 30)
    with pytest.raises(UserError, match="(?i)no space|disk"):  # the writer's full-disk error, not retried
        extract_shard_vllm(str(tokens), str(out), make_params(shared_run, retries=3), str(shared_run))
    assert len(calls) < 30  # the samples not yet sent were cancelled
    assert not out.exists() and not list(tmp_path.glob(".h.safetensors*"))
    assert list(VllmServer(shared_run, make_params(shared_run)).storage_path.iterdir()) == []


def test_fp8_quantization_is_the_reference_formula_bit_for_bit():
    from eagle3build.shards import FP8_MAX, quantize_fp8

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        rows = (torch.randn(64, 4, 96, generator=g) * torch.logspace(-6, 4, 64).view(-1, 1, 1)).to(dtype)
        rows[3] = 0
        x = rows.float()
        scale = x.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
        want = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        q, s = quantize_fp8(rows)
        assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)) and torch.equal(s, scale)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_finite_check_finds_one_bad_value(bad):
    values = torch.randn(33, 4, 16).to(torch.bfloat16)
    assert vllm_backend._finite(values)
    values[17, 2, 5] = bad
    assert not vllm_backend._finite(values)
