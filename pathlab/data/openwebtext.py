"""OpenWebText the way nanoGPT prepares it, without the ``datasets`` loading script (which ``datasets`` >= 4 no
longer runs).

* Raw shards: ``subsets/urlsf_subset00.tar`` ... ``urlsf_subset20.tar`` of the Hugging Face dataset repository
  ``Skylion007/openwebtext``, fetched with ``huggingface_hub`` into ``<corpus>/raw/`` (shards already there are
  used as they are). Each shard is a tar of ``.xz`` files; each ``.xz`` is a tar of ``.txt`` documents.
* Documents in the loading script's order (shard, then ``.xz`` member, then ``.txt`` member), each cleaned as
  the script does: ``re.sub("\\n\\n\\n+", "\\n\\n", text).strip()``.
* Split as ``datasets.Dataset.train_test_split(test_size=0.0005, seed=2357)`` does:
  ``permutation = np.random.default_rng(2357).permutation(n)``, the first ``ceil(0.0005 n)`` documents are
  validation (written in that order, as nanoGPT's ``val.bin``), the rest training. Training keeps the documents
  in source order (the same set as nanoGPT's ``train.bin``, not its shuffled order; windows are drawn at random
  anyway).
* GPT-2 ``encode_ordinary`` per document plus the end-of-text token 50256.

Full size: 8,013,769 documents, about 9.04B training tokens (17 GB) and 4.43M validation tokens.
"""

from __future__ import annotations

import io
import math
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

REPO_ID = "Skylion007/openwebtext"
N_SHARDS = 21
TEST_SIZE = 0.0005
SPLIT_SEED = 2357
RECIPE_VERSION = 1


def shard_name(i: int) -> str:
    return f"urlsf_subset{i:02d}.tar"


def recipe(n_shards: int = N_SHARDS) -> dict:
    return {"corpus": "openwebtext", "version": RECIPE_VERSION, "repo": REPO_ID, "n_shards": n_shards,
            "test_size": TEST_SIZE, "split_seed": SPLIT_SEED, "tokenizer": "gpt2"}


def fetch_shards(raw: Path, n_shards: int = N_SHARDS, progress: bool = True) -> list[Path]:
    """Paths of the raw shards, downloading the missing ones from the Hugging Face hub."""
    raw.mkdir(parents=True, exist_ok=True)
    paths = [raw / shard_name(i) for i in range(n_shards)]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        try:
            from huggingface_hub import hf_hub_download
        except ImportError as err:
            raise RuntimeError("downloading OpenWebText needs huggingface_hub: `pip install -e .[data]`") from err
        for path in missing:
            if progress:
                print(f"  downloading {REPO_ID}/subsets/{path.name}", flush=True)
            got = hf_hub_download(REPO_ID, f"subsets/{path.name}", repo_type="dataset", local_dir=raw / "hub")
            Path(got).replace(path)
    return paths


def _clean(text: bytes) -> str:
    return re.sub("\n\n\n+", "\n\n", text.decode("utf-8")).strip()


def iter_documents(shards: list[Path]) -> Iterator[str]:
    """Every document of the shards, in the loading script's order."""
    for shard in shards:
        with tarfile.open(shard, mode="r:") as outer:
            for member in outer:
                if not member.isfile() or not member.name.endswith(".xz"):
                    continue
                blob = outer.extractfile(member).read()
                with tarfile.open(fileobj=io.BytesIO(blob), mode="r:*") as inner:
                    for txt in inner:
                        if txt.isfile() and txt.name.endswith(".txt"):
                            yield _clean(inner.extractfile(txt).read())


def split_indices(n_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) document indices exactly as ``train_test_split(test_size=0.0005, seed=2357)`` picks them."""
    n_test = math.ceil(TEST_SIZE * n_docs)
    permutation = np.random.default_rng(SPLIT_SEED).permutation(n_docs)
    return permutation[n_test:], permutation[:n_test]
