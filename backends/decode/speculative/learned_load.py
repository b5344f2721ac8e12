"""Loading a learned drafter for a decode model: its folder checked against the target's config (`check_folder`,
what `disagg models prepare --role draft` runs), the drafter loaded beside the target wrapped to hand out hidden
states (`load_learned`), and one generation's draft source (`make_source`). Apart from learned.py, which the drafter
modules import, so no import runs in a circle."""

from __future__ import annotations

from backends.decode.speculative.learned import LEARNED


def target_from_config(cfg: dict) -> dict:
    """hidden.target_args' fields from a decode folder's config.json (no model loaded)."""
    cfg = cfg.get("text_config", cfg)
    return {"model_type": cfg.get("model_type"), "hidden_size": cfg["hidden_size"], "vocab_size": cfg["vocab_size"],
            "num_hidden_layers": cfg["num_hidden_layers"], "rope_theta": float(cfg.get("rope_theta", 10000.0)),
            "rope_scaling": cfg.get("rope_scaling"), "max_position_embeddings": cfg.get("max_position_embeddings")}


def _tensor_names(folder) -> set[str]:
    """The tensor names in a folder's safetensors files, from their JSON headers (no weights read)."""
    import json
    import struct

    names: set[str] = set()
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            names.update(k for k in json.loads(fh.read(n)) if k != "__metadata__")
    return names


def check_folder(method: str, folder, target_folder) -> str:
    """Check the drafter in `folder` against the decode model's config.json in `target_folder` without loading
    either (ValueError naming the field); a one-line summary."""
    import json
    from pathlib import Path

    folder, target_folder = Path(folder), Path(target_folder)
    try:
        cfg = json.loads((folder / "config.json").read_text())
        target = target_from_config(json.loads((target_folder / "config.json").read_text()))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read the drafter's or the model's config.json: {e}") from None
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"{folder}: no *.safetensors")
    if method == "eagle3":
        from backends.decode.speculative.eagle3 import Eagle3Config

        c = Eagle3Config.from_dict(cfg)
        c.check(target, any(n.endswith("embed_tokens.weight") for n in _tensor_names(folder)), str(folder))
        return (f"EAGLE-3 head over layers {c.aux_layers(target)}, draft vocabulary {c.draft_vocab_size}, "
                f"KV {2 * c.num_key_value_heads * c.head_dim} values a token")
    from backends.decode.speculative.dflash import DFlashConfig

    d = DFlashConfig.from_dict(cfg)
    d.check(target, str(folder))
    return (f"DFlash drafter over layers {d.target_layer_ids}, block {d.block_size}, {d.num_hidden_layers} layers, "
            f"KV {2 * d.num_hidden_layers * d.num_key_value_heads * d.head_dim} values a token")


def load_learned(method: str, path: str, model):
    """(the target wrapped to hand out the hidden states the drafter reads, the drafter); ValueError at start-up
    for a drafter that does not fit the model."""
    from backends.decode.speculative.hidden import HiddenTap, target_args

    target = target_args(model)
    if method == "eagle3":
        from backends.decode.speculative.eagle3 import load_eagle3

        head = load_eagle3(path, target)
        return HiddenTap(model, head.cfg.aux_layers(target)), head
    if method == "dflash":
        from backends.decode.speculative.dflash import load_dflash

        drafter = load_dflash(path, target)
        return HiddenTap(model, [i + 1 for i in drafter.cfg.target_layer_ids]), drafter  # DFlash reads layer outputs
    raise ValueError(f"unknown learned drafter {method!r} (known: {', '.join(LEARNED)})")


def make_source(method: str, drafter, tap, seq: list[int], target_cache: list):
    """The draft source of one speculative generation (its own drafter cache, fed from `target_cache`'s forwards)."""
    if method == "eagle3":
        from backends.decode.speculative.eagle3_source import Eagle3Source

        return Eagle3Source(drafter, tap, seq, target_cache)
    from backends.decode.speculative.dflash import DFlashSource

    return DFlashSource(drafter, tap, seq, target_cache)
