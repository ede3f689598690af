"""The one token format every corpus uses, written so that a half-written corpus is never taken for a finished one.

A prepared corpus is a folder::

    train.bin  val.bin          uint16 token ids, documents concatenated, each followed by the end-of-text token
    train.docs.npy val.docs.npy int64 document start offsets (length n_docs + 1, the last one = number of tokens)
    meta.json                   format, tokenizer, per-split token/document counts and SHA-256, sources, recipe

Every file is written to a temporary name and moved into place with ``os.replace``; ``meta.json`` is written
last, so a folder without it (or with files whose sizes disagree with it) is "not prepared", never "prepared".
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from pathlab.atomic import atomic_write_bytes

FORMAT = "pathlab-tokens/1"
META = "meta.json"
SPLITS = ("train", "val")
DTYPE = np.uint16


class CorpusError(ValueError):
    """A corpus folder is missing, unfinished, corrupt or does not match what the caller expects."""


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


class SplitWriter:
    """Stream documents (token arrays) into ``<split>.bin`` with offsets and a running SHA-256.

    Use as a context manager; the files appear under their final names only when the block exits cleanly::

        with SplitWriter(folder, "train", eot=50256) as w:
            for ids in documents:
                w.add(ids)          # the end-of-text token is appended here
        info = w.info               # tokens, documents, sha256, longest_document
    """

    def __init__(self, folder: str | Path, split: str, *, eot: int, vocab_size: int = 65536):
        if split not in SPLITS:
            raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
        if vocab_size > np.iinfo(DTYPE).max + 1:
            raise ValueError(f"vocab_size: {vocab_size} token ids do not fit uint16")
        self.folder, self.split, self.eot, self.vocab_size = Path(folder), split, int(eot), int(vocab_size)
        self.offsets = [0]
        self.hash = hashlib.sha256()
        self.info: dict | None = None

    def __enter__(self):
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{self.split}.bin.", suffix=".tmp")
        self.file = os.fdopen(fd, "wb")
        return self

    def add(self, ids) -> None:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}); got [{arr.min()}, {arr.max()}]")
        data = np.append(arr, self.eot).astype(DTYPE).tobytes()
        self.file.write(data)
        self.hash.update(data)
        self.offsets.append(self.offsets[-1] + arr.size + 1)

    def __exit__(self, exc_type, exc, tb):
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if exc_type is not None:
            os.unlink(self.tmp)
            return False
        offsets = np.asarray(self.offsets, dtype=np.int64)
        docs_tmp = self.folder / f".{self.split}.docs.npy.tmp"
        with open(docs_tmp, "wb") as f:
            np.save(f, offsets)
        os.chmod(self.tmp, 0o644)
        os.replace(self.tmp, self.folder / f"{self.split}.bin")
        os.replace(docs_tmp, self.folder / f"{self.split}.docs.npy")
        lengths = np.diff(offsets)
        self.info = {
            "file": f"{self.split}.bin",
            "tokens": int(offsets[-1]),
            "documents": int(lengths.size),
            "longest_document": int(lengths.max()) if lengths.size else 0,
            "sha256": self.hash.hexdigest(),
        }
        return False


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_meta(folder: str | Path) -> dict:
    """``meta.json`` of a prepared corpus; :class:`CorpusError` if the folder is not a finished corpus."""
    folder = Path(folder)
    path = folder / META
    if not path.is_file():
        raise CorpusError(
            f"{folder} is not a prepared corpus (no {META}); run `pathlab data prepare NAME` "
            "(a folder without meta.json is an unfinished preparation)"
        )
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CorpusError(f"{path} is corrupt ({err}); delete the folder and prepare the corpus again") from err
    if not isinstance(meta, dict):
        raise CorpusError(f"{path} holds {_json_type(meta)}, not a JSON object; prepare the corpus again")
    if meta.get("format") != FORMAT:
        raise CorpusError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}; prepare the corpus again")
    problem = _meta_problem(meta)
    if problem:
        raise CorpusError(f"{path}: {problem}; the file is corrupt - prepare the corpus again")
    return meta


# The keys the readers of meta.json rely on, with their types.
_TOP_KEYS = {"name": str, "tokenizer": dict, "splits": dict}
_TOKENIZER_KEYS = {"name": str, "vocab_size": int, "eot": int}
_SPLIT_KEYS = {"file": str, "tokens": int, "documents": int, "longest_document": int, "sha256": str}
_PACKAGE_KEYS = {"package": str, "version": str, "train_tokens": int, "val_tokens": int}  # a source from a package
_EXPECTED = {str: "a string", int: "an integer >= 0", dict: "an object"}


def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _keys_problem(obj: dict, keys: dict[str, type], where: str) -> str | None:
    """The first of ``keys`` missing from ``obj`` or of the wrong type, described (``where`` prefixes its name)."""
    for key, kind in keys.items():
        if key not in obj:
            return f"{where}{key} is missing"
        value = obj[key]
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            shown = f" ({value!r})" if isinstance(value, (str, int, float)) else ""
            return f"{where}{key} is {_json_type(value)}{shown}, expected {_EXPECTED[kind]}"
    return None


def _meta_problem(meta: dict) -> str | None:
    """The first key of a parsed meta.json that is missing or of the wrong type (None if all are sound).

    Checked when the file is read, so that a damaged file is refused by name instead of failing later, wherever a
    reader first trips over it, with a ``KeyError`` or a message built from the wrong value."""
    problem = _keys_problem(meta, _TOP_KEYS, "") or _keys_problem(meta["tokenizer"], _TOKENIZER_KEYS, "tokenizer.")
    splits = meta.get("splits")
    problem = problem or _keys_problem(splits, dict.fromkeys([*SPLITS, *splits], dict), "splits.")
    if problem:
        return problem
    for split, info in splits.items():
        if problem := _keys_problem(info, _SPLIT_KEYS, f"splits.{split}."):
            return problem
        if Path(info["file"]).name != info["file"] or info["file"] in ("", ".", ".."):
            return f"splits.{split}.file is {info['file']!r}, expected a file name in the corpus folder"
    sources = meta.get("sources", [])
    if not isinstance(sources, list) or not all(isinstance(s, dict) for s in sources):
        return "sources is not an array of objects"
    for i, source in enumerate(sources):
        if "package" in source and (problem := _keys_problem(source, _PACKAGE_KEYS, f"sources[{i}].")):
            return problem
    return None


def check_files(folder: str | Path, meta: dict | None = None, *, hashes: bool = False) -> list[str]:
    """Problems with a prepared corpus's files (empty list if none): sizes always, SHA-256 when ``hashes``."""
    folder = Path(folder)
    meta = read_meta(folder) if meta is None else meta
    problems = []
    itemsize = np.dtype(DTYPE).itemsize
    for split, info in meta["splits"].items():
        path = folder / info["file"]
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        if path.stat().st_size != info["tokens"] * itemsize:
            problems.append(f"{path} has {path.stat().st_size} bytes, expected {info['tokens'] * itemsize}")
        elif hashes and file_sha256(path) != info["sha256"]:
            problems.append(f"{path} does not match its recorded SHA-256")
        if not (folder / f"{split}.docs.npy").is_file():
            problems.append(f"{folder / f'{split}.docs.npy'} is missing")
    return problems


