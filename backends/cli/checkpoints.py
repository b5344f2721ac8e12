"""Real checkpoints for `disagg models prepare`: the prefill side's HF folder as vLLM loads it (FP8, NVFP4, MXFP4),
the decode side's MLX folder (given, or converted by mlx-lm's own converter to 4 or 8 bit); both must share the
model fingerprint (geometry + tokenizer), and each side's quantization is reported."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kv_bridge.fingerprint import model_fingerprint, model_quantization

if TYPE_CHECKING:  # tqdm comes with the `models` extra; the gateway box's `--role gateway` needs no bar
    from tqdm import tqdm

WEIGHT_GLOBS = ("*.safetensors", "*.safetensors.index.json")
# Hub repos ship more than the HF folder vLLM and mlx-lm load: gpt-oss-120b adds original/ (its own format) and
# metal/ (a reference kernel's weights), each as large as the model (~195 GB instead of ~65 GB). Never fetched.
DOWNLOAD_IGNORE = ["original/*", "metal/*", "*.gguf", "*.pth", "*.pt", "pytorch_model*.bin", "*.msgpack", "*.h5",
                   "onnx/*", "*.onnx"]
# What the gateway box reads of a model (tokenizer, chat template, config.json for the reasoning/tool parsers and
# /api/show): copied as real files, so the folder also works inside the gateway container.
GATEWAY_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "chat_template.json"]


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
        snapshot_download(source, local_dir=str(dest), ignore_patterns=DOWNLOAD_IGNORE)
    except Exception as e:  # no network, no access, gated model
        raise CheckpointError(f"cannot download {source}: {e}; copy the folder here and pass its path") from None
    return dest


def prepare_gateway(model_id: str, dest: Path, source: str) -> Path:
    """The gateway's folder for `model_id`: GATEWAY_FILES only, copied (from a local folder) or downloaded."""
    src = Path(source).expanduser()
    dest.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        for name in GATEWAY_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, dest / name)  # follows links: a real file, readable in a container
    else:
        if source.startswith((".", "/", "~")) or source.count("/") != 1:
            raise CheckpointError(f"{source} is neither a folder here nor a hub id (owner/name)")
        try:
            from huggingface_hub import snapshot_download

            snapshot_download(source, local_dir=str(dest), allow_patterns=GATEWAY_FILES)
        except ImportError:
            raise CheckpointError("downloading needs huggingface_hub: pip install 'disagg[models]'") from None
        except Exception as e:  # no network, no access, gated model
            raise CheckpointError(f"cannot download {source}: {e}; copy its tokenizer files here") from None
    missing = [n for n in ("config.json", "tokenizer.json") if not (dest / n).is_file()]
    if not (dest / "chat_template.jinja").is_file() and "chat_template" not in _json(dest / "tokenizer_config.json"):
        missing.append("a chat template (chat_template.jinja or tokenizer_config.json's chat_template)")
    if missing:
        raise CheckpointError(f"{model_id}: {source} lacks {', '.join(missing)}; the gateway needs them")
    return dest


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


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


def other_side(role: str, against: str | Path) -> Side:
    """`--against`: the other side's folder, the gateway's copy of the model (config.json and tokenizer, a few MB:
    comparing fingerprints needs no weights, so a Mac need not hold the 65 GB prefill checkpoint), or a fingerprint
    string as `disagg doctor` and `models prepare` print it (16 hex digits)."""
    other = "prefill" if role == "decode" else "decode"
    text = str(against)
    if re.fullmatch(r"[0-9a-f]{16}", text):
        return Side(other, Path("(the fingerprint given)"), "-", text)
    folder = Path(text).expanduser()
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"--against {text}: neither a folder with config.json nor a fingerprint (16 hex "
                              f"digits, as `disagg doctor` prints it on the other machine)")
    if any(any(folder.glob(g)) for g in WEIGHT_GLOBS):
        return side(other, folder)
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"--against {folder}: no tokenizer.json; the fingerprint covers the tokenizer")
    return Side("gateway", folder, "(no weights: config and tokenizer)", model_fingerprint(str(folder)))


