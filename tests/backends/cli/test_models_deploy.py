"""`disagg models prepare` as a site admin runs it: downloads skip what neither engine loads (gpt-oss's original/ and
metal/), `--role gateway` copies only the tokenizer, template and config.json as real files (no links that dangle in a
container), and an unwritable model path is a clear error, not a traceback."""

from __future__ import annotations

from pathlib import Path

from tests.support.stack import MODEL_DIR, MODEL_ID
from tests.support.cli import run, write

# openai/gpt-oss-120b's files as published on the hub (main): the HF folder at the top, plus original/ and metal/
GPT_OSS_120B = ([".gitattributes", "LICENSE", "README.md", "USAGE_POLICY", "chat_template.jinja", "config.json",
                 "generation_config.json", "model.safetensors.index.json", "special_tokens_map.json", "tokenizer.json",
                 "tokenizer_config.json", "metal/model.bin", "original/config.json", "original/dtypes.json"]
                + [f"model-{i:05d}-of-00014.safetensors" for i in range(15)]
                + [f"original/model--{i:05d}-of-00007.safetensors" for i in range(1, 8)])


def test_downloads_skip_original_and_metal():
    """The patterns as huggingface_hub's snapshot_download applies them (its own filter function)."""
    from huggingface_hub.utils import filter_repo_objects

    from backends.cli.checkpoints import DOWNLOAD_IGNORE, GATEWAY_FILES

    kept = set(filter_repo_objects(GPT_OSS_120B, ignore_patterns=DOWNLOAD_IGNORE))
    assert not {f for f in kept if f.startswith(("original/", "metal/"))}
    assert {f"model-{i:05d}-of-00014.safetensors" for i in range(15)} <= kept
    assert {"config.json", "tokenizer.json", "chat_template.jinja", "model.safetensors.index.json"} <= kept
    gateway = set(filter_repo_objects(GPT_OSS_120B, allow_patterns=GATEWAY_FILES))
    assert gateway == {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                       "special_tokens_map.json", "chat_template.jinja"}


def _config(tmp_path: Path, model_path: Path) -> Path:
    return write(tmp_path, f"""
[[nodes]]
name = "decode-0"
role = "decode"
port = 8200
kv_port = 8201

[[models]]
id = "{MODEL_ID}"
path = "{model_path}"
decode = ["decode-0"]
""", "config.toml")


def test_gateway_role_copies_real_tokenizer_files(tmp_path):
    from gateway.text.tokenizer import ChatTokenizer

    linked = tmp_path / "src"  # a folder of links, as `models prepare --role prefill` leaves a local checkpoint
    linked.mkdir()
    for p in MODEL_DIR.iterdir():
        (linked / p.name).symlink_to(p.resolve())
    dest = tmp_path / "gw" / "smollm2"
    r = run("models", "prepare", "--config", str(_config(tmp_path, dest)), "--model", MODEL_ID, "--role", "gateway",
            "--hf", str(linked), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted(p.name for p in dest.iterdir())
    assert files == ["chat_template.jinja", "config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json"]
    assert not [p for p in dest.iterdir() if p.is_symlink()]
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ours, full = ChatTokenizer.from_folder(dest), ChatTokenizer.from_folder(MODEL_DIR)
    assert ours.encode_chat(msgs) == full.encode_chat(msgs) and ours.model_type == "llama"


def test_gateway_role_refuses_a_folder_without_tokenizer(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    r = run("models", "prepare", "--config", str(_config(tmp_path, tmp_path / "gw")), "--model", MODEL_ID, "--role",
            "gateway", "--hf", str(src), cwd=tmp_path)
    assert r.returncode == 1 and "lacks tokenizer.json" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_unwritable_model_path_is_a_clear_error(tmp_path):
    """As /srv on macOS (a read-only system volume): the message says what to do instead of a traceback."""
    r = run("models", "prepare", "--config", str(_config(tmp_path, Path("/proc/disagg/models/smollm2"))),
            cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "cannot write the model folder" in r.stderr and "/opt/disagg" in r.stderr
