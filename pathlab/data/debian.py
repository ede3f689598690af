"""The offline default corpus: about 50 MB of real English text taken from Debian packages.

Nothing is downloaded from a hub: ``apt-get download`` fetches the packages (no root needed) into
``<corpus>/debs/`` and we read the files we need straight out of each ``.deb`` (``dpkg-deb --fsys-tarfile``,
or a pure-Python reader of the ar + tar.{xz,gz,bz2} layout where dpkg is missing). Sources:

=================  =========================  ======================================================
source             package                    documents
=================  =========================  ======================================================
austen             r-cran-janeaustenr         6 novels (an R lazy-load database, read without R)
web-bible          sword-text-web             the World English Bible, one document per book (SWORD zText)
jargon             jargon-text                the Jargon File, one document
python-docs        python3-doc -> python3.X-doc   the Python manual, one document per ``.rst.txt`` source
postgresql-docs    postgresql-doc -> postgresql-doc-N  the PostgreSQL manual, one document per HTML page
linux-docs         linux-doc -> linux-doc-X.Y     the kernel documentation, one document per ``.rst``
=================  =========================  ======================================================

Versioned package names are resolved through the unversioned metapackage (``apt-cache depends python3-doc``),
falling back to the highest matching name known to apt, so the same code works on Debian and Ubuntu releases.
The exact package versions used are recorded in ``meta.json``.

Unpinned, a package already in ``debs/`` is used as it is and a missing one is whatever apt offers today, so
a corpus prepared on another day or machine can differ. **Pinning** (``pathlab data prepare debian --pin
FILE``, :func:`read_pins`) names the exact ``package=version`` of every source: a ``.deb`` of that version in
``debs/`` is used, otherwise ``apt-get download package=version`` fetches it, and a version apt no longer
offers stops with a message (put the file into ``debs/`` by hand, e.g. from Debian's snapshot archive). FILE is
the ``meta.json`` of the corpus to reproduce, a run's ``env.json`` (the versions its corpus was made from), or
lines ``package=version``.

Validation holds out whole long documents (at least ``MIN_VAL_DOC_CHARS`` characters), chosen per source with a
fixed seed until about ``VAL_FRACTION`` of that source's text is held out, so that length-extrapolation windows
cover long contiguous text. Sources with fewer than 4 documents stay entirely in training.

On a machine without apt: download the ``.deb`` files named in ``meta.json`` (or listed above) from any Debian
mirror by hand into ``<corpus>/debs/`` and run ``pathlab data prepare debian`` again: packages already there
are used as they are and nothing else needs apt.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import re
import shutil
import subprocess
import tarfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .rdata import character_vector, read_lazyload
from .sword import read_books
from .textclean import html_to_text, normalize_whitespace, unwrap_paragraphs

VAL_FRACTION = 0.05
MIN_VAL_DOC_CHARS = 20_000
MIN_DOC_CHARS = 500
SPLIT_SEED = 2357
RECIPE_VERSION = 1


@dataclass(frozen=True)
class Source:
    """One package's contribution: how to find the package, which files to take, how to turn them into documents."""

    name: str
    package: str  # a plain package name, or an unversioned metapackage when `pattern` is set
    pattern: str | None  # regex a versioned name must match (resolved through `package`'s Depends)
    licence: str
    wants: Callable[[str], bool]  # path inside the .deb -> keep?
    documents: Callable[[Path], Iterator[tuple[str, str]]]  # extracted folder -> (name, text)


def _austen(root: Path):
    (rdx,) = root.rglob("janeaustenr/data/Rdata.rdx")
    for name, value in read_lazyload(rdx.with_suffix("")).items():
        yield name, unwrap_paragraphs(character_vector(value))


def _bible(root: Path):
    for conf_dir in sorted({p.parent for p in root.rglob("*.bzs")}):
        yield from read_books(conf_dir)