def prepare(model_id: str, dest: Path, role: str, hf: str | None = None, mlx: str | None = None,
            bits: int | None = None, against: str | Path | None = None) -> list[Side]:
    """Put `model_id`'s folder for `role` (prefill | decode) at `dest`; verify it against the other side's folder
    (`against`, or the HF source when converting) and return both sides for the report."""
    steps = ["fetch", "convert", "verify"] if role == "decode" and bits else ["fetch", "verify"]
    downloaded = None
    sides: list[Side] = []
    from tqdm import tqdm

    with tqdm(total=len(steps), desc=f"prepare {model_id} ({role})", unit="step") as bar:
        if role == "prefill":
            if hf is None and not (dest / "config.json").is_file():
                raise CheckpointError(f"{model_id}: pass --hf FOLDER_OR_HUB_ID (the checkpoint vLLM loads)")
            folder = fetch(hf, dest, bar) if hf else dest
            bar.update()
        elif bits:
            if hf is None:
                raise CheckpointError(f"{model_id}: --bits converts an HF checkpoint: pass --hf FOLDER_OR_HUB_ID")
            local = Path(hf).expanduser().is_dir()
            src = Path(hf) if local else fetch(hf, dest.with_name(dest.name + ".hf"), bar)
            downloaded = None if local else src  # removed once converted and verified: ~60 GB of bf16 for Qwen
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
            sides.append(other_side(role, against))
        bar.update()
    if len(sides) == 2 and sides[0].fingerprint != sides[1].fingerprint:
        raise CheckpointError(f"{model_id}: fingerprints differ ({sides[0].fingerprint} vs {sides[1].fingerprint}): "
                              f"the two sides disagree on attention geometry or tokenizer, so KV cannot cross; "
                              f"convert the decode side from the same checkpoint\n" + "\n".join(s.line() for s in sides))
    if role == "decode" and bits and downloaded is not None:
        shutil.rmtree(downloaded, ignore_errors=True)
        sides[-1].folder = Path(f"{downloaded} (removed after conversion)")
    return sides


def tokenizer_differences(draft: Path, target: Path) -> list[str]:
    """What differs between two folders' tokenizers, by their files: tokenizer.json's model (vocabulary, merges) and
    added tokens (id and text), and the EOS the configs name. Empty: a draft can propose the target's token ids."""
    out = []
    a, b = _json(draft / "tokenizer.json"), _json(target / "tokenizer.json")
    if not a or not b:
        return [f"no tokenizer.json in {draft if not a else target}"]
    if a.get("model") != b.get("model"):
        va, vb = (a.get("model") or {}).get("vocab") or {}, (b.get("model") or {}).get("vocab") or {}
        out.append(f"tokenizer.json model differs ({len(va)} vs {len(vb)} tokens in the vocabulary)")
    added = [{t.get("id"): t.get("content") for t in x.get("added_tokens") or []} for x in (a, b)]
    shared = set(added[0]) & set(added[1])
    clash = sorted(i for i in shared if added[0][i] != added[1][i])
    if clash:
        out.append(f"added tokens differ at ids {clash[:5]}")
    return out


def prepare_draft(model_id: str, dest: Path, target: Path, hf: str | None = None, mlx: str | None = None,
                  bits: int | None = None) -> Side:
    """The draft model's MLX folder at `dest` (fetched, or converted from `hf`), refused unless its tokenizer files
    match the target's decode folder (`target`)."""
    if not (target / "tokenizer.json").is_file():
        raise CheckpointError(f"{model_id}: prepare the decode side first ({target} has no tokenizer.json)")
    if bits:
        if hf is None:
            raise CheckpointError(f"{model_id}: --bits converts an HF checkpoint: pass --hf FOLDER_OR_HUB_ID")
        src = Path(hf) if Path(hf).expanduser().is_dir() else fetch(hf, dest.with_name(dest.name + ".hf"))
        folder = convert(src, dest, bits)
    elif mlx is not None:
        folder = fetch(mlx, dest)
    elif (dest / "config.json").is_file():
        folder = dest
    else:
        raise CheckpointError(f"{model_id}: pass --mlx FOLDER_OR_HUB_ID (or --hf SRC --bits 4) for the draft")
    diff = tokenizer_differences(folder, target)
    if diff:
        raise CheckpointError(f"{model_id}: the draft at {folder} has a different tokenizer from {target}: "
                              + "; ".join(diff) + ": a draft must propose the target's token ids")
    return side("draft", folder)
