"""Helpers for parser tests: family tokenizers in a temp folder, and model text streamed as the decode node streams
it (token ids through mlx-lm's streaming detokenizer) or as an upstream might (arbitrary text chunks)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tests.support.tiny_models import write_family_tokenizer


def family_tokenizers(family: str, root: str) -> tuple:
    """(transformers tokenizer, mlx-lm TokenizerWrapper) for `family`, written under `root` by the first caller.

    Loaded once per process, not per root: a family's folder is the same wherever it is written (loading both took
    a second or two, in every test that wants a reference)."""
    return _family_tokenizers(family, root if family not in _ROOTS else _ROOTS[family])


_ROOTS: dict[str, str] = {}


@lru_cache(maxsize=None)
def _family_tokenizers(family: str, root: str) -> tuple:
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from transformers import AutoTokenizer

    _ROOTS[family] = root
    folder = write_family_tokenizer(Path(root) / family, family)
    return AutoTokenizer.from_pretrained(str(folder)), load_tokenizer(folder)


def token_stream(family: str, root: str, text: str) -> tuple[list[int], list[str]]:
    """The token ids of `text` and each token's text as the decode node's detokenizer emits it."""
    hf, wrapper = family_tokenizers(family, root)
    ids = hf.encode(text, add_special_tokens=False)
    det = wrapper.detokenizer
    det.reset()
    chunks = []
    for i in ids:
        det.add_token(i)
        chunks.append(det.last_segment)
    det.finalize()
    chunks.append(det.last_segment)
    return ids, chunks


def char_chunks(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def run(parser, chunks: list[str]):
    """Feed every chunk, then finish; the deltas summed."""
    total = None
    for c in [*chunks, None]:
        d = parser.finish() if c is None else parser.feed(c)
        total = d if total is None else total.add(d)
    return total