def _gzip_text(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def _jargon(root: Path):
    for path in sorted(root.rglob("jargon.txt.gz")):
        yield "jargon", normalize_whitespace(_gzip_text(path))


def _python_docs(root: Path):
    for path in sorted(root.rglob("*.rst.txt")):
        yield str(path.relative_to(root)), normalize_whitespace(_gzip_text(path))


def _postgresql_docs(root: Path):
    for path in sorted(root.rglob("*.html")):
        yield str(path.relative_to(root)), html_to_text(path.read_bytes().decode("utf-8", errors="replace"))


def _linux_docs(root: Path):
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        yield str(path.relative_to(root)), normalize_whitespace(_gzip_text(path))


SOURCES = (
    Source("austen", "r-cran-janeaustenr", None, "public domain",
           lambda p: p.endswith("janeaustenr/data/Rdata.rdx") or p.endswith("janeaustenr/data/Rdata.rdb"), _austen),
    Source("web-bible", "sword-text-web", None, "public domain", lambda p: "/modules/texts/ztext/" in p, _bible),
    Source("jargon", "jargon-text", None, "public domain", lambda p: p.endswith("jargon.txt.gz"), _jargon),
    Source("python-docs", "python3-doc", r"python3\.\d+-doc", "PSF-2.0",
           lambda p: "/html/_sources/" in p and p.endswith(".rst.txt"), _python_docs),
    Source("postgresql-docs", "postgresql-doc", r"postgresql-doc-\d+", "PostgreSQL",
           lambda p: "/html/" in p and p.endswith(".html"), _postgresql_docs),
    Source("linux-docs", "linux-doc", r"linux-doc-\d+(\.\d+)*", "GPL-2.0",
           lambda p: "/Documentation/" in p and p.endswith((".rst", ".rst.gz", ".txt", ".txt.gz")), _linux_docs),
)


def recipe() -> dict:
    """Everything that determines the corpus besides the package versions (hashed to decide re-preparation)."""
    return {
        "corpus": "debian",
        "version": RECIPE_VERSION,
        "sources": [[s.name, s.package, s.pattern] for s in SOURCES],
        "val_fraction": VAL_FRACTION,
        "min_val_doc_chars": MIN_VAL_DOC_CHARS,
        "min_doc_chars": MIN_DOC_CHARS,
        "split_seed": SPLIT_SEED,
        "tokenizer": "gpt2",
    }


# --------------------------------------------------------------------------------------------- packages


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True).stdout


def _apt_missing_message(what: str, debs: Path) -> str:
    return (
        f"{what}: apt is not available on this machine. Download the packages by hand from a Debian mirror "
        f"(packages: {', '.join(s.package + (' (a versioned ' + s.pattern + ')' if s.pattern else '') for s in SOURCES)}) "
        f"into {debs} and run the command again; packages already there are used as they are."
    )


def resolve_package(source: Source) -> str:
    """The concrete package name for ``source`` on this machine's apt (versioned names resolved)."""
    if source.pattern is None:
        return source.package
    regex = re.compile(rf"^{source.pattern}$")
    try:
        depends = _run(["apt-cache", "depends", source.package])
        for line in depends.splitlines():
            dep = line.strip().removeprefix("|").strip()
            if dep.startswith("Depends:"):
                name = dep.split(":", 1)[1].strip()
                if regex.match(name):
                    return name
    except (subprocess.CalledProcessError, FileNotFoundError):
        pass
    names = [n for n in _run(["apt-cache", "pkgnames"]).split() if regex.match(n)]
    if not names:
        raise RuntimeError(f"no package matching {source.pattern!r} is known to apt; run `apt-get update` first")
    key = lambda n: [int(x) for x in re.findall(r"\d+", n)]  # noqa: E731
    return max(names, key=key)


def _find_deb(debs: Path, source: Source, package: str | None) -> Path | None:
    pattern = re.compile(rf"^{re.escape(package)}_" if package else rf"^({source.pattern or re.escape(source.package)})_")
    found = sorted(p for p in debs.glob("*.deb") if pattern.match(p.name))
    return found[-1] if found else None


def read_pins(pins) -> dict[str, str]:
    """``{package: version}`` from a dict, a corpus's ``meta.json``, a run's ``env.json`` or a text file of lines
    ``package=version`` (``#`` starts a comment)."""
    if isinstance(pins, dict):
        return {str(k): str(v) for k, v in pins.items()}
    path = Path(pins)
    if path.is_dir():
        raise ValueError(f"pin: {path} is a folder; give a file in it: a corpus's meta.json, a run's env.json or "
                         "lines package=version")
    if not path.is_file():
        raise ValueError(f"pin: {path} does not exist")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"pin: {path} is not a text file; give a corpus's meta.json, a run's env.json or lines "
                         "package=version") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        obj = None
    out: dict[str, str] = {}
    if isinstance(obj, dict) and "sources" in obj:
        out = _pins_of_sources(path, obj["sources"])
        lines = []
    elif isinstance(obj, dict) and isinstance(obj.get("corpus_identity"), dict):
        lines = obj["corpus_identity"].get("packages", [])
        if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
            raise ValueError(f"pin: {path}: corpus_identity.packages is not a list of package=version strings; "
                             "the file is damaged - pin with the corpus's meta.json instead")
    elif obj is not None:
        raise ValueError(f"pin: {path} is JSON but neither a corpus's meta.json nor a run's env.json")
    else:
        lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        package, sep, version = (part.strip() for part in line.partition("="))
        if not sep or not package or not version:
            raise ValueError(f"pin: {path} line {number}: expected package=version, got {line!r}")
        out[package] = version
    if not out:
        raise ValueError(f"pin: {path} names no package versions")
    return out


