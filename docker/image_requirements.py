"""Which of the project's requirements the image installs, and what holds the engine image fixed.

The image is the serving engine's own image (docker/base-image) plus this project. Its torch, transformers,
vLLM and everything else it already has were built and tested together, so the project never replaces
them: a requirement whose package the image has is skipped (the image's version is kept, with a note when
requirements.txt asks for another one), every installed package becomes a constraint at its installed
version, and only the rest is installed. Before that, the requirements to install are checked against
what the engine declares (its Requires-Dist), and after it, `pip check` may report no new problem.

    image_requirements.py plan --requirements requirements.txt --installed freeze.txt \
        --install-out install.txt --constraints-out constraints.txt [--engine vllm] [--engine-requires FILE]
    image_requirements.py check --before pip-check-before.txt --after pip-check-after.txt

`--installed` is `pip list --format=freeze` of the image; `--engine-requires` (Requires-Dist lines; by
default the installed engine's own metadata) is what the engine declares.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ENGINE = "vllm"


class PinConflict(Exception):
    """The project's requirements disagree with the engine image; the message names each package."""


@dataclass
class Plan:
    install: list[Requirement]  # the project's requirements the image does not have
    constraints: list[str]  # name==version of every installed package
    kept: list[tuple[Requirement, str | None]]  # requirement, the image's version (kept instead)


def parse_requirements(text: str) -> list[Requirement]:
    """Requirement lines (a requirements file, or Requires-Dist lines of a wheel's METADATA)."""
    reqs = []
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            raise ValueError(f"pip options are not supported here: {line!r}")
        reqs.append(Requirement(line.removeprefix("Requires-Dist:").strip()))
    return reqs


def parse_installed(text: str) -> dict[str, str | None]:
    """canonical name -> installed version, from `pip list --format=freeze` (or `pip freeze`)."""
    installed: dict[str, str | None] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", "-")):
            continue
        if " @ " in line:  # a direct-URL install: the name is known, the version is not
            installed[canonicalize_name(line.split(" @ ", 1)[0])] = None
        else:
            name, _, version = line.partition("==")
            installed[canonicalize_name(name)] = version.strip() or None
    return installed


def declared_specifiers(declared: list[Requirement], environment: dict[str, str]) -> dict[str, SpecifierSet]:
    """canonical name -> the specifiers the engine declares for it where `environment` applies them."""
    env = {**environment, "extra": ""}  # extras of the engine are not installed in its image
    specs: dict[str, SpecifierSet] = {}
    for req in declared:
        if req.marker is None or req.marker.evaluate(env):
            name = canonicalize_name(req.name)
            specs[name] = specs.get(name, SpecifierSet()) & req.specifier
    return specs


def pinned_version(req: Requirement) -> str | None:
    """X of a requirement `name==X` (no wildcard), else None."""
    pins = [s.version for s in req.specifier if s.operator in ("==", "===") and not s.version.endswith("*")]
    return pins[0] if len(pins) == 1 else None


def conflicts(
    requirements: list[Requirement],
    install: list[Requirement],
    declared: list[Requirement],
    environment: dict[str, str],
    engine: str = ENGINE,
) -> list[str]:
    """Why the project's requirements cannot go into the engine's image (empty: they can)."""
    problems = [
        f"requirements.txt asks for {req}: {engine} is the engine the image is built on (docker/base-image),"
        " the project's requirements may not choose it"
        for req in requirements
        if canonicalize_name(req.name) == canonicalize_name(engine)
    ]
    specs = declared_specifiers(declared, environment)
    for req in install:
        spec = specs.get(canonicalize_name(req.name))
        version = pinned_version(req)
        if spec is not None and version is not None and not spec.contains(version, prereleases=True):
            problems.append(f"requirements.txt pins {req}, but {engine} requires {req.name}{spec}")
    return problems


def plan(
    requirements: list[Requirement],
    installed: dict[str, str | None],
    declared: list[Requirement],
    environment: dict[str, str],
    engine: str = ENGINE,
) -> Plan:
    """Split the project's requirements into what to install and what the image keeps; raise PinConflict."""
    install = [r for r in requirements if canonicalize_name(r.name) not in installed]
    problems = conflicts(requirements, install, declared, environment, engine)
    if problems:
        raise PinConflict("\n".join(problems))
    kept = [(r, installed[name]) for r in requirements if (name := canonicalize_name(r.name)) in installed]
    constraints = sorted(f"{name}=={version}" for name, version in installed.items() if version)
    return Plan(install, constraints, kept)


def kept_notes(kept: list[tuple[Requirement, str | None]]) -> list[str]:
    """One line for each requirement the image's own version does not meet (the image's version wins)."""
    return [
        f"keeping the image's {req.name} {version or '(unknown version)'} (requirements.txt: {req})"
        for req, version in kept
        if version is None or not req.specifier.contains(version, prereleases=True)
    ]


def new_problems(before: str, after: str) -> list[str]:
    """`pip check` lines after the install that were not there before (the base image's own are tolerated)."""
    seen = {line.strip() for line in before.splitlines()}
    return [line.strip() for line in after.splitlines() if line.strip() and line.strip() not in seen]


def engine_requires(engine: str, path: str | None) -> list[Requirement]:
    """The engine's Requires-Dist: from `path`, else from the engine installed in this Python."""
    if path:
        return parse_requirements(Path(path).read_text())
    return [Requirement(line) for line in metadata.requires(engine) or []]


def main_plan(args: argparse.Namespace) -> None:
    result = plan(
        parse_requirements(Path(args.requirements).read_text()),
        parse_installed(Path(args.installed).read_text()),
        engine_requires(args.engine, args.engine_requires),
        default_environment(),
        args.engine,
    )
    for note in kept_notes(result.kept):
        print(note, file=sys.stderr)
    Path(args.install_out).write_text("".join(f"{r}\n" for r in result.install))
    Path(args.constraints_out).write_text("".join(f"{c}\n" for c in result.constraints))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="write the requirements to install and the constraints")
    p.add_argument("--requirements", required=True)
    p.add_argument("--installed", required=True, help="`pip list --format=freeze` of the image")
    p.add_argument("--engine", default=ENGINE)
    p.add_argument("--engine-requires", help="Requires-Dist lines (default: the installed engine's)")
    p.add_argument("--install-out", required=True)
    p.add_argument("--constraints-out", required=True)
    c = sub.add_parser("check", help="fail on `pip check` problems the install added")
    c.add_argument("--before", required=True)
    c.add_argument("--after", required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "plan":
            main_plan(args)
            return 0
        added = new_problems(Path(args.before).read_text(), Path(args.after).read_text())
        if added:
            raise PinConflict("\n".join(f"the project's requirements break the image: {p}" for p in added))
    except PinConflict as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
