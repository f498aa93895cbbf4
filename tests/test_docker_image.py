"""The image for real, on the CPU stand-in for the vLLM image (docker/standin/): built by `make docker-build`
through the Dockerfile's own build args, the demo run inside it by `make docker-run` as the calling user
(non-root) with the work tree bind-mounted, interrupted and resumed; then a second run, `make
docker-dry-run` and a host `make dry-run` (naming no image, or the image's) all plan nothing (one `.snakemake/`
shared by host and container) while a host naming another image plans the extractions again, and every
file the container wrote belongs to the caller. The pin guard stops a build whose
requirements contradict the engine's, naming the package.

Runs where a Docker engine answers (`make docker-standin` sets one up on a Debian machine); skips, with
the reason, in a second where none does (CI starts no dockerd)."""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from tree_util import MODEL, ROOT, copy_worktree, job_stats, nothing_planned

# A non-root caller when the tests run as root: files the container writes must be this user's.
CALLER = (1500, 1500)
STANDIN_IMAGE = "eagle3build-standin-test"
CERT = "/etc/ssl/certs/ca-certificates.crt"


@functools.cache
def _client() -> str | None:
    """A Docker client with BuildKit: the default one with buildx, else Debian's docker.io client."""
    if os.environ.get("DOCKER"):
        return os.environ["DOCKER"]
    if shutil.which("docker") and subprocess.run(["docker", "buildx", "version"], capture_output=True).returncode == 0:
        return "docker"
    return "/usr/bin/docker" if Path("/usr/bin/docker").exists() else shutil.which("docker")


@functools.cache
def _engine_problem() -> str | None:
    client = _client()
    if client is None:
        return "no Docker client (make docker-standin installs Debian's docker.io and starts dockerd)"
    try:
        info = subprocess.run([client, "version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"no Docker engine answers ({err})"
    if info.returncode != 0:
        why = (info.stderr.strip().splitlines() or ["no answer"])[-1][:160]
        return f"no Docker engine runs ({why}); make docker-standin starts one"
    if shutil.which("make") is None or not (ROOT / MODEL / "config.json").exists():
        return f"make or {MODEL} missing (make setup)"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(_engine_problem()), reason=_engine_problem() or "")]


@pytest.fixture(scope="module")
def pin() -> str:
    """The stand-in, pushed to the local registry: `<registry>/vllm-standin:<tag>@sha256:…`."""
    if shutil.which("debootstrap") is None:
        images = subprocess.run([_client(), "images", "-q", "eagle3build-standin-rootfs"], capture_output=True, text=True)
        if not images.stdout.strip():
            pytest.skip("the stand-in cannot be built: debootstrap is not installed (make docker-standin)")
    proc = subprocess.run(["docker/standin/build.sh"], cwd=ROOT, capture_output=True, text=True, timeout=3000,
                          env={**os.environ, "DOCKER": _client()})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


def make_vars(pin: str) -> list[str]:
    ref, digest = pin.rsplit("@", 1)
    image, tag = ref.rsplit(":", 1)
    return [f"DOCKER={_client()}", f"VLLM_IMAGE={image}", f"VLLM_TAG={tag}", f"VLLM_DIGEST={digest}",
            f"IMAGE={STANDIN_IMAGE}", "IMAGE_TAG=test", "DOCKER_GPUS=", "DOCKER_BUILD_NETWORK=host",
            *([f"PIP_CERT_FILE={CERT}"] if Path(CERT).exists() else [])]  # fmt: skip


def make(tree: Path, *args: str, caller: bool = False, timeout: float = 1800, popen: bool = False,
         env: dict | None = None, **kw):
    """make in `tree` (in `env`, else this environment); with `caller`, as the non-root caller (when run as
    root) holding the socket's group."""
    cmd = ["make", "--no-print-directory", *args]
    env = {**(os.environ if env is None else env)}
    if caller and os.getuid() == 0:
        sock_gid = os.stat("/var/run/docker.sock").st_gid
        cmd = ["setpriv", f"--reuid={CALLER[0]}", f"--regid={CALLER[1]}", f"--groups={sock_gid}", *cmd]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tree / ".home"), "LANG": "C.UTF-8"}
    if popen:
        return subprocess.Popen(cmd, cwd=tree, env=env, **kw)
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tree():
    # Under a folder every user can reach (the caller's container mounts it at the same path).
    dest = Path(tempfile.mkdtemp(prefix="e3-docker-", dir=os.environ.get("EAGLE3_DOCKER_TMP", "/var/tmp")))
    dest.chmod(0o755)
    copy_worktree(dest)
    (dest / ".home").mkdir()
    if os.getuid() == 0:
        subprocess.run(["chown", "-R", f"{CALLER[0]}:{CALLER[1]}", str(dest)], check=True)
    yield dest
    shutil.rmtree(dest, ignore_errors=True)


