"""The engine image is pinned once, a user's EAGLE3_IMAGE reaches the workflow, and the image keeps its engine.

docker/base-image is the one home of the vLLM image pin (make, the Dockerfile's build args and the
workflow's container read it). docker/image_requirements.py decides what the image installs of
requirements.txt; its checks run here against vLLM 0.25.0's declared requirements, read from the wheel's
METADATA committed as docker/vllm-0.25.0-requires.txt (nothing is downloaded).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, SMOLLM2
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from test_docker_make import docker_command, env_flags
from workflow_util import copy_workflow

BASE_IMAGE = ROOT / "docker" / "base-image"
VLLM_REQUIRES = ROOT / "docker" / "vllm-0.25.0-requires.txt"
PIN = re.compile(r"^(?P<repo>[a-z0-9][\w./:-]*):(?P<tag>\w[\w.-]*)@sha256:[0-9a-f]{64}$")

# Where the image runs: the official vLLM image is linux x86_64 with CPython 3.12.
LINUX_X86_64_PY312 = {
    "implementation_name": "cpython", "implementation_version": "3.12.3", "os_name": "posix",
    "platform_machine": "x86_64", "platform_release": "", "platform_system": "Linux", "platform_version": "",
    "python_full_version": "3.12.3", "platform_python_implementation": "CPython", "python_version": "3.12",
    "sys_platform": "linux",
}  # fmt: skip
# What vllm/vllm-openai:v0.25.0 ships (../shared/docs/vllm-facts.md "Versions and pins").
IMAGE_VERSIONS = {"vllm": "0.25.0", "torch": "2.11.0+cu130", "transformers": "5.13.0"}


def load_script():
    spec = importlib.util.spec_from_file_location(
        "image_requirements", ROOT / "docker" / "image_requirements.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ir = load_script()


def vllm_declared() -> list[Requirement]:
    return ir.parse_requirements(VLLM_REQUIRES.read_text())


def project_requirements(*extra: str) -> list[Requirement]:
    return ir.parse_requirements((ROOT / "requirements.txt").read_text() + "".join(f"{e}\n" for e in extra))


def a_version(spec: SpecifierSet) -> str:
    """A version the specifier allows: its exact pin or lower bound."""
    bounds = [s.version for s in spec if s.operator in ("==", ">=", "~=")]
    version = bounds[0] if bounds else "1.0"
    assert spec.contains(version, prereleases=True), (spec, version)
    return version


def vllm_image_installed() -> dict[str, str]:
    """The v0.25.0 image as far as its metadata tells: vLLM and each package it requires on linux x86_64."""
    specs = ir.declared_specifiers(vllm_declared(), LINUX_X86_64_PY312)
    installed = {name: IMAGE_VERSIONS.get(name) or a_version(spec) for name, spec in specs.items()}
    installed["vllm"] = IMAGE_VERSIONS["vllm"]
    for name, spec in specs.items():
        assert spec.contains(installed[name], prereleases=True), name
    return installed


def freeze_text(installed: dict[str, str]) -> str:
    return "".join(f"{name}=={version}\n" for name, version in installed.items())


# ---- one pin, no unpinned fallback


def test_the_base_image_is_one_line_pinned_by_tag_and_digest():
    lines = BASE_IMAGE.read_text().splitlines()
    assert len(lines) == 1 and PIN.match(lines[0]) and PIN.match(lines[0])["tag"] != "latest", lines


def test_no_other_file_holds_the_pin_or_an_unpinned_image():
    digest = BASE_IMAGE.read_text().strip().split("@")[1]
    files = [ROOT / "Snakefile", ROOT / "Makefile", ROOT / "Dockerfile", *(ROOT / "rules").glob("*.smk"),
             *(ROOT / "mk").glob("*.mk"), *(ROOT / "configs").rglob("*.yaml"), ROOT / "config.yaml",
             *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]  # fmt: skip
    for path in files:
        text = path.read_text()
        assert digest not in text, f"{path} repeats the pin of docker/base-image"
        assert not re.search(r"vllm-openai:latest|docker://[^\s\"']*:latest", text), path


def test_the_dockerfile_installs_through_the_filter_never_requirements_txt_itself():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "-r requirements.txt" not in dockerfile
    plan = dockerfile.index("image_requirements.py plan")
    install = dockerfile.index(
        "pip install --no-cache-dir -c /tmp/image-constraints.txt -r /tmp/image-install.txt"
    )
    check = dockerfile.index("image_requirements.py check")
    assert plan < install < check


# ---- EAGLE3_IMAGE: the user's value reaches the workflow; make sets none


def recipe_env(*args: str, env: dict | None = None) -> str:
    """EAGLE3_IMAGE as a recipe of the project's Makefile (a host `make run`) sees it."""
    run_env = {k: v for k, v in os.environ.items() if k != "EAGLE3_IMAGE"} | (env or {})
    out = subprocess.run(
        ["make", "--no-print-directory", "--eval", 'show-image: ; @echo "[$$EAGLE3_IMAGE]"', "show-image", *args],
        cwd=ROOT, env=run_env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return out.strip()


def test_a_users_eagle3_image_reaches_host_runs_and_none_is_invented():
    assert recipe_env(env={"EAGLE3_IMAGE": "reg.local/vllm:v9@sha256:ab"}) == "[reg.local/vllm:v9@sha256:ab]"
    assert recipe_env("EAGLE3_IMAGE=reg.local/vllm:v8") == "[reg.local/vllm:v8]"
    assert recipe_env() == "[]"  # a host-built tree keeps its empty `image` param


def test_docker_run_passes_a_users_eagle3_image_else_the_image_keeps_its_own(monkeypatch):
    monkeypatch.delenv("EAGLE3_IMAGE", raising=False)
    assert "EAGLE3_IMAGE" not in env_flags(docker_command("docker-run"))
    assert "EAGLE3_IMAGE" in env_flags(
        docker_command("docker-run", env={"EAGLE3_IMAGE": "reg.local/vllm:v9"})
    )
    assert "EAGLE3_IMAGE" in env_flags(docker_command("docker-run", "EAGLE3_IMAGE=reg.local/vllm:v9"))


_EXTRACT_SCRIPT = """
import json, sys
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import ConfigSettings, DAGSettings, OutputSettings, Quietness, ResourceSettings

workdir, out = Path(sys.argv[1]), sys.argv[2]
with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
    workflow_api = api.workflow(snakefile=workdir / "Snakefile", workdir=workdir,
                                resource_settings=ResourceSettings(cores=1),
                                config_settings=ConfigSettings(configfiles=[Path("config.yaml")]))
    workflow_api.dag(DAGSettings(forceall=True))
    workflow = workflow_api._workflow
    workflow._prepare_dag(forceall=True, ignore_incomplete=True, lock_warn_only=True)
    workflow._build_dag()
    jobs = [job for job in workflow.dag.jobs if job.rule.name == "extract"]
    found = {(job.params.image, job.container_img_url) for job in jobs}
Path(out).write_text(json.dumps(sorted(found)))
"""


@pytest.mark.parametrize("user_image", [None, "reg.local/vllm:v9@sha256:ab"])
def test_the_workflow_param_is_the_users_image_and_the_container_is_always_pinned(tmp_path, user_image):
    if not SMOLLM2.exists():
        pytest.skip("models/SmolLM2-135M-Instruct is absent (run `make setup`)")
    wd = copy_workflow(tmp_path)
    for part in ("models", "data", "config.yaml"):
        os.symlink(ROOT / part, wd / part)
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3_IMAGE"}
    if user_image:
        env["EAGLE3_IMAGE"] = user_image
    out = tmp_path / "extract.json"
    proc = subprocess.run([sys.executable, "-c", _EXTRACT_SCRIPT, str(wd), str(out)], cwd=wd, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    pinned = BASE_IMAGE.read_text().strip()
    expected = [user_image, f"docker://{user_image}"] if user_image else ["", f"docker://{pinned}"]
    assert json.loads(out.read_text()) == [expected]


# ---- the image keeps its engine: what it installs of requirements.txt


def test_parsers_read_requirement_files_metadata_and_freezes():
    reqs = ir.parse_requirements("# c\nfoo==1.0  # why\n\nRequires-Dist: Bar>=2; extra == 'x'\n")
    assert [str(r) for r in reqs] == ["foo==1.0", 'Bar>=2; extra == "x"']
    with pytest.raises(ValueError, match="--index-url"):
        ir.parse_requirements("--index-url https://example.org\n")
    installed = ir.parse_installed(
        "PyYAML==6.0.2\ntorch==2.11.0+cu130\nvllm @ file:///w/vllm.whl\n-e git+x#egg=y\n"
    )
    assert installed == {"pyyaml": "6.0.2", "torch": "2.11.0+cu130", "vllm": None}


def test_every_project_requirement_is_an_exact_pin():
    for req in project_requirements():  # the checks below compare pinned versions
        assert ir.pinned_version(req), req


def test_the_filter_drops_what_the_vllm_image_provides_and_holds_it_as_constraints():
    installed = vllm_image_installed()
    plan = ir.plan(project_requirements(), installed, vllm_declared(), LINUX_X86_64_PY312)
    install = {canonicalize_name(r.name) for r in plan.install}
    kept = {canonicalize_name(r.name) for r, _ in plan.kept}
    assert {"transformers", "tokenizers", "safetensors", "sentencepiece", "pyyaml", "requests"} <= kept
    assert not install & set(installed) and "snakemake" in install and "accelerate" in install
    for pin in ("vllm==0.25.0", "torch==2.11.0+cu130", "transformers==5.13.0", "torchvision==0.26.0"):
        assert pin in plan.constraints
    assert len(plan.constraints) == len(installed)
    notes = ir.kept_notes(plan.kept)  # the image's transformers wins over requirements.txt's pin
    assert "keeping the image's transformers 5.13.0 (requirements.txt: transformers==5.23.0)" in notes


@pytest.mark.parametrize("image", ["vllm image", "vllm alone"])
def test_the_requirements_the_image_installs_satisfy_vllm_0_25_0s_declared_requirements(image):
    # "vllm alone": an image lacking every vLLM dependency, so every project pin is installed and checked.
    installed = vllm_image_installed() if image == "vllm image" else {"vllm": "0.25.0"}
    plan = ir.plan(project_requirements(), installed, vllm_declared(), LINUX_X86_64_PY312)
    declared = ir.declared_specifiers(vllm_declared(), LINUX_X86_64_PY312)
    assert "transformers" in declared and "bench" not in str(declared.get("matplotlib", ""))
    for req in plan.install:
        spec = declared.get(canonicalize_name(req.name))
        if spec is not None:
            assert spec.contains(ir.pinned_version(req), prereleases=True), (req, spec)


def test_markers_and_extras_that_do_not_apply_are_ignored():
    declared = ir.declared_specifiers(vllm_declared(), LINUX_X86_64_PY312)
    assert "matplotlib" not in declared and "datasets" not in declared  # extra == "bench"
    assert str(declared["torch"]) == "==2.11.0" and "llguidance" in declared and "six" in declared
    on_311 = ir.declared_specifiers(vllm_declared(), LINUX_X86_64_PY312 | {"python_version": "3.11"})
    assert "six" not in on_311  # python_version > "3.11"


def test_a_newer_vllm_capping_transformers_below_the_project_pin_still_builds():
    # vLLM 0.34 declares transformers<5.23; requirements.txt pins 5.23.0: the image's own version is kept.
    declared = [*vllm_declared(), Requirement("transformers<5.23")]
    installed = vllm_image_installed() | {"transformers": "5.22.0"}
    plan = ir.plan(project_requirements(), installed, declared, LINUX_X86_64_PY312)
    assert "transformers==5.22.0" in plan.constraints
    assert "transformers" not in {canonicalize_name(r.name) for r in plan.install}


@pytest.mark.parametrize(
    "line, installed, name",
    [("vllm==0.0.1", "vllm image", "vllm"), ("torch==1.0", "vllm alone", "torch")],
)
def test_a_pin_against_the_engine_is_refused_naming_the_package(line, installed, name):
    have = vllm_image_installed() if installed == "vllm image" else {"vllm": "0.25.0"}
    with pytest.raises(ir.PinConflict, match=rf"requirements.txt (asks for|pins) {name}==") as err:
        ir.plan(project_requirements(line), have, vllm_declared(), LINUX_X86_64_PY312)
    assert name in str(err.value).splitlines()[0]


def test_the_plan_command_writes_both_files_or_refuses(tmp_path, capsys):
    (tmp_path / "freeze.txt").write_text(freeze_text({"vllm": "0.25.0", "torch": "2.11.0+cu130"}))
    (tmp_path / "req.txt").write_text("snakemake==9.27.1\ntorch==2.10.0\n")
    args = ["plan", "--requirements", str(tmp_path / "req.txt"), "--installed", str(tmp_path / "freeze.txt"),
            "--engine-requires", str(VLLM_REQUIRES), "--install-out", str(tmp_path / "install.txt"),
            "--constraints-out", str(tmp_path / "constraints.txt")]  # fmt: skip
    assert ir.main(args) == 0
    assert (tmp_path / "install.txt").read_text() == "snakemake==9.27.1\n"
    assert (tmp_path / "constraints.txt").read_text() == "torch==2.11.0+cu130\nvllm==0.25.0\n"
    assert (
        "keeping the image's torch 2.11.0+cu130 (requirements.txt: torch==2.10.0)" in capsys.readouterr().err
    )
    (tmp_path / "req.txt").write_text("snakemake==9.27.1\nvllm==0.0.1\n")
    assert ir.main(args) == 1
    assert "error: requirements.txt asks for vllm==0.0.1" in capsys.readouterr().err


def test_the_check_command_fails_only_on_problems_the_install_added(tmp_path, capsys):
    base = "mistral-common 1.11.5 requires pillow>=10.0, which is not installed.\n"
    added = "vllm 0.25.0 has requirement transformers<5.18, but you have transformers 5.23.0.\n"
    (tmp_path / "before.txt").write_text(base)
    (tmp_path / "after.txt").write_text(base)
    args = ["check", "--before", str(tmp_path / "before.txt"), "--after", str(tmp_path / "after.txt")]
    assert ir.main(args) == 0
    (tmp_path / "after.txt").write_text(base + added)
    assert ir.main(args) == 1
    err = capsys.readouterr().err
    assert f"the project's requirements break the image: {added.strip()}" in err and "mistral" not in err
