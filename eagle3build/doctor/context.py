"""What every preflight check reads and returns: the config with what earlier checks loaded, and a result."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3build.config import section_defaults, section_schema

GB = 1e9


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "skip" | "fail"
    detail: str
    fix: str = ""

    def __str__(self) -> str:
        line = f"[{self.status:^4}] {self.name}: {self.detail}"
        return line + (f"\n       fix: {self.fix}" if self.fix else "")


@dataclass
class Context:
    """The config plus what earlier checks loaded (target config, tokenizer) for later ones."""

    config: dict
    target_config: dict | None = None  # the text model's config.json
    full_config: dict | None = None
    tokenizer: object | None = None

    def section(self, name: str) -> dict:
        """A config section over the schema's defaults. Not validated: a check reports a bad value itself."""
        return {**section_defaults(name), **(self.config.get(name) or {})}

    @property
    def output_root(self) -> Path:
        return Path(self.config.get("output_root") or section_schema("output_root")["default"])

    @property
    def target(self) -> dict:
        return self.config.get("target") or {}

    @property
    def extract(self) -> dict:
        return self.section("extract")

    @property
    def vllm(self) -> dict:
        return {**section_defaults("extract.vllm"), **(self.extract["vllm"] or {})}

    @property
    def backend(self) -> str:
        return self.extract["backend"]

    @property
    def max_length(self) -> int:
        return int(self.section("prepare")["max_length"])

    @property
    def model(self) -> str:
        return str(self.target.get("model", ""))

    @property
    def is_local(self) -> bool:
        return Path(self.model).exists()

    @property
    def trust(self) -> bool:
        return self.target.get("trust_remote_code") is True

    @property
    def revision(self) -> str | None:
        return self.target.get("revision")