def _pins_of_sources(path: Path, sources) -> dict[str, str]:
    """``{package: version}`` of the ``sources`` of a corpus's meta.json (those without a package skipped)."""
    if not isinstance(sources, list) or not all(isinstance(s, dict) for s in sources):
        raise ValueError(f"pin: {path}: sources is not a list of objects; the file is not an intact meta.json - "
                         "pin with another copy of it, a run's env.json or lines package=version")
    out = {}
    for i, source in enumerate(sources):
        if "package" not in source:
            continue
        package, version = source["package"], source.get("version")
        if not isinstance(package, str) or not isinstance(version, str) or not package or not version:
            raise ValueError(f"pin: {path}: sources[{i}] has package {package!r} and version {version!r}, expected "
                             "two names; the file is not an intact meta.json - pin with another copy of it, a run's "
                             "env.json or lines package=version")
        out[package] = version
    return out


def pinned_package(source: Source, pins: dict[str, str]) -> tuple[str, str]:
    """The ``(package, version)`` that ``pins`` gives ``source`` (its package, or a name matching its pattern)."""
    names = [p for p in pins if p == source.package or (source.pattern and re.fullmatch(source.pattern, p))]
    if len(names) != 1:
        wanted = source.package if source.pattern is None else f"a package matching {source.pattern!r}"
        what = "no package" if not names else f"several packages ({', '.join(sorted(names))})"
        raise ValueError(f"pin: the pin list names {what} for source {source.name!r} (wants {wanted})")
    return names[0], pins[names[0]]


def _find_pinned_deb(debs: Path, package: str, version: str) -> Path | None:
    found = sorted(p for p in debs.glob(f"{package}_*.deb") if deb_version(p) == (package, version))
    return found[-1] if found else None


def _fetch_pinned(debs: Path, source: Source, pins: dict[str, str], have_apt: bool, progress: bool) -> Path:
    package, version = pinned_package(source, pins)
    deb = _find_pinned_deb(debs, package, version)
    if deb is not None:
        return deb
    spec = f"{package}={version}"
    if not have_apt:
        raise RuntimeError(_apt_missing_message(f"pinned {spec} for {source.name}", debs))
    _apt_download(debs, spec, progress, f"pinned {spec} is not offered by apt", f"put its .deb file "
                  f"({package}_{version}_*.deb, e.g. from Debian's snapshot archive) into {debs} by hand")
    deb = _find_pinned_deb(debs, package, version)
    if deb is None:
        raise RuntimeError(f"apt-get download {spec} produced no .deb in {debs}")
    return deb


def _apt_download(debs: Path, spec: str, progress: bool, failed: str, hint: str) -> None:
    """``apt-get download spec`` into ``debs``; a failure raises RuntimeError with apt's message and ``hint``."""
    if progress:
        print(f"  apt-get download {spec}", flush=True)
    try:
        _run(["apt-get", "download", spec], cwd=debs)
    except subprocess.CalledProcessError as err:
        raise RuntimeError(f"{failed} ({(err.stderr or '').strip()[-300:]}); {hint}") from err


def fetch_packages(debs: Path, progress: bool = True, pins: dict[str, str] | None = None) -> dict[str, Path]:
    """``{source name: .deb path}``, downloading with ``apt-get download`` what is not already in ``debs``.

    ``pins`` (``{package: version}``, see :func:`read_pins`): take exactly those versions, from ``debs`` or apt.
    """
    debs.mkdir(parents=True, exist_ok=True)
    out = {}
    have_apt = shutil.which("apt-get") is not None and shutil.which("apt-cache") is not None
    for source in SOURCES:
        if pins is not None:
            out[source.name] = _fetch_pinned(debs, source, pins, have_apt, progress)
            continue
        deb = _find_deb(debs, source, None if source.pattern else source.package)
        if deb is None:
            if not have_apt:
                raise RuntimeError(_apt_missing_message(f"package for {source.name}", debs))
            package = resolve_package(source)
            _apt_download(debs, package, progress, f"`apt-get download {package}` failed",
                          f"run `apt-get update` first, or put the .deb into {debs} by hand")
            deb = _find_deb(debs, source, package)
            if deb is None:
                raise RuntimeError(f"apt-get download {package} produced no .deb in {debs}")
        out[source.name] = deb
    return out


def deb_version(deb: Path) -> tuple[str, str]:
    """(package, version) from a Debian file name ``name_version_arch.deb``."""
    name, version = deb.name.split("_")[:2]
    return name, version.replace("%3a", ":")


def _corrupt_deb(deb: Path, why: str) -> ValueError:
    return ValueError(f"{deb} is not a readable Debian package ({why.strip() or 'no details'}); the file is corrupt or "
                      "truncated (an interrupted download?): delete it and prepare again")


