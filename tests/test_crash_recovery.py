"""Crash leftovers and data loss: temp files of killed writers, processes that outlive their workflow, two
trainers on one checkpoint folder, torn metric lines, a full disk, and the extraction server's socket."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from eagle3build.atomic import atomic_path, remove_stale_temps, save_safetensors_atomic, write_json_atomic
from eagle3build.config import resolve_section
from eagle3build.engine import process
from eagle3build.errors import UserError
from eagle3build.extraction import hf_server
from eagle3build.extraction.job import extract_shard, stop_servers
from eagle3build.extraction.protocol import ProtocolError, recv_request, send_message
from eagle3build.shards import HiddenShardWriter, read_hidden, write_tokens
from eagle3build.train.checkpoint import OWNER_LOCK, own_state_dir, release_state_dir, save_checkpoint
from eagle3build.train.metrics import record, truncate_metrics

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def wait_for(predicate, timeout_s: float = 20.0, poll_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return predicate()


def python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, text=True, **kwargs)


# A writer that stops half way through a hidden shard (the shard's rows never all written), then waits
# to be killed: its temp file is full size.
HALF_WRITTEN = """
    import sys, time, torch
    from eagle3build.engine import process
    from eagle3build.shards import HiddenShardWriter
    if sys.argv[2] == "signals":
        process.exit_on_signals()
    ids = torch.arange(64, dtype=torch.int32)
    with HiddenShardWriter(sys.argv[1], ids, torch.ones(64, dtype=torch.uint8), torch.tensor([0, 64]), 8, "bf16",
                           {}) as w:
        w.write(0, torch.randn(32, 4, 8))
        print("writing", flush=True)
        time.sleep(120)
