"""Real checkpoints for `disagg models prepare`: the prefill side's HF folder as vLLM loads it (FP8, NVFP4, MXFP4),
the decode side's MLX folder (given, or converted by mlx-lm's own converter to 4 or 8 bit); both must share the
model fingerprint (geometry + tokenizer), and each side's quantization is reported."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from kv_bridge.fingerprint import model_fingerprint, model_quantization

WEIGHT_GLOBS = ("*.safetensors", "*.safetensors.index.json")


class CheckpointError(RuntimeError):
    """A checkpoint cannot serve its side; the message says what is missing and how to get it."""


@dataclass
class Side:
    role: str
    folder: Path
    quantization: str
    fingerprint: str

    def line(self) -> str:
        return f"  {self.role:<8} {self.quantization:<24} fingerprint {self.fingerprint}  {self.folder}"


def fetch(source: str, dest: Path, bar: tqdm | None = None) -> Path:
    """A local folder is linked at `dest` (checkpoints are large); anything else is a hub id, downloaded there."""
    src = Path(source).expanduser()
    if src.is_dir():
        if dest.resolve() != src.resolve():
            if dest.is_symlink() or dest.exists():
                raise CheckpointError(f"{dest} already exists and is not {src}; remove it or point [[models]] path "
                                      f"at {src}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.symlink_to(src.resolve(), target_is_directory=True)
        return dest
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise CheckpointError(f"{source} is neither a folder here nor a hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError("downloading needs huggingface_hub: pip install 'disagg[models]'") from None
    if bar is not None:
        bar.set_postfix_str(f"download {source}")
    try:
        snapshot_download(source, local_dir=str(dest))
    except Exception as e:  # no network, no access, gated model
        raise CheckpointError(f"cannot download {source}: {e}; copy the folder here and pass its path") from None
    return dest


def check_hf(folder: Path) -> list[str]:
    """What keeps vLLM (or mlx-lm) from loading `folder`: config, weights, tokenizer, chat template."""
    problems = [] if (folder / "config.json").is_file() else ["no config.json"]
    if not any(any(folder.glob(g)) for g in WEIGHT_GLOBS):
        problems.append("no *.safetensors weights")
    if not (folder / "tokenizer.json").is_file():
        problems.append("no tokenizer.json (the fingerprint and the gateway need it)")
    return problems


def convert(hf: Path, dest: Path, bits: int, group_size: int = 64) -> Path:
    """mlx-lm's own converter: `hf` quantized to `bits` (4 or 8) at `dest`, built beside it and renamed into place."""
    if bits not in (4, 8):
        raise CheckpointError(f"--bits must be 4 or 8, got {bits}")
    from mlx_lm import convert as mlx_convert

    tmp = dest.with_name(f".{dest.name}.convert-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        mlx_convert(str(hf), str(tmp), quantize=True, q_bits=bits, q_group_size=group_size)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"mlx-lm could not convert {hf}: {type(e).__name__}: {e}") from None
    if dest.is_symlink():
        dest.unlink()
    elif dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest


def side(role: str, folder: Path) -> Side:
    problems = check_hf(folder)
    if problems:
        raise CheckpointError(f"{role} checkpoint {folder}: {'; '.join(problems)}")
    return Side(role, folder, model_quantization(folder), model_fingerprint(str(folder)))


def prepare(model_id: str, dest: Path, role: str, hf: str | None = None, mlx: str | None = None,
            bits: int | None = None, against: Path | None = None) -> list[Side]:
    """Put `model_id`'s folder for `role` (prefill | decode) at `dest`; verify it against the other side's folder
    (`against`, or the HF source when converting) and return both sides for the report."""
    steps = ["fetch", "convert", "verify"] if role == "decode" and bits else ["fetch", "verify"]
    sides: list[Side] = []
    with tqdm(total=len(steps), desc=f"prepare {model_id} ({role})", unit="step") as bar:
        if role == "prefill":
            if hf is None and not (dest / "config.json").is_file():
                raise CheckpointError(f"{model_id}: pass --hf FOLDER_OR_HUB_ID (the checkpoint vLLM loads)")
            folder = fetch(hf, dest, bar) if hf else dest
            bar.update()
        elif bits:
            if hf is None:
                raise CheckpointError(f"{model_id}: --bits converts an HF checkpoint: pass --hf FOLDER_OR_HUB_ID")
            src = Path(hf) if Path(hf).expanduser().is_dir() else fetch(hf, dest.with_name(dest.name + ".hf"), bar)
            bar.update()
            bar.set_postfix_str(f"mlx-lm convert {bits}-bit")
            folder = convert(src, dest, bits)
            against = against or src
            bar.update()
        else:
            if mlx is None and not (dest / "config.json").is_file():
                raise CheckpointError(f"{model_id}: pass --mlx FOLDER_OR_HUB_ID, or --hf SRC --bits 4|8 to convert")
            folder = fetch(mlx, dest, bar) if mlx else dest
            bar.update()
        bar.set_postfix_str("verify")
        sides.append(side(role, folder))
        if against is not None:
            sides.append(side("prefill" if role == "decode" else "decode", Path(against)))
        bar.update()
    if len(sides) == 2 and sides[0].fingerprint != sides[1].fingerprint:
        raise CheckpointError(f"{model_id}: fingerprints differ ({sides[0].fingerprint} vs {sides[1].fingerprint}): "
                              f"the two sides disagree on attention geometry or tokenizer, so KV cannot cross; "
                              f"convert the decode side from the same checkpoint\n" + "\n".join(s.line() for s in sides))
    return sides