def _deb_data_tar(deb: Path) -> tarfile.TarFile:
    """The data archive of a .deb, read in full, so that a damaged file fails here (:func:`_corrupt_deb`): a streaming
    reader stops at the tar's end marker and would never reach the compressed stream's checksum."""
    if shutil.which("dpkg-deb"):
        try:
            raw = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], check=True, capture_output=True).stdout
        except subprocess.CalledProcessError as err:
            said = [line.strip() for line in err.stderr.decode(errors="replace").splitlines() if line.strip()]
            raise _corrupt_deb(deb, "dpkg-deb --fsys-tarfile failed: " + " / ".join(said[-3:])) from None
        return _open_tar(deb, raw)
    data = deb.read_bytes()
    if data[:8] != b"!<arch>\n":
        raise _corrupt_deb(deb, "no ar header")
    pos = 8
    while pos + 60 <= len(data):
        name = data[pos : pos + 16].decode(errors="replace").strip().rstrip("/")
        try:
            size = int(data[pos + 48 : pos + 58].decode(errors="replace").strip())
        except ValueError:
            raise _corrupt_deb(deb, f"bad ar member header at byte {pos}") from None
        if pos + 60 + size > len(data):
            raise _corrupt_deb(deb, f"member {name} ends past the end of the file")
        if name.startswith("data.tar"):
            return _open_tar(deb, _decompress(deb, name, data[pos + 60 : pos + 60 + size]))
        pos += 60 + size + (size % 2)
    raise _corrupt_deb(deb, "no data.tar member")


_DECOMPRESSORS = {"data.tar": bytes, "data.tar.xz": lzma.decompress, "data.tar.gz": gzip.decompress,
                  "data.tar.bz2": bz2.decompress}


def _decompress(deb: Path, member: str, body: bytes) -> bytes:
    if member.endswith(".zst"):
        raise RuntimeError(f"{deb}: zstd-compressed package; install dpkg (dpkg-deb) to read it")
    if member not in _DECOMPRESSORS:
        raise _corrupt_deb(deb, f"unknown data member {member}")
    try:
        return _DECOMPRESSORS[member](body)
    except (lzma.LZMAError, zlib.error, EOFError, OSError) as err:  # bz2 and gzip raise OSError for bad data
        raise _corrupt_deb(deb, f"{member}: {err}") from None


def _open_tar(deb: Path, raw: bytes) -> tarfile.TarFile:
    try:
        return tarfile.open(fileobj=io.BytesIO(raw), mode="r:")
    except tarfile.TarError as err:
        raise _corrupt_deb(deb, f"data archive: {err}") from None


def extract_wanted(deb: Path, wants: Callable[[str], bool], dest: Path) -> int:
    """Write the regular files of ``deb`` whose path satisfies ``wants`` under ``dest``; return how many."""
    count = 0
    with _deb_data_tar(deb) as tar:
        try:
            for member in tar:
                path = member.name.lstrip("./")
                if not member.isfile() or not wants("/" + path):
                    continue
                target = dest / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
                count += 1
        except tarfile.TarError as err:
            raise _corrupt_deb(deb, f"data archive: {err}") from None
    if count == 0:
        raise RuntimeError(f"{deb.name}: none of the expected files were found inside the package")
    return count


# --------------------------------------------------------------------------------------------- documents


def held_out(source: str, docs: list[tuple[str, str]]) -> set[int]:
    """Indices of the documents of ``source`` that go to validation (whole long documents, fixed seed)."""
    if len(docs) < 4:
        return set()
    total = sum(len(t) for _, t in docs)
    eligible = [i for i, (_, t) in enumerate(docs) if len(t) >= MIN_VAL_DOC_CHARS]
    rng = np.random.default_rng([SPLIT_SEED, zlib.crc32(source.encode())])
    chosen, chars = set(), 0
    for i in rng.permutation(eligible) if eligible else []:
        if chars >= VAL_FRACTION * total:
            break
        chosen.add(int(i))
        chars += len(docs[i][1])
    return chosen


def collect_documents(work: Path, debs: dict[str, Path], progress: bool = True):
    """Extract every source; yield ``(source, package, version, [(doc name, text)])``."""
    for source in SOURCES:
        deb = debs[source.name]
        package, version = deb_version(deb)
        root = work / source.name
        if root.exists():
            shutil.rmtree(root)
        extract_wanted(deb, source.wants, root)
        docs = [(n, t) for n, t in source.documents(root) if len(t) >= MIN_DOC_CHARS]
        shutil.rmtree(root)
        if progress:
            print(f"  {source.name:16s} {package} {version}: {len(docs)} documents, "
                  f"{sum(len(t) for _, t in docs) / 1e6:.1f} MB of text", flush=True)
        yield source, package, version, docs