def test_pin_guard_stops_a_conflicting_requirement(pin, tmp_path):
    """openai 1.x contradicts vLLM 0.25's `openai>=2.0.0`; a requirement for vllm itself is refused."""
    for extra, expected in (("openai==1.0.0", "requirements.txt pins openai==1.0.0, but vllm requires openai>=2.0.0"),
                            ("vllm==0.0.1", "requirements.txt asks for vllm==0.0.1")):  # fmt: skip
        ctx = tmp_path / extra.split("=")[0]
        copy_worktree(ctx, with_model=False)
        (ctx / "requirements.txt").write_text((ROOT / "requirements.txt").read_text() + extra + "\n")
        proc = make(ctx, "-f", str(ctx / "mk/docker.mk"), "docker-build", *make_vars(pin), "IMAGE_TAG=pinguard")
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, out[-3000:]
        assert expected in out, out[-3000:]


def test_image_builds_on_the_standin_through_the_build_args(pin, tree):
    proc = make(tree, "docker-build", *make_vars(pin))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    client = _client()
    env = subprocess.run([client, "image", "inspect", "--format", "{{range .Config.Env}}{{println .}}{{end}}",
                          f"{STANDIN_IMAGE}:test"], capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert f"EAGLE3_IMAGE={pin}" in env.splitlines()
    # The build's CA bundle was a secret: no layer has it, no history line names it.
    history = subprocess.run([client, "history", "--no-trunc", f"{STANDIN_IMAGE}:test"], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    assert "PIP_CERT=" not in history.replace("PIP_CERT=/run/secrets/pip_cert", "")
    probe = subprocess.run([client, "run", "--rm", f"{STANDIN_IMAGE}:test", "bash", "-c",
                            "test ! -e /run/secrets/pip_cert && env | grep -i cert; python3 -m pip config list"],
                           capture_output=True, text=True)  # fmt: skip
    assert probe.returncode == 0 and "cert" not in probe.stdout.lower(), probe.stdout + probe.stderr


def test_demo_in_the_container_interrupted_resumed_and_shared_with_the_host(pin, tree):
    vars_ = make_vars(pin)
    log = (tree / ".home/run1.log").open("w")
    first = make(tree, "docker-run", *vars_, caller=True, popen=True, stdout=log, stderr=subprocess.STDOUT,
                 start_new_session=True)  # fmt: skip
    start = time.monotonic()
    hidden = tree / "build/hidden/demo"
    while first.poll() is None and not any(hidden.glob("*.safetensors")) and time.monotonic() - start < 1800:
        time.sleep(2)
    assert first.poll() is None, (tree / ".home/run1.log").read_text()[-4000:]
    os.killpg(first.pid, signal.SIGINT)  # Ctrl-C in the caller's terminal
    first.wait(timeout=300)
    for _ in range(60):  # the container stops with its client (--init forwards the signal, --rm removes it)
        running = subprocess.run([_client(), "ps", "-q", "--filter", f"ancestor={STANDIN_IMAGE}:test"],
                                 capture_output=True, text=True).stdout.strip()  # fmt: skip
        if not running:
            break
        time.sleep(2)
    assert not running, "the container outlived an interrupted make docker-run"
    assert not (tree / "build/export/eagle3/config.json").exists()

    resumed = make(tree, "docker-run", *vars_, caller=True, timeout=3000)
    text = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, text[-5000:]
    stats = job_stats(text)
    assert stats and not any(r.startswith(("split_", "tokens")) for r in stats), stats  # kept, not redone
    assert (tree / "build/export/eagle3/model.safetensors").is_file()
    assert (tree / "build/eval/demo_heldout.json").is_file()

    again = make(tree, "docker-run", *vars_, caller=True)
    assert again.returncode == 0 and nothing_planned(again.stdout + again.stderr), again.stdout[-3000:]
    dry = make(tree, "docker-dry-run", *vars_, caller=True)
    assert dry.returncode == 0 and nothing_planned(dry.stdout + dry.stderr), dry.stdout[-3000:]

    if os.getuid() == 0:
        foreign = [str(p) for part in ("build", ".snakemake") for p in [tree / part, *(tree / part).rglob("*")]
                   if p.lstat().st_uid != CALLER[0]]  # fmt: skip
        assert not foreign, foreign[:10]

    # The host's Python reads the container's records at the same path. Naming no image (EAGLE3_IMAGE unset,
    # as make leaves it), it claims no engine and takes the image each hidden shard records: it plans nothing.
    host_env = {k: v for k, v in os.environ.items() if k != "EAGLE3_IMAGE"}
    plain = make(tree, "dry-run", env=host_env)
    text = plain.stdout + plain.stderr
    assert plain.returncode == 0 and nothing_planned(text), text[-3000:]
    same = make(tree, "dry-run", f"EAGLE3_IMAGE={pin}", env=host_env)
    assert same.returncode == 0 and nothing_planned(same.stdout + same.stderr), (same.stdout + same.stderr)[-3000:]
    # Naming another image, the host is another engine: the extract rule's `image` param differs, so exactly
    # the extractions and what follows them would run again (docs/PRODUCTION.md, EAGLE3_IMAGE).
    other = make(tree, "dry-run", "EAGLE3_IMAGE=reg.local/other-vllm:v1", env=host_env)
    text = other.stdout + other.stderr
    assert other.returncode == 0, text[-3000:]
    assert job_stats(text) == {"extract": 3, "train": 1, "export": 1, "evaluate": 1, "all": 1}, text[-3000:]
    assert re.search(r"params have changed since last execution:\n\s+extract\n", text), text[-2000:]