"""


def write_shard(path: Path, n: int = 64) -> None:
    with HiddenShardWriter(path, torch.arange(n, dtype=torch.int32), torch.ones(n, dtype=torch.uint8),
                           torch.tensor([0, n]), 8, "bf16", {}) as w:
        w.write(0, torch.randn(n, 4, 8))


# ---------------------------------------------------------------- 9: temp files of killed writers
def test_a_killed_writers_temp_file_is_removed_when_the_shard_is_written_again(tmp_path):
    shard = tmp_path / "00000.safetensors"
    proc = python(HALF_WRITTEN, str(shard), "plain")
    assert proc.stdout.readline().strip() == "writing"
    proc.kill()
    proc.wait()
    (leftover,) = temps(tmp_path)
    assert (tmp_path / leftover).stat().st_size > 64 * 4 * 8 * 2  # full size: the disk leak of the issue
    write_shard(tmp_path / "00001.safetensors")  # another shard's writer leaves it alone
    assert temps(tmp_path) == [leftover]
    write_shard(shard)  # the rerun of the killed job
    assert temps(tmp_path) == [] and read_hidden(shard).hidden.shape == (64, 4, 8)


def test_a_live_writers_temp_file_is_kept(tmp_path):
    """Only a dead writer's temp is stale: the lock of a writer that still runs protects its file."""
    final = tmp_path / "state.json"
    holder = python("""
        import sys, time
        from eagle3build.atomic import atomic_path
        with atomic_path(sys.argv[1]) as tmp:
            tmp.write_text('{"from": "holder"}')
            print("writing", flush=True)
            sys.stdin.readline()
        print("done", flush=True)
    """, str(final), stdin=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "writing"
        (theirs,) = temps(tmp_path)
        write_json_atomic(final, {"from": "test"})
        assert remove_stale_temps(final) == [] and temps(tmp_path) == [theirs]
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "done"
    finally:
        holder.kill()
        holder.wait()
    assert json.loads(final.read_text()) == {"from": "holder"} and temps(tmp_path) == []


def test_sigterm_makes_a_job_remove_its_temp_file(tmp_path):
    shard = tmp_path / "00000.safetensors"
    proc = python(HALF_WRITTEN, str(shard), "signals")
    assert proc.stdout.readline().strip() == "writing"
    assert temps(tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- 9/10: nothing outlives its workflow
JOB = """
    import sys, time
    from eagle3build.atomic import atomic_path
    from eagle3build.engine import process
    process.bind_to_workflow(grace_s=10)
    with atomic_path(sys.argv[1]) as tmp:
        tmp.write_bytes(b"x" * 1000)
        print("writing", flush=True)
        time.sleep(120)
"""


def test_a_job_ends_with_its_workflow_even_when_its_parent_lives_on(tmp_path):
    """The workflow (a stand-in for Snakemake) is killed with -9; the job's direct parent (a shell that has
    more to do) lives on, so only the workflow watch can end the job; it unwinds and drops its temp file."""
    workflow = python("import time; print('up', flush=True); time.sleep(300)", start_new_session=True)
    try:
        assert workflow.stdout.readline().strip() == "up"
        env = {**ENV, process.WORKFLOW_ENV: process.workflow_marker(workflow.pid)}
        job_py = tmp_path / "job.py"
        job_py.write_text(textwrap.dedent(JOB))
        shell = subprocess.Popen(["bash", "-c", f'"{sys.executable}" "{job_py}" "{tmp_path / "out.bin"}"; sleep 300'],
                                 cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            assert shell.stdout.readline().strip() == "writing"
            children = subprocess.run(["pgrep", "-P", str(shell.pid)], capture_output=True, text=True).stdout
            job_pid = int(children.split()[0])
            assert process.alive(job_pid) and temps(tmp_path)
            workflow.kill()
            workflow.wait()
            assert wait_for(lambda: not process.alive(job_pid), 15), "the job outlived its workflow"
            assert shell.poll() is None  # its parent still runs: the watch ended the job, not the parent
            assert temps(tmp_path) == [] and not (tmp_path / "out.bin").exists()
        finally:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
    finally:
        workflow.kill()
        workflow.wait()


def test_a_job_ends_with_its_parent(tmp_path):
    """PR_SET_PDEATHSIG: a job whose parent (Snakemake runs jobs as its children) dies is ended too, also
    without the workflow variable."""
    job_py = tmp_path / "job.py"
    job_py.write_text(textwrap.dedent(JOB))
    parent = python("""
        import os, subprocess, sys, time
        env = {k: v for k, v in os.environ.items() if k != sys.argv[3]}
        child = subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]], env=env, stdout=subprocess.PIPE, text=True)
        print(child.pid, child.stdout.readline().strip(), flush=True)
        time.sleep(300)
    """, str(job_py), str(tmp_path / "out.bin"), process.WORKFLOW_ENV, start_new_session=True)
    try:
        pid, state = parent.stdout.readline().split()
        assert state == "writing"
        parent.kill()
        parent.wait()
        assert wait_for(lambda: not process.alive(int(pid)), 15), "the job outlived its parent"
        assert temps(tmp_path) == []
    finally:
        parent.kill()
        parent.wait()


def test_workflow_variable_from_another_host_or_namespace_is_ignored(monkeypatch):
    """On a cluster node the workflow's pid means nothing: the job must not take it for a dead workflow."""
    monkeypatch.setenv(process.WORKFLOW_ENV, "1:123:some-other-host:pid:[1]")
    assert process.workflow_owner() is None
    assert process.workflow_owner(default_pid=os.getpid())["pid"] == os.getpid()
    monkeypatch.setenv(process.WORKFLOW_ENV, process.workflow_marker())
    assert process.workflow_owner() == {"pid": os.getpid(), "start_ticks": process.start_ticks(os.getpid())}


def make_token_shard(path: Path, lengths: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    write_tokens(path, [torch.randint(3, 128, (n,), generator=g) for n in lengths],
                 [torch.ones(n, dtype=torch.uint8) for n in lengths], {"tokenizer": "test"})


def test_extraction_server_ends_with_its_workflow_and_guards_its_socket(tiny_llama, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    workflow = python("import time; print('up', flush=True); time.sleep(300)", start_new_session=True)
    try:
        assert workflow.stdout.readline().strip() == "up"
        monkeypatch.setenv(process.WORKFLOW_ENV, process.workflow_marker(workflow.pid))
        target = {"path": str(tiny_llama), "revision": None, "trust_remote_code": False, "dtype": "float32"}
        params = resolve_section("extract", {"aux_layer_ids": [1, 3, 4], "devices": ["cpu"],
                                             "storage_dtype": "bf16", "server_idle_s": 300})
        make_token_shard(tmp_path / "t.safetensors", [20, 30])
        reply = extract_shard(str(tmp_path / "t.safetensors"), str(tmp_path / "h.safetensors"), target, params,
                              str(run_dir))
        assert reply["ok"] and reply["tokens"] == 50
        state = json.loads((run_dir / "hf-server-0.json").read_text())
        assert state["owner"]["pid"] == workflow.pid  # the workflow owns it, not the job that started it

        def ask(frame: bytes, timeout_s: float = 10.0) -> dict:
            with socket.create_connection(("127.0.0.1", state["port"]), timeout=timeout_s) as sock:
                sock.sendall(frame)
                n = struct.unpack(">I", sock.recv(4))[0]
                return json.loads(sock.recv(n))

        # A wrong token is refused before any length is read; a 4 GiB length before anything is allocated.
        assert "bad token" in ask(b"0" * 32)["error"]
        t0 = time.monotonic()
        assert "4294967295 bytes" in ask(state["token"].encode() + struct.pack(">I", 2**32 - 1))["error"]
        assert time.monotonic() - t0 < 5
        # It still serves the run's jobs.
        assert extract_shard(str(tmp_path / "t.safetensors"), str(tmp_path / "h2.safetensors"), target, params,
                             str(run_dir))["ok"]
        workflow.kill()  # the workflow is killed: its onerror hook never runs
        workflow.wait()
        assert wait_for(lambda: not process.alive(state["pid"], state["start_ticks"]), 20), \
            "the extraction server outlived its workflow"
        assert not (run_dir / "hf-server-0.json").exists()
        assert "workflow (pid" in (run_dir / "hf-server-0.log").read_text()
    finally:
        workflow.kill()
        workflow.wait()
        stop_servers(run_dir)


# ---------------------------------------------------------------- 16: the server's socket
class _Unused:
    def __getattr__(self, name):
        raise AssertionError("a refused request reached the extractor")


def test_a_stalled_client_times_out_and_bad_requests_are_refused(monkeypatch):
    monkeypatch.setattr(hf_server, "READ_TIMEOUT_S", 0.3)
    token = "ab" * 16
    server, client = socket.socketpair()
    with server, client:
        client.sendall(token.encode()[:10])  # then nothing: a stalled (or hostile) peer
        t0 = time.monotonic()
        hf_server.handle_connection(server, _Unused(), token)
        assert time.monotonic() - t0 < 3
        n = struct.unpack(">I", client.recv(4))[0]
        assert json.loads(client.recv(n))["ok"] is False
    server, client = socket.socketpair()
    with server, client:
        client.sendall(b"x" * 32 + struct.pack(">I", 2**32 - 1))
        with pytest.raises(ProtocolError, match="bad token"):
            recv_request(server, token)
    server, client = socket.socketpair()
    with server, client:
        client.sendall(token.encode() + struct.pack(">I", 2**32 - 1))
        with pytest.raises(ProtocolError, match="more than"):
            recv_request(server, token, max_bytes=1 << 20)
    server, client = socket.socketpair()
    with server, client:
        send_message(client, {"tokens": "t"}, token)
        assert recv_request(server, token) == {"tokens": "t"}


# ---------------------------------------------------------------- 10: one trainer per checkpoint folder
HOLDER = """
    import sys, time
    from eagle3build.train.checkpoint import own_state_dir
    own_state_dir(sys.argv[1])
    print("owner", flush=True)
    time.sleep(300)
"""


def test_a_second_trainer_fails_fast_naming_the_folder_and_the_holder(tmp_path):
    state = tmp_path / "state"
    holder = python(HOLDER, str(state))
    try:
        assert holder.stdout.readline().strip() == "owner"
        from eagle3build.train.loop import train

        t0 = time.monotonic()
        with pytest.raises(UserError, match=rf"{re.escape(str(state))}.*another trainer.*pid {holder.pid}"):
            # inputs that do not exist: the lock is taken before anything is read
            train([str(tmp_path / "none.safetensors")], str(tmp_path / "none"), str(tmp_path / "none"),
                  str(tmp_path / "out"), str(state), {})
        assert time.monotonic() - t0 < 10
        assert sorted(p.name for p in state.iterdir()) == [OWNER_LOCK]  # nothing else touched
    finally:
        holder.kill()
        holder.wait()
    # A dead trainer holds nothing: the rerun owns the folder at once.
    own_state_dir(state)
    own_state_dir(state)  # this process again (an earlier train() call that failed): still its own
    release_state_dir(state)
    fd = process.try_lock(state / OWNER_LOCK)
    assert fd is not None
    os.close(fd)


# ---------------------------------------------------------------- 13: torn metric lines, a full disk
class _Main:
    main, rank, world_size = True, 0, 1


def test_a_torn_last_metrics_line_is_dropped_and_a_torn_middle_line_is_named(tmp_path, capfd):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "split": "train", "loss": 1.0}) for s in (1, 2, 3)]
    path.write_text("\n".join(lines) + '\n{"step": 4, "split": "tr')
    truncate_metrics(path, 2, _Main())
    assert path.read_text().splitlines() == lines[:2]
    assert "torn last line 4" in capfd.readouterr().err
    path.write_text(lines[0] + '\n{"step": 2, "spl\n' + lines[2] + "\n")
    with pytest.raises(UserError, match=rf"{re.escape(str(path))}: line 2 is not a metrics record"):
        truncate_metrics(path, 3, _Main())


def test_resume_survives_a_torn_metrics_line(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_train import FAST, make_inputs

    from eagle3build.train.loop import train

    (tmp_path / "in").mkdir()
    inputs = make_inputs(tmp_path / "in", n_shards=1)
    params = {**FAST, "epochs": 1, "checkpoint_every": 2}
    args = (inputs["shards"], inputs["mapping"], inputs["target"], str(tmp_path / "out"), str(tmp_path / "state"))
    first = train(*args, params)
    (metrics,) = (tmp_path / "state").glob("*/metrics.jsonl")
    with open(metrics, "a") as f:
        f.write('{"step": 99, "split": "tr')  # a run killed while writing a line
    again = train(*args, params)
    assert again["resumed_from_step"] == first["steps"]
    assert all(json.loads(x)["step"] <= first["steps"] for x in metrics.read_text().splitlines())


def _full_disk(monkeypatch, after_bytes: int = 100):
    import safetensors.torch

    def save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * after_bytes)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


def test_a_full_disk_during_a_checkpoint_is_a_user_error_and_keeps_the_previous_one(tmp_path, monkeypatch):
    from eagle3build.draft.model import Eagle3Draft  # noqa: F401  (save_checkpoint's model type)

    model = torch.nn.Linear(4, 4)
    model.trainable_state_dict = model.state_dict
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    save_checkpoint(tmp_path, 2, model, optimizer, scheduler, {"params_hash": "h"}, keep=2)
    before = (tmp_path / "ckpt-00000002.safetensors").read_bytes()
    _full_disk(monkeypatch)
    with pytest.raises(UserError, match=rf"{re.escape(str(tmp_path))}: no space left.*needs about .* GB.*"
                                        r"resumes from ckpt-00000002"):
        save_checkpoint(tmp_path, 4, model, optimizer, scheduler, {"params_hash": "h"}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000002.safetensors"]  # no temp, no ckpt-4
    assert (tmp_path / "ckpt-00000002.safetensors").read_bytes() == before


def test_a_full_disk_while_writing_outputs_is_a_user_error(tmp_path, monkeypatch):
    (tmp_path / "w.safetensors").write_bytes(b"old")
    _full_disk(monkeypatch)
    with pytest.raises(UserError, match=r"no space left.*w\.safetensors is unchanged"):
        save_safetensors_atomic(tmp_path / "w.safetensors", {"x": torch.zeros(1000)})
    assert (tmp_path / "w.safetensors").read_bytes() == b"old" and temps(tmp_path) == []

    def no_space(self, *args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(HiddenShardWriter, "_write_now", no_space)
    with pytest.raises(UserError, match=r"no space left.*00000\.safetensors.*needs about"):
        write_shard(tmp_path / "00000.safetensors")
    assert not (tmp_path / "00000.safetensors").exists() and temps(tmp_path) == []
    with open(tmp_path / "metrics.jsonl", "w"):
        pass

    def full_open(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("builtins.open", full_open)
    try:
        with pytest.raises(UserError, match="no space left.*metrics.jsonl"):
            record({"step": 1, "split": "val"}, tmp_path / "metrics.jsonl", None)
    finally:
        monkeypatch.undo()


def test_atomic_path_writes_and_cleans_as_before(tmp_path):
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "x.json") as tmp:
        tmp.write_text("half")
        raise RuntimeError("the writer failed")
    assert list(tmp_path.iterdir()) == []
    write_json_atomic(tmp_path / "x.json", {"a": 1})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": 1} and temps(tmp_path) == []
    assert oct((tmp_path / "x.json").stat().st_mode & 0o777) == "0o600"  # private (the server's token)


# ---------------------------------------------------------------- the real workflow, Snakemake killed alone
def _processes_running(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions `marker` (a test's private folder) or that run in it
    (a server started with relative paths from a job's working directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if (marker in cmdline or cwd == marker or cwd.startswith(marker + "/")) and process.alive(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def _start_snakemake(wd: Path, *args: str, cores: int = 1) -> subprocess.Popen:
    """Snakemake in its own process group (the group a terminal's Ctrl-C reaches), its output in wd/smk.log."""
    with open(wd / "smk.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "snakemake", "--configfile", "config.test.yaml", "--cores",
                                 str(cores), *args, "--resources", "gpu=1"], cwd=wd, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _end_everything_in(wd: Path) -> None:
    for pid in _processes_running(str(wd)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    stop_servers(wd / "build" / ".run")


@pytest.mark.slow
def test_killing_snakemake_alone_ends_its_jobs_server_and_trainer(tmp_path):
    """`kill -9` of the Snakemake process only (its jobs are not in the signal's reach): the extraction job,
    the HF server and later the trainer end within seconds, and the rerun leaves no temp file and writes
    each metric line once."""
    from conftest import STORIES
    from workflow_util import copy_workflow, snakemake, write_config

    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    sys.path.insert(0, str(Path(__file__).parent))
    from test_workflow import base_config

    wd = copy_workflow(tmp_path / "wf")
    cfg = base_config()
    cfg["datasets"][0]["max_samples"] = 48
    cfg["extract"]["server_idle_s"] = 600  # only its workflow's end may stop it here
    cfg["train"].update({"epochs": 30, "checkpoint_every": 5, "log_every": 1})
    write_config(wd, cfg)
    run_dir, build = wd / "build" / ".run", wd / "build"

    try:
        smk = _start_snakemake(wd, "build/train/draft.safetensors")
        assert wait_for(lambda: list((build / "hidden").glob("*/*.safetensors")), 600), "no shard extracted"
        state = json.loads((run_dir / "hf-server-0.json").read_text())
        smk.kill()  # Snakemake only: its jobs are not signalled
        smk.wait()
        assert wait_for(lambda: not process.alive(state["pid"], state["start_ticks"]), 30), \
            "the extraction server outlived its workflow"
        assert wait_for(lambda: not _processes_running(str(wd)), 30), "a job outlived its workflow"

        snakemake(wd, "--unlock")
        smk = _start_snakemake(wd, "build/train/draft.safetensors")
        assert wait_for(lambda: list((build / "train" / "state").glob("*/ckpt-*.safetensors")), 900), \
            "training never checkpointed"
        smk.kill()
        smk.wait()
        assert wait_for(lambda: not _processes_running(str(wd)), 30), "the trainer outlived its workflow"

        snakemake(wd, "--unlock")
        snakemake(wd, "build/train/draft.safetensors", timeout=1800)
        steps = [json.loads(x)["step"] for x in (build / "train" / "metrics.jsonl").read_text().splitlines()
                 if json.loads(x)["split"] == "train"]
        assert steps == sorted(set(steps)), "metric lines written twice (two trainers on one folder)"
        assert not [str(p) for p in build.rglob("*.tmp")], "a temp file survived the rerun"
    finally:
        _end_everything_in(wd)


# ---------------------------------------------------------------- the kill matrix: every stage, two ways
def _valid(path: Path, build: Path) -> None:
    """Raise unless the file under a final name is complete: it parses as what its name says."""
    import safetensors.torch

    from eagle3build.shards import read_counts, read_tokens

    rel = path.relative_to(build).parts
    if path.suffix == ".json":
        json.loads(path.read_text())
    elif path.suffix == ".jsonl":
        lines = path.read_text().splitlines()
        if rel[:2] == ("train", "state") and lines and not path.read_text().endswith("\n"):
            lines = lines[:-1]  # the trainer's append-only log: a torn last line is dropped on resume
        for line in lines:
            json.loads(line)
    elif path.suffix == ".safetensors":
        readers = {"hidden": read_hidden, "tokens": read_tokens, "counts": read_counts}
        readers.get(rel[1] if rel[0] == "vocab" else rel[0], safetensors.torch.load_file)(path)
    elif path.suffix == ".png":
        from PIL import Image

        with Image.open(path) as image:
            image.verify()


def _check_final_files(build: Path) -> list[str]:
    """Every file under a final name in the build parses; returns the temp files (dot-named *.tmp*)."""
    temps_left = []
    for path in sorted(p for p in build.rglob("*") if p.is_file()):
        if path.name.startswith(".") and ".tmp" in path.name or path.name.endswith(".tmp"):
            temps_left.append(str(path.relative_to(build)))
            continue
        try:
            _valid(path, build)
        except Exception as e:  # noqa: BLE001 (any failure to read it is the finding)
            raise AssertionError(f"{path.relative_to(build)} is incomplete under its final name: {e!r}") from e
    return temps_left


def _kill_matrix_config(wd: Path) -> None:
    from conftest import SHARED, STORIES
    from workflow_util import write_config

    questions = ("Tell me a story.", "Who is Lily?")
    (wd / "q.jsonl").write_text("".join(json.dumps({"turns": [q]}) + "\n" for q in questions))
    write_config(wd, {
        "output_root": "build",
        "target": {"model": str(STORIES), "chat_template": str(ROOT / "tests" / "data" / "chat_template.jinja")},
        "datasets": [{"name": "alpaca", "path": str(SHARED / "assets" / "data" / "train" / "alpaca_en_demo.json"),
                      "max_samples": 16, "regenerate": True}],
        "prepare": {"max_length": 96, "shard_size": 8},  # two shards: two jobs per shard stage
        "regenerate": {"max_new_tokens": 8},
        "extract": {"batch_tokens": 4096, "server_idle_s": 600},  # only its workflow's end may stop it here
        "vocab": {"draft_vocab_size": 64},
        "train": {"epochs": 20, "batch_tokens": 512, "lr": 1e-3, "gpus": 0, "checkpoint_every": 4},
        "evaluate": {"sets": [{"name": "q", "path": "q.jsonl"}], "k": [1, 3], "max_new_tokens": 8},
    })


def _log_says(text: str, log: str):
    """A job's log, written since `t0` (its earlier runs' logs say it too), has `text`."""
    return lambda build, t0: any(p.stat().st_mtime >= t0 and text in p.read_text(errors="replace")
                                 for p in build.glob(f"logs/{log}") if p.is_file())


SHARDS = ("00000", "00001")
# Where the run is killed, in build order: (the job's script, its rules, the outputs the run is asked for, when
# the job is far enough in to be killed or None, how). Each stage is killed twice: Snakemake alone with SIGKILL
# on its first run, its process group with SIGINT or SIGTERM on the next (--forcerun: the first kill's rerun
# may already have finished the stage elsewhere). vocab: its per-shard counts, then the merge.
KILLS = [
    ("split", ["split_0"], [f"data/alpaca/{s}.jsonl" for s in SHARDS], None),
    ("regenerate", ["regenerate"], [f"regen/alpaca/{s}.jsonl" for s in SHARDS],
     _log_says("Loading weights", "regen/alpaca/*.log")),
    ("tokens", ["tokens_regenerated"], [f"tokens/alpaca/{s}.safetensors" for s in SHARDS], None),
    ("extract", ["extract"], [f"hidden/alpaca/{s}.safetensors" for s in SHARDS],
     lambda build, t0: (build / ".run" / "hf-server-0.json").exists()),  # its server is up
    ("vocab_count", ["vocab_count"], ["vocab/mapping.safetensors"], None),
    ("vocab", ["vocab"], ["vocab/mapping.safetensors"], None),
    ("train", ["train"], ["train/draft.safetensors"], _log_says("[train]", "train.log")),  # past its lock
    ("export", ["export"], ["export/eagle3/config.json"], None),
    ("evaluate", ["evaluate"], ["eval/q.json"], _log_says("Loading weights", "evaluate/q.log")),
]


def _kill_during(wd: Path, kill: tuple, how: str, force: bool) -> None:
    """Run the stage's targets, wait until one of its jobs is running (and far enough in), then kill: `kill9`
    the Snakemake process alone (a crash), or a signal to its whole process group (Ctrl-C, a terminal's
    hangup or a scheduler's SIGTERM). Nothing of the run may live on; every final-named file must be whole."""
    script, rules, outputs, far_enough = kill
    stage = script
    build = wd / "build"
    args = ["build/" + o for o in outputs] + (["--forcerun", *rules] if force else [])
    t0 = time.time() - 1  # mtimes are coarser than time.time()
    smk = _start_snakemake(wd, *args, cores=2)
    marker = str(wd / "scripts" / f"{script}.py")
    try:
        caught = wait_for(lambda: smk.poll() is not None or (
            _processes_running(marker) and (far_enough is None or far_enough(build, t0))), 300, poll_s=0.02)
        assert caught and smk.poll() is None, f"{stage}: no job of the stage was seen running ({how})"
        if how == "kill9":
            smk.kill()
        else:
            os.killpg(smk.pid, getattr(signal, how))
        smk.wait(timeout=120)
        left = wait_for(lambda: not _processes_running(str(wd)), 45)
        assert left, f"{stage} ({how}): outlived the workflow: " + "; ".join(
            Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ")[:200]
            for p in _processes_running(str(wd)))
    finally:
        if smk.poll() is None:
            smk.kill()
            smk.wait()
    _check_final_files(build)


@pytest.mark.slow
def test_a_kill_at_every_stage_leaves_whole_files_no_temps_and_no_process(tmp_path):
    """The build is run stage by stage (split, regenerate with the HF backend, tokens, extract, vocab, train,
    export, evaluate) and killed while a job of each stage runs: Snakemake alone with SIGKILL (a crash), and
    its process group with SIGINT or SIGTERM (Ctrl-C, a scheduler). After each kill no process of the run
    lives on (job, extraction server, trainer) and every file under a final name parses; after `--unlock`
    (a SIGKILL leaves Snakemake's lock; a signal must not) the next run goes on. At the end the build
    completes, plans nothing more and holds no temp file."""
    from conftest import STORIES
    from workflow_util import copy_workflow, planned_jobs, snakemake

    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    wd = copy_workflow(tmp_path / "wf")
    _kill_matrix_config(wd)
    build = wd / "build"
    try:
        for i, kill in enumerate(KILLS):
            if kill[0] != "vocab":  # vocab_count's SIGKILL and vocab's signal: one stage
                _kill_during(wd, kill, "kill9", force=False)
                snakemake(wd, "--unlock")
            if kill[0] != "vocab_count":
                _kill_during(wd, kill, ("SIGINT", "SIGTERM")[i % 2], force=kill[0] != "vocab")
        snakemake(wd, timeout=600)
        assert _check_final_files(build) == [], "a temp file survived the rerun"
        assert planned_jobs(wd) == {}, "the build is not complete after the reruns"
        assert json.loads((build / "eval" / "q.json").read_text())
    finally:
        _end_everything_in(wd)