def check_token_ids(tokens: np.ndarray, vocab_size: int, path: str | Path, chunk: int = 1 << 24) -> None:
    """:class:`CorpusError` naming ``path`` and the first offending position if any id is ``>= vocab_size``.

    One pass over the file in chunks of ``chunk`` tokens (a max per chunk, so the cost is one read of the file, cheap
    enough to run whenever a corpus is opened). uint16 ids are never negative.
    """
    for start in range(0, len(tokens), chunk):
        block = np.asarray(tokens[start : start + chunk])
        if block.size and int(block.max()) >= vocab_size:
            pos = int(np.argmax(block >= vocab_size))
            raise CorpusError(
                f"{path}: token id {int(block[pos])} at position {start + pos} is outside the vocabulary of "
                f"{vocab_size} tokens; the file is corrupt or was made with another tokenizer - prepare the "
                "corpus again"
            )


def open_split(folder: str | Path, split: str, *, meta: dict | None = None, vocab_size: int | None = None) -> np.memmap:
    """Read-only memmap of ``<split>.bin`` after checking that it is complete (size agrees with meta.json).

    With ``vocab_size`` every token id is also checked to be below it (:func:`check_token_ids`, one pass).
    """
    folder = Path(folder)
    meta = read_meta(folder) if meta is None else meta
    if split not in meta["splits"]:
        raise ValueError(f"split: {folder} has splits {sorted(meta['splits'])}, not {split!r}")
    problems = [p for p in check_files(folder, meta) if f"{split}." in p]
    if problems:
        raise CorpusError("; ".join(problems) + " - the corpus is corrupt or unfinished; prepare it again")
    path = folder / meta["splits"][split]["file"]
    tokens = np.memmap(path, dtype=DTYPE, mode="r")
    if vocab_size is not None:
        check_token_ids(tokens, vocab_size, path)
    return tokens


def document_offsets(folder: str | Path, split: str) -> np.ndarray:
    """int64 start offsets of the documents of ``split`` (length n_docs + 1)."""
    return np.load(Path(folder) / f"{split}.docs.npy")


def write_corpus(folder: str | Path, name: str, documents: dict[str, list], tokenizer: dict, **extra) -> Path:
    """Write a complete corpus folder from in-memory documents: ``{"train": [ids, ...], "val": [...]}``.

    ``tokenizer`` is the ``meta.json`` tokenizer record (``name``, ``vocab_size``, ``eot``). Used for small
    synthetic corpora (tests, examples); real corpora go through :func:`pathlab.data.corpus.prepare`.
    """
    folder = Path(folder)
    splits = {}
    for split in SPLITS:
        with SplitWriter(folder, split, eot=tokenizer["eot"], vocab_size=tokenizer["vocab_size"]) as w:
            for ids in documents.get(split, []):
                w.add(ids)
        splits[split] = w.info
    meta = {"format": FORMAT, "name": name, "tokenizer": dict(tokenizer), "dtype": "uint16", "splits": splits,
            "sources": [], **extra}
    atomic_write_json(folder / META, meta)
    return folder
