"""Read a SWORD ``zText`` Bible module (e.g. Debian's ``sword-text-web``) without the SWORD library.

A testament ``ot``/``nt`` is three files:

* ``.bzs`` block index: records of 3 little-endian uint32 (offset in ``.bzz``, compressed size, size);
* ``.bzz`` zlib-compressed blocks (one per book when the module's ``BlockType=BOOK``);
* ``.bzv`` verse index: records of (uint32 block, uint32 offset in the block, uint16 length), one per verse
  slot in canonical order (empty slots have length 0; the first slots hold module and testament headings).

:func:`read_books` yields one plain-text document per block, i.e. per book.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

from .textclean import osis_to_text

_BOOK_NAME = re.compile(r'type="x-usfm-toc2"[^>]*?n="([^"]+)"|n="([^"]+)"[^>]*?type="x-usfm-toc2"')
_CHAPTER = re.compile(r"<chapter\b[^>]*\bsID=")


def _records(path: Path, fmt: str) -> list[tuple]:
    data, size = path.read_bytes(), struct.calcsize(fmt)
    return [struct.unpack_from(fmt, data, i) for i in range(0, len(data) - size + 1, size)]


def read_testament(folder: str | Path, testament: str) -> Iterator[tuple[str, str]]:
    """``(book name, text)`` for each book of ``testament`` ("ot" or "nt") in the zText module at ``folder``."""
    folder = Path(folder)
    blocks_index = _records(folder / f"{testament}.bzs", "<III")
    compressed = (folder / f"{testament}.bzz").read_bytes()
    blocks = []
    for offset, csize, size in blocks_index:
        block = zlib.decompress(compressed[offset : offset + csize]) if csize else b""
        if len(block) != size:
            raise ValueError(f"{folder}: {testament} block at {offset} has {len(block)} bytes, expected {size}")
        blocks.append(block)
    books: dict[int, list[str]] = {}
    for block, offset, length in _records(folder / f"{testament}.bzv", "<IIH"):
        if length == 0 or block >= len(blocks):
            continue
        books.setdefault(block, []).append(blocks[block][offset : offset + length].decode("utf-8", "replace"))
    for block in sorted(books):
        raw = books[block]
        names = [m.group(1) or m.group(2) for v in raw for m in _BOOK_NAME.finditer(v)]
        if not names:  # module headings (importer milestones), not a book
            continue
        pieces = []
        for verse in raw:
            text = osis_to_text(verse)
            if _CHAPTER.search(verse):
                pieces.append("\n\n")
            if text:
                pieces.append(text + " ")
        body = re.sub(r" *\n *", "\n", "".join(pieces))
        body = re.sub(r"\n{3,}", "\n\n", body).strip()
        yield "+".join(dict.fromkeys(names)), body


def read_books(folder: str | Path) -> Iterator[tuple[str, str]]:
    """Every book of the module at ``folder`` (Old Testament, deuterocanon, New Testament), in order."""
    folder = Path(folder)
    for testament in ("ot", "nt"):
        if (folder / f"{testament}.bzs").exists():
            yield from read_testament(folder, testament)
