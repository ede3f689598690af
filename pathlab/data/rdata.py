"""Read character vectors out of an R lazy-load database, without R.

An installed R package keeps its data sets in ``data/Rdata.rdx`` + ``data/Rdata.rdb``:

* ``.rdx`` is one gzip/zlib-compressed serialized R list with fields ``variables`` (name -> c(offset, length)
  into the ``.rdb``), ``references`` and ``compressed``;
* each ``.rdb`` record is a 4-byte big-endian uncompressed length followed by a zlib stream holding one
  serialized object (``compressed`` = 2 or 3 would add a type byte for bzip2/xz; handled too).

R's serialization (``serialize.c``, XDR format "X\\n", versions 2 and 3) is a tagged tree. This reader decodes
the subset that data sets use (vectors, strings, pairlists, attributes, references) and returns Python values:
character vectors become ``list[str | None]``, numeric vectors lists of numbers, lists ``list``. Enough to read
e.g. the novels in ``r-cran-janeaustenr``.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

_NILVALUE, _REF, _GLOBALENV, _UNBOUND, _MISSINGARG, _BASENAMESPACE = 254, 255, 253, 252, 251, 250
_NAMESPACE, _PACKAGE, _PERSIST, _EMPTYENV, _BASEENV, _ATTRLANG, _ATTRLIST, _ALTREP = 249, 248, 247, 242, 241, 240, 239, 238
_NA_INT = -(2**31)


@dataclass
class RObject:
    """A decoded R value that is not a plain vector (pairlist, environment, closure, ...)."""

    kind: int
    value: object = None
    attributes: dict = field(default_factory=dict)


class _Reader:
    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise ValueError("R data: only the XDR serialization format ('X\\n') is supported")
        self.data, self.pos, self.refs = data, 2, []
        version = self.int()
        self.int(), self.int()  # writer version, minimal reader version
        if version == 3:
            n = self.int()
            self.pos += n  # skip the native encoding's name
        elif version != 2:
            raise ValueError(f"R data: unsupported serialization version {version}")

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return v

    def take(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def string(self):  # a CHARSXP, its flags already consumed by the caller's read of them
        n = self.int()
        return None if n == -1 else self.take(n).decode("utf-8", errors="replace")

    def attributes(self, has_attr: bool) -> dict:
        if not has_attr:
            return {}
        pairs = self.item()
        return dict(pairs.value) if isinstance(pairs, RObject) and pairs.kind == 2 else {}

    def item(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind == _NILVALUE:
            return None
        if kind in (_EMPTYENV, _BASEENV, _GLOBALENV, _UNBOUND, _MISSINGARG, _BASENAMESPACE):
            return RObject(kind)
        if kind == _REF:
            index = flags >> 8
            return self.refs[(self.int() if index == 0 else index) - 1]
        if kind in (_NAMESPACE, _PACKAGE, _PERSIST):
            self.int()  # 0
            names = [self.item_string() for _ in range(self.int())]
            obj = RObject(kind, names)
            self.refs.append(obj)
            return obj
        if kind == 1:  # SYMSXP
            obj = RObject(1, self.item_string())
            self.refs.append(obj)
            return obj
        if kind == 4:  # ENVSXP
            obj = RObject(4)
            self.refs.append(obj)
            self.int()  # locked
            obj.value = {"enclos": self.item(), "frame": self.item(), "hashtab": self.item()}
            obj.attributes = self.attributes_from(self.item())
            return obj
        if kind in (2, 3, 5, 6, 17, _ATTRLANG, _ATTRLIST):  # pairlist-like: attr?, tag?, car, cdr
            attrs = self.attributes(has_attr)
            tag = self.item() if has_tag else None
            car = self.item()
            cdr = self.item()
            name = tag.value if isinstance(tag, RObject) else None
            rest = cdr.value if isinstance(cdr, RObject) and cdr.kind == 2 else []
            return RObject(2 if kind in (2, _ATTRLIST) else kind, [(name, car)] + list(rest), attrs)
        if kind == 9:  # CHARSXP
            return self.string()
        if kind in (10, 13):  # LGLSXP, INTSXP
            n = self.int()
            vals = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
            return self.vector([None if v == _NA_INT else v for v in vals], has_attr)
        if kind == 14:  # REALSXP
            n = self.int()
            vals = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
            return self.vector(vals, has_attr)
        if kind == 16:  # STRSXP
            n = self.int()
            vals = []
            for _ in range(n):
                self.int()  # CHARSXP flags
                vals.append(self.string())
            return self.vector(vals, has_attr)
        if kind in (19, 20):  # VECSXP, EXPRSXP
            n = self.int()
            return self.vector([self.item() for _ in range(n)], has_attr)
        if kind == 24:  # RAWSXP
            return self.vector(self.take(self.int()), has_attr)
        raise ValueError(f"R data: unsupported object type {kind} at byte {self.pos - 4}")

    def item_string(self):
        self.int()  # CHARSXP flags
        return self.string()

    def attributes_from(self, pairs) -> dict:
        return dict(pairs.value) if isinstance(pairs, RObject) and pairs.kind == 2 else {}

    def vector(self, values, has_attr: bool):
        attrs = self.attributes(has_attr)
        if not attrs:
            return values
        return RObject(-1, values, attrs)


def unserialize(data: bytes):
    """Decode one R object serialized in XDR format (``serialize(x, NULL)``)."""
    return _Reader(data).item()


def _decompress(blob: bytes, compressed: int) -> bytes:
    size = struct.unpack(">I", blob[:4])[0]
    body = blob[4:]
    if compressed in (0, False):
        return body
    if compressed == 1 or compressed is True:
        out = zlib.decompress(body)
    else:  # 2 = bzip2, 3 = xz; the first byte says which ('2', '3' or '0' for stored)
        kind, body = body[:1], body[1:]
        out = {b"2": bz2.decompress, b"Z": lzma.decompress, b"3": lzma.decompress, b"0": bytes}[kind](body)
    if len(out) != size:
        raise ValueError(f"R data: record decompressed to {len(out)} bytes, expected {size}")
    return out


def _values(obj):
    return obj.value if isinstance(obj, RObject) else obj


def read_lazyload(prefix: str | Path) -> dict:
    """All variables of the lazy-load database ``prefix.rdx``/``prefix.rdb``, as ``{name: value}``."""
    prefix = Path(prefix)
    return read_lazyload_bytes(prefix.with_suffix(".rdx").read_bytes(), prefix.with_suffix(".rdb").read_bytes())


def read_lazyload_bytes(rdx: bytes, rdb: bytes) -> dict:
    """:func:`read_lazyload` from the two files' contents."""
    raw = gzip.decompress(rdx) if rdx[:2] == b"\x1f\x8b" else _decompress(rdx, 1)
    index = unserialize(raw)
    fields = dict(zip(index.attributes["names"], index.value))
    compressed = _values(fields.get("compressed", [True]))[0]
    names = fields["variables"].attributes["names"]
    out = {}
    for name, loc in zip(names, fields["variables"].value):
        offset, length = _values(loc)
        out[name] = unserialize(_decompress(rdb[int(offset) : int(offset) + int(length)], compressed))
    return out


def character_vector(value) -> list[str]:
    """The strings of an R character vector as returned by :func:`unserialize` (NA becomes "")."""
    values = _values(value)
    if not isinstance(values, list) or not all(v is None or isinstance(v, str) for v in values):
        raise ValueError("R data: not a character vector")
    return [v or "" for v in values]
