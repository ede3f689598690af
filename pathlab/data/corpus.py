"""Prepare and load token corpora by name.

    >>> from pathlab.data.corpus import prepare, load_tokens
    >>> folder = prepare("debian")            # offline: Debian packages -> GPT-2 tokens (about a minute)
    >>> val = load_tokens("debian", "val")    # np.memmap of uint16 token ids

Corpora: ``debian`` (offline default, :mod:`pathlab.data.debian`, GPT-2 tokens), ``debian-bpe4k`` (the same
text with a 4096-token BPE trained on its training split, for CPU-sized models) and ``openwebtext`` (needs
network, :mod:`pathlab.data.openwebtext`). Folders live under ``$PATHLAB_DATA`` or else ``data_cache/`` in the repository
root. Preparing again is a no-op when ``meta.json`` records the same recipe (and, with ``pin=``, the pinned
package versions) and every file matches its SHA-256.

A run records its corpus's identity (:func:`corpus_identity`: name, tokenizer and the SHA-256 of every split,
from ``meta.json``); :func:`check_corpus` refuses a corpus that is not the one a run was trained on.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np

from pathlab.atomic import DirectoryLock

from . import debian, openwebtext
from .tokenizer import get_tokenizer, load_bpe, save_bpe, train_bpe
from .tokens import (
    FORMAT,
    META,
    SPLITS,
    CorpusError,
    SplitWriter,
    atomic_write_json,
    check_files,
    file_sha256,
    open_split,
    read_meta,
)

CORPORA = {
    "debian": debian.recipe,
    "debian-bpe4k": lambda: {**debian.recipe(), "corpus": "debian-bpe4k", "tokenizer": "bpe4096",
                             "bpe_training_chars": BPE_TRAINING_CHARS},
    "openwebtext": openwebtext.recipe,
}
BPE_TRAINING_CHARS = 12_000_000  # the BPE of "debian-bpe4k" is trained on this much training text (seeded sample)
TOKENIZER_FILE = "tokenizer.tiktoken"
BUILD_DIR = ".prepare.tmp"  # inside the corpus folder: the new files are written here, then moved into place


def data_root() -> Path:
    """``$PATHLAB_DATA`` if set, else ``data_cache/`` in the repository root (or the working directory)."""
    if os.environ.get("PATHLAB_DATA"):
        return Path(os.environ["PATHLAB_DATA"]).expanduser()
    repo = Path(__file__).resolve().parents[2]
    return (repo if (repo / "pyproject.toml").is_file() else Path.cwd()) / "data_cache"


def corpus_dir(name_or_dir: str | Path) -> Path:
    """The folder of a corpus given by name (under :func:`data_root`) or by path."""
    path = Path(name_or_dir)
    if (path / META).is_file() or path.is_dir() and str(name_or_dir) not in CORPORA:
        return path
    if str(name_or_dir) in CORPORA:
        return data_root() / str(name_or_dir)
    raise ValueError(
        f"corpus: {str(name_or_dir)!r} is neither a known corpus ({', '.join(CORPORA)}) nor a prepared corpus folder"
    )


def corpus_meta(name_or_dir: str | Path) -> dict:
    """``meta.json`` of a prepared corpus (name or folder)."""
    folder = corpus_dir(name_or_dir)
    try:
        return read_meta(folder)
    except CorpusError as err:
        name = str(name_or_dir)
        hint = f"run `pathlab data prepare {name}`" if name in CORPORA else "prepare it again"
        raise CorpusError(f"{err} ({hint})") from None


def corpus_tokenizer(name_or_dir: str | Path):
    """The tokenizer (a ``tiktoken.Encoding``) a prepared corpus was made with."""
    folder = corpus_dir(name_or_dir)
    info = corpus_meta(name_or_dir)["tokenizer"]
    return get_tokenizer(info["name"], folder / info["file"] if info.get("file") else None)


def load_tokens(name_or_dir: str | Path, split: str, *, vocab_size: int | None = None) -> np.memmap:
    """Read-only uint16 memmap of the ``split`` ("train" or "val") tokens of a prepared corpus.

    ``vocab_size``: also check, in one pass over the file, that every id is below it (a clear
    :class:`CorpusError` naming the file instead of an ``IndexError`` in the middle of a run).
    """
    folder = corpus_dir(name_or_dir)
    meta = corpus_meta(name_or_dir)
    return open_split(folder, split, meta=meta, vocab_size=vocab_size)


def corpus_identity(meta: dict) -> dict:
    """What makes a prepared corpus the one a run was trained on, from its ``meta.json``.

    ``name``, ``tokenizer``, ``tokenizer_sha256`` (the trained BPE's file, None for GPT-2) and ``<split>_sha256``
    for every split are compared by :func:`check_corpus`; ``packages`` (``package=version`` of each Debian
    source) is informational: it is what ``pathlab data prepare debian --pin`` takes to rebuild the corpus.
    """
    tok = meta["tokenizer"]
    identity = {"name": meta["name"], "tokenizer": tok["name"], "tokenizer_sha256": tok.get("sha256")}
    for split, info in sorted(meta["splits"].items()):
        identity[f"{split}_sha256"] = info["sha256"]
    packages = [f"{s['package']}={s['version']}" for s in meta.get("sources", []) if "package" in s]
    if packages:
        identity["packages"] = packages
    return identity


def _recorded_identity(run: dict) -> dict | None:
    if "train_sha256" in run:  # an identity itself
        return run
    if isinstance(run.get("corpus"), dict):  # a checkpoint
        return run["corpus"]
    return run.get("corpus_identity")  # the run config of pathlab.training.trainer.load_run, or a run's env.json


def check_corpus(run: dict, meta: dict) -> None:
    """Raise ``ValueError`` unless ``meta`` (a corpus's ``meta.json``) is the corpus ``run`` was trained on.

    ``run``: a checkpoint dict, the run config returned by :func:`pathlab.training.load_run`, a run's
    ``env.json``, or a :func:`corpus_identity` dict. A run that recorded no identity (made before it was
    recorded) cannot be checked: a warning says so and nothing is raised.
    """
    recorded = _recorded_identity(run)
    if recorded is None:
        warnings.warn("the run records no corpus identity (it predates the record); its corpus cannot be checked",
                      stacklevel=2)
        return
    current = corpus_identity(meta)
    keys = [k for k in dict.fromkeys([*recorded, *current]) if k != "packages"]
    diff = [k for k in keys if recorded.get(k) != current.get(k)]
    if diff:
        def short(v):
            return v[:12] if isinstance(v, str) and len(v) == 64 else v

        changes = "; ".join(f"{k} {short(recorded.get(k))} -> {short(current.get(k))}" for k in diff)
        pins = recorded.get("packages")
        hint = (f"rebuild it with the run's package versions (`pathlab data prepare {recorded['name']} --pin "
                "RUN_DIR/env.json`) into another folder" if pins else "use the corpus folder the run was trained on")
        raise ValueError(f"different corpus: the run was trained on another {recorded['name']!r} than the one "
                         f"prepared now ({changes}); {hint}")


def _recipe_hash(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def _progress(iterable, progress: bool, **kwargs):
    if not progress:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, **kwargs)


def _encode_batches(texts, tokenizer, batch: int = 512):
    threads = max(1, os.cpu_count() or 1)
    buf = []
    for text in texts:
        buf.append(text)
        if len(buf) == batch:
            yield from tokenizer.encode_ordinary_batch(buf, num_threads=threads)
            buf = []
    if buf:
        yield from tokenizer.encode_ordinary_batch(buf, num_threads=threads)


def prepare(name: str, out_dir: str | Path | None = None, progress: bool = True, **options) -> Path:
    """Build corpus ``name`` into ``out_dir`` (default ``data_root()/name``) and return the folder.

    Options: ``debs=DIR`` (debian: where the .deb files are kept), ``pin=FILE`` (debian: the exact package
    versions, see :func:`pathlab.data.debian.read_pins`; a dict ``{package: version}`` works too),
    ``n_shards=N`` (openwebtext: use the first N raw shards, for a smaller corpus), ``raw=DIR`` (openwebtext:
    where raw shards are kept).

    A corpus already in the folder stays valid until the new one is complete: the inputs are fetched first, the
    files are written under ``<folder>/.prepare.tmp/`` and moved into place only once all of them are finished
    (``meta.json`` last), so a bad pin, a corrupt package or a killed run loses nothing. A folder whose
    ``meta.json`` names another corpus is refused, and what a killed preparation left there is deleted.
    """
    if name not in CORPORA:
        raise ValueError(f"name: unknown corpus {name!r}; choose one of {', '.join(CORPORA)}")
    pins = debian.read_pins(options["pin"]) if options.get("pin") is not None else None
    if pins is not None and not name.startswith("debian"):
        raise ValueError(f"pin: corpus {name!r} is not made from Debian packages")
    folder = Path(out_dir) if out_dir is not None else data_root() / name
    recipe = CORPORA[name](**({"n_shards": options["n_shards"]} if "n_shards" in options else {}))
    recipe_hash = _recipe_hash(recipe)
    _refuse_other_corpus(folder, name)
    meta = _intact_meta(folder, recipe_hash, pins)
    inputs = None if meta is not None else _fetch_inputs(name, folder, progress, pins, options)
    if inputs is not None or _leftovers(folder):
        with DirectoryLock(folder):  # nobody else writes here while leftovers are deleted and files are swapped
            _remove_leftovers(folder)
            if inputs is not None:
                meta = _build(name, folder, inputs, recipe, progress)
    if progress and inputs is None:
        print(f"{name}: {folder} is up to date ({meta['splits']['train']['tokens']:,} train tokens)")
    elif progress:
        splits = meta["splits"]
        print(f"{name}: wrote {folder} (train {splits['train']['tokens']:,} tokens in "
              f"{splits['train']['documents']:,} documents, val {splits['val']['tokens']:,} tokens in "
              f"{splits['val']['documents']:,} documents)")
    return folder


def _refuse_other_corpus(folder: Path, name: str) -> None:
    """:class:`CorpusError` if ``folder``'s ``meta.json`` names a corpus other than ``name``.

    Preparing there would replace that corpus's files (and leave behind those the new one does not write, such as
    a trained tokenizer). A ``meta.json`` too damaged to name a corpus protects nothing: that folder is rebuilt."""
    try:
        other = json.loads((folder / META).read_text()).get("name")
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(other, str) and other != name:
        raise CorpusError(
            f"out: {folder} holds the corpus {other!r}, not {name!r}; prepare {name!r} into another folder "
            f"(--out / out_dir), or delete {folder / META} if {other!r} may be replaced"
        )


def _intact_meta(folder: Path, recipe_hash: str, pins: dict | None) -> dict | None:
    """``meta.json`` of ``folder`` if it holds this recipe (with ``pins``' package versions) and every file matches
    its SHA-256; None if it must be built (again): missing, unfinished, corrupt, another recipe or other versions."""
    try:
        meta = read_meta(folder)
    except CorpusError:
        return None
    pins_match = pins is None or all(pins.get(s.get("package")) == s.get("version") for s in meta.get("sources", []))
    if meta.get("recipe_hash") == recipe_hash and pins_match and not check_files(folder, meta, hashes=True):
        return meta
    return None


def _leftovers(folder: Path) -> list[Path]:
    """What a killed preparation leaves in ``folder``: its build folder, and temporary files beside the splits and
    ``meta.json`` (from a write killed in the folder itself, as preparations made before the build folder were)."""
    names = [f"{split}.bin" for split in SPLITS] + [META]
    found = [p for n in names for p in sorted(folder.glob(f".{n}.*.tmp"))]
    found += [p for p in (folder / f".{split}.docs.npy.tmp" for split in SPLITS) if p.is_file()]
    return found + ([folder / BUILD_DIR] if (folder / BUILD_DIR).is_dir() else [])


def _remove_leftovers(folder: Path) -> None:
    """Delete :func:`_leftovers`; only under the folder's lock, as another preparation's files in progress are
    leftovers too."""
    for path in _leftovers(folder):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _fetch_inputs(name: str, folder: Path, progress: bool, pins: dict | None, options: dict) -> dict:
    """Download (or find) what corpus ``name`` is made from, before anything in ``folder`` is touched."""
    if name.startswith("debian"):
        debs = Path(options.get("debs") or data_root() / "debian" / "debs")
        if progress:
            print(f"debian: packages in {debs}" + (" (pinned versions)" if pins else ""), flush=True)
        return {"packages": debian.fetch_packages(debs, progress=progress, pins=pins),
                "bpe_vocab": 4096 if name == "debian-bpe4k" else None}
    raw = Path(options.get("raw") or folder / "raw")
    return {"shards": openwebtext.fetch_shards(raw, int(options.get("n_shards", openwebtext.N_SHARDS)),
                                               progress=progress)}


def _build(name: str, folder: Path, inputs: dict, recipe: dict, progress: bool) -> dict:
    """Write corpus ``name`` from ``inputs`` into ``folder``'s build folder, move it into place and return its
    ``meta.json``; the build folder is gone afterwards, whether or not the build succeeded."""
    build = folder / BUILD_DIR
    build.mkdir()
    try:
        tokenizer = get_tokenizer("gpt2")
        tokenizer_info = {"name": "gpt2", "vocab_size": tokenizer.n_vocab, "eot": tokenizer.eot_token}
        if "packages" in inputs:
            bpe_vocab = inputs["bpe_vocab"]
            splits, sources, tokenizer = _build_debian(build, tokenizer, progress, inputs["packages"], bpe_vocab)
            if bpe_vocab is not None:
                tokenizer_info = {"name": tokenizer.name, "vocab_size": tokenizer.n_vocab, "eot": tokenizer.eot_token,
                                  "file": TOKENIZER_FILE, "sha256": file_sha256(build / TOKENIZER_FILE)}
        else:
            splits, sources = _build_openwebtext(build, tokenizer, progress, inputs["shards"])
        meta = {
            "format": FORMAT,
            "name": name,
            "tokenizer": tokenizer_info,
            "dtype": "uint16",
            "splits": splits,
            "sources": sources,
            "recipe": recipe,
            "recipe_hash": _recipe_hash(recipe),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        _move_into_place(build, folder, meta)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return meta


def _move_into_place(build: Path, folder: Path, meta: dict) -> None:
    """Move the finished files of ``build`` into ``folder``, replacing the old corpus's.

    The old ``meta.json`` goes first and the new one is written last, so that no reader takes the folder for a
    corpus while its files are a mix of the old and the new; a tokenizer file the new corpus does not use goes too.
    """
    (folder / META).unlink(missing_ok=True)
    files = [info["file"] for info in meta["splits"].values()] + [f"{split}.docs.npy" for split in meta["splits"]]
    if meta["tokenizer"].get("file"):
        files.append(meta["tokenizer"]["file"])
    else:
        (folder / TOKENIZER_FILE).unlink(missing_ok=True)
    for file in files:
        os.replace(build / file, folder / file)
    atomic_write_json(folder / META, meta)


def _build_debian(folder: Path, tokenizer, progress: bool, packages: dict[str, Path], bpe_vocab: int | None = None):
    work = folder / "work"
    collected = [(source, package, version, docs, debian.held_out(source.name, docs))
                 for source, package, version, docs in debian.collect_documents(work, packages, progress=progress)]
    shutil.rmtree(work, ignore_errors=True)
    if bpe_vocab is not None:
        train_texts = [t for _, _, _, docs, val_ids in collected for i, (_, t) in enumerate(docs) if i not in val_ids]
        order = np.random.default_rng(debian.SPLIT_SEED).permutation(len(train_texts))
        sample, chars = [], 0
        for i in order:
            if chars >= BPE_TRAINING_CHARS:
                break
            sample.append(train_texts[i])
            chars += len(train_texts[i])
        if progress:
            print(f"  training a {bpe_vocab}-token BPE on {chars / 1e6:.1f} MB of training text", flush=True)
        save_bpe(folder / TOKENIZER_FILE, train_bpe(sample, bpe_vocab))
        tokenizer = load_bpe(folder / TOKENIZER_FILE, f"bpe{bpe_vocab}")
    eot = tokenizer.eot_token
    sources = []
    with SplitWriter(folder, "train", eot=eot) as train, SplitWriter(folder, "val", eot=eot) as val:
        for source, package, version, docs, val_ids in collected:
            counts = {"train": [0, 0], "val": [0, 0]}
            texts = (t for _, t in docs)
            encoded = _progress(_encode_batches(texts, tokenizer), progress, total=len(docs),
                                desc=f"  tokenizing {source.name}", unit="doc", leave=False)
            for i, ids in enumerate(encoded):
                split = "val" if i in val_ids else "train"
                (val if split == "val" else train).add(ids)
                counts[split][0] += 1
                counts[split][1] += len(ids) + 1
            sources.append({
                "source": source.name, "package": package, "version": version, "licence": source.licence,
                "train_documents": counts["train"][0], "train_tokens": counts["train"][1],
                "val_documents": counts["val"][0], "val_tokens": counts["val"][1],
                "val_document_names": sorted(docs[i][0] for i in val_ids),
            })
    return {"train": train.info, "val": val.info}, sources, tokenizer


def _build_openwebtext(folder: Path, tokenizer, progress: bool, shards: list[Path]):
    eot = tokenizer.eot_token
    work = folder / "work"
    # Pass 1: every document, in source order, into one scratch token file (document count unknown until the end).
    docs = _progress(openwebtext.iter_documents(shards), progress, desc="  tokenizing openwebtext", unit="doc")
    with SplitWriter(work, "train", eot=eot) as scratch:
        for ids in _encode_batches(docs, tokenizer, batch=1024):
            scratch.add(ids)
    tokens = np.memmap(work / "train.bin", dtype=np.uint16, mode="r")
    offsets = np.load(work / "train.docs.npy")
    n_docs = offsets.size - 1
    train_idx, val_idx = openwebtext.split_indices(n_docs)
    # Pass 2: val in the permutation's order (as nanoGPT's val.bin), train in source order.
    with SplitWriter(folder, "val", eot=eot) as val:
        for i in val_idx:
            val.add(tokens[offsets[i] : offsets[i + 1] - 1])
    is_val = np.zeros(n_docs, dtype=bool)
    is_val[val_idx] = True
    with SplitWriter(folder, "train", eot=eot) as train:
        for i in _progress(range(n_docs), progress, desc="  writing train.bin", unit="doc", mininterval=2):
            if not is_val[i]:
                train.add(tokens[offsets[i] : offsets[i + 1] - 1])
    del tokens
    shutil.rmtree(work, ignore_errors=True)
    sources = [{"source": openwebtext.REPO_ID, "shards": [p.name for p in shards], "documents": int(n_docs)}]
    return {"train": train.info, "val": val.info}, sources


def describe(name_or_dir: str | Path, file=None) -> list[str]:
    """Print a short summary of a prepared corpus; return the problems with its files (empty if none).

    The file sizes are checked against the recorded token counts (not the SHA-256: ``pathlab data verify``), so
    that a truncated or missing file is reported instead of counts it no longer holds."""
    file = file or sys.stdout
    meta = corpus_meta(name_or_dir)
    folder = corpus_dir(name_or_dir)
    print(f"{meta['name']} ({folder}), tokenizer {meta['tokenizer']['name']}", file=file)
    for split, info in meta["splits"].items():
        print(f"  {split:5s} {info['tokens']:>13,} tokens {info['documents']:>9,} documents, longest "
              f"{info['longest_document']:,}", file=file)
    for s in meta.get("sources", []):
        if "package" in s:
            print(f"  {s['source']:16s} {s['package']} {s['version']}: train {s['train_tokens']:,} / val "
                  f"{s['val_tokens']:,} tokens", file=file)
    problems = check_files(folder, meta)
    for problem in problems:
        print(f"  WARNING: {problem}", file=file)
    if problems:
        print("  the corpus is corrupt or unfinished: the counts above are not what its files hold; prepare it again",
              file=file)
    return problems
