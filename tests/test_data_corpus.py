"""Corpora: offline GPT-2 BPE, trained BPE, R/SWORD/HTML readers, the token format, and full `prepare` runs of the
Debian and OpenWebText recipes on small synthetic packages/shards in the real formats (nothing is downloaded)."""

from __future__ import annotations

import gzip
import io
import json
import os
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from pathlab.data import debian, openwebtext, tokenizer as tok
from pathlab.data.corpus import corpus_tokenizer, load_tokens, prepare
from pathlab.data.rdata import character_vector, read_lazyload_bytes, unserialize
from pathlab.data.sword import read_books
from pathlab.data.textclean import html_to_text, osis_to_text, unwrap_paragraphs
from pathlab.data.tokens import CorpusError, SplitWriter, check_files, open_split, read_meta, write_corpus

# ----------------------------------------------------------------------------------------------- tokenizers


def test_gpt2_tokenizer_known_encodings():
    enc = tok.gpt2_tokenizer()
    assert enc.n_vocab == 50257 and enc.eot_token == 50256
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode_ordinary(" the") == [262]
    assert enc.encode_ordinary("The") == [464]
    assert enc.encode_ordinary("hello") == [31373]
    assert [enc.encode_ordinary(c) for c in (",", ".", "\n")] == [[11], [13], [198]]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    text = "Naïve café — 日本語, emoji 🙂 and  double  spaces\n\n"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_gpt2_tokenizer_refuses_files_that_are_not_gpt2s(tmp_path, monkeypatch):
    bpe, enc = tok.find_gpt2_files()
    (tmp_path / "vocab.bpe").write_bytes(bpe.read_bytes() + b"x")
    (tmp_path / "encoder.json").write_bytes(enc.read_bytes())
    monkeypatch.setenv("PATHLAB_GPT2_DIR", str(tmp_path))
    tok.gpt2_tokenizer.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="not GPT-2's file"):
            tok.gpt2_tokenizer()
    finally:
        monkeypatch.delenv("PATHLAB_GPT2_DIR")
        tok.gpt2_tokenizer.cache_clear()


def test_trained_bpe_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    words = ["attention", "rotation", "position", "kernel", "the", "of", "and", "é", "数据"]
    texts = [" ".join(rng.choice(words, 300)) + "." for _ in range(20)]
    ranks = tok.train_bpe(texts, 300)
    tok.save_bpe(tmp_path / "t.tiktoken", ranks)
    enc = tok.load_bpe(tmp_path / "t.tiktoken", "bpe300")
    assert enc.n_vocab == len(ranks) + 1 <= 300 and enc.eot_token not in ranks.values()
    for t in texts[:3] + ["unseen words ü 🙂"]:
        assert enc.decode(enc.encode_ordinary(t)) == t
    assert len(enc.encode_ordinary(texts[0])) < len(texts[0].encode()) / 2  # merges were learned
    with pytest.raises(ValueError, match="vocab_size"):
        tok.train_bpe(texts, 100)


# ----------------------------------------------------------------------------------------------- readers


def _r_int(v):
    return struct.pack(">i", v)


def _r_chars(s: str | None):
    if s is None:  # NA_character_
        return _r_int(9) + _r_int(-1)
    b = s.encode()
    return _r_int(9 | (1 << 15)) + _r_int(len(b)) + b  # CHARSXP, UTF-8 flag


def _r_strings(values, attrs=b""):
    return _r_int(16 | ((1 << 9) if attrs else 0)) + _r_int(len(values)) + b"".join(map(_r_chars, values)) + attrs


def _r_ints(values, attrs=b""):
    return _r_int(13 | ((1 << 9) if attrs else 0)) + _r_int(len(values)) + b"".join(map(_r_int, values)) + attrs


def _r_list(items, attrs=b""):
    return _r_int(19 | ((1 << 9) if attrs else 0)) + _r_int(len(items)) + b"".join(items) + attrs


def _r_names(names):
    """An attribute pairlist holding names = c(...)."""
    return _r_int(2 | (1 << 10)) + _r_int(1) + _r_chars("names") + _r_strings(names) + _r_int(254)


def _r_serialize(body: bytes) -> bytes:
    return b"X\n" + _r_int(2) + _r_int(0x040201) + _r_int(0x020300) + body


def test_r_lazyload_database_is_read_without_r():
    books = {"emma": ["EMMA", "", "By Jane Austen", "", "It was a", "fine day."], "persuasion": ["Persuasion", None]}
    rdb, index = b"", []
    for name, lines in books.items():
        raw = _r_serialize(_r_strings(lines))
        record = struct.pack(">I", len(raw)) + zlib.compress(raw)
        index.append((len(rdb), len(record)))
        rdb += record
    variables = _r_list([_r_ints(list(loc)) for loc in index], _r_names(list(books)))
    rdx_obj = _r_list([variables, _r_list([]), _r_int(10) + _r_int(1) + _r_int(1)],
                      _r_names(["variables", "references", "compressed"]))
    out = read_lazyload_bytes(gzip.compress(_r_serialize(rdx_obj)), rdb)
    assert list(out) == ["emma", "persuasion"]
    assert character_vector(out["emma"]) == books["emma"]
    assert character_vector(out["persuasion"]) == ["Persuasion", ""]
    assert unwrap_paragraphs(character_vector(out["emma"])) == "EMMA\n\nBy Jane Austen\n\nIt was a fine day."
    with pytest.raises(ValueError, match="XDR"):
        unserialize(b"A\n" + b"\0" * 12)


def _write_ztext(folder: Path, books: dict[str, list[str]]):
    """A SWORD zText New Testament with one block per book (module heading verse first)."""
    folder.mkdir(parents=True)
    verses = [(0, b"")]  # slot 0: empty
    blocks = [b'<milestone type="x-importer" n="test"/>']
    verses.append((0, blocks[0]))
    for name, vs in books.items():
        block, entries = b"", []
        for i, v in enumerate(vs):
            if i == 0:
                v = f'<div osisID="{name}" type="book"/><milestone n="{name}" type="x-usfm-toc2"/>' + v
            data = v.encode()
            entries.append((len(block), data))
            block += data
        blocks.append(block)
        for off, data in entries:
            verses.append((len(blocks) - 1, off, len(data)))
    bzz, bzs = b"", b""
    for b in blocks:
        c = zlib.compress(b)
        bzs += struct.pack("<III", len(bzz), len(c), len(b))
        bzz += c
    bzv = struct.pack("<IIH", 0, 0, 0) + struct.pack("<IIH", 0, 0, len(blocks[0]))
    bzv += b"".join(struct.pack("<IIH", *v) for v in verses[2:])
    (folder / "nt.bzs").write_bytes(bzs)
    (folder / "nt.bzz").write_bytes(bzz)
    (folder / "nt.bzv").write_bytes(bzv)


def test_sword_ztext_reader(tmp_path):
    _write_ztext(tmp_path / "m", {
        "Jude": ['<chapter sID="Jude.1"/><w lemma="x">Jude</w>, a servant<note>a footnote</note>.',
                 "<w>To</w> <w>those</w><note>n</note><w>called</w>."],
        "Revelation": ['<title type="main">The Revelation</title><chapter sID="Rev.1"/>This is it.'],
    })
    books = dict(read_books(tmp_path / "m"))
    assert list(books) == ["Jude", "Revelation"]
    assert books["Jude"] == "Jude, a servant. To those called."
    assert books["Revelation"] == "The Revelation\nThis is it."


def test_html_and_osis_cleaning():
    page = ('<html><head><title>T</title><style>p{}</style></head><body><div class="navheader">Prev Next</div>'
            "<h1>Title</h1><p>Some  <b>bold</b>\n text.</p><pre>code  kept\n  indented</pre>"
            '<div class="navfooter">Home</div></body></html>')
    assert html_to_text(page) == "Title\n\nSome bold text.\n\ncode  kept\n  indented"
    assert osis_to_text("<w>God</w><note>x</note><w>created</w> it<note>y</note>.") == "God created it."


# ----------------------------------------------------------------------------------------------- format


def test_split_writer_is_atomic_and_meta_is_checked(tmp_path):
    with pytest.raises(RuntimeError):
        with SplitWriter(tmp_path, "train", eot=9) as w:
            w.add([1, 2, 3])
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []  # nothing left behind that could be taken for a finished file
    with pytest.raises(CorpusError, match="not a prepared corpus"):
        read_meta(tmp_path)
    write_corpus(tmp_path, "t", {"train": [[1, 2, 3], [4]], "val": [[5, 6]]}, {"name": "t", "vocab_size": 10,
                                                                               "eot": 9})
    np.testing.assert_array_equal(open_split(tmp_path, "train"), [1, 2, 3, 9, 4, 9])
    np.testing.assert_array_equal(np.load(tmp_path / "train.docs.npy"), [0, 4, 6])
    assert read_meta(tmp_path)["splits"]["train"]["longest_document"] == 4
    assert check_files(tmp_path, hashes=True) == []
    data = bytearray((tmp_path / "val.bin").read_bytes())
    data[0] ^= 1
    (tmp_path / "val.bin").write_bytes(bytes(data))
    assert any("SHA-256" in p for p in check_files(tmp_path, hashes=True))
    (tmp_path / "val.bin").write_bytes(bytes(data[:2]))
    with pytest.raises(CorpusError, match="corrupt or unfinished"):
        open_split(tmp_path, "val")
    with pytest.raises(ValueError, match="token ids"):
        with SplitWriter(tmp_path / "x", "train", eot=9, vocab_size=10) as w:
            w.add([10])


# ----------------------------------------------------------------------------------------------- full recipes


def _words(rng, n_chars):
    vocab = ["kernel", "memory", "page", "the", "of", "and", "driver", "Emma", "said", "lord", "query", "table"]
    out = []
    while sum(map(len, out)) + len(out) < n_chars:
        out.append(str(rng.choice(vocab)))
    return " ".join(out) + "."


def _fake_deb(path: Path, files: dict[str, bytes]):
    """A Debian binary package (ar: debian-binary, control.tar.gz, data.tar.xz) holding ``files``."""
    def tar_bytes(entries, mode):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode=mode) as t:
            for name, data in entries.items():
                info = tarfile.TarInfo("./" + name.lstrip("/"))
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    pkg = path.name.split("_")[0]
    members = {
        "debian-binary": b"2.0\n",
        "control.tar.gz": tar_bytes({"control": f"Package: {pkg}\nVersion: 1.0\nArchitecture: all\n"
                                                f"Maintainer: t <t@t>\nDescription: t\n".encode()}, "w:gz"),
        "data.tar.xz": tar_bytes(files, "w:xz"),
    }
    out = b"!<arch>\n"
    for name, data in members.items():
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data + b"\n" * (len(data) % 2)
    path.write_bytes(out)


def _fake_debian_packages(debs: Path, rng):
    debs.mkdir(parents=True)
    # Austen: an R lazy-load database with 5 novels.
    novels = {f"novel{i}": [_words(rng, 4000) for _ in range(6)] for i in range(5)}
    rdb, index = b"", []
    for lines in novels.values():
        raw = _r_serialize(_r_strings(lines))
        rec = struct.pack(">I", len(raw)) + zlib.compress(raw)
        index.append((len(rdb), len(rec)))
        rdb += rec
    rdx = gzip.compress(_r_serialize(_r_list(
        [_r_list([_r_ints(list(x)) for x in index], _r_names(list(novels))), _r_list([]),
         _r_int(10) + _r_int(1) + _r_int(1)], _r_names(["variables", "references", "compressed"]))))
    lib = "usr/lib/R/site-library/janeaustenr/data/"
    _fake_deb(debs / "r-cran-janeaustenr_1.0-1_all.deb", {lib + "Rdata.rdx": rdx, lib + "Rdata.rdb": rdb})
    # Bible: a zText module with 4 books.
    tmp = debs / "_sword"
    _write_ztext(tmp, {f"Book{i}": [_words(rng, 6000) for _ in range(4)] for i in range(4)})
    mod = "usr/share/sword/modules/texts/ztext/web/"
    _fake_deb(debs / "sword-text-web_1.0_all.deb", {mod + p.name: p.read_bytes() for p in tmp.iterdir()})
    for p in tmp.iterdir():
        p.unlink()
    tmp.rmdir()
    _fake_deb(debs / "jargon-text_1.0_all.deb",
              {"usr/share/doc/jargon-text/jargon.txt.gz": gzip.compress(_words(rng, 3000).encode())})
    _fake_deb(debs / "python3.99-doc_1.0_all.deb", {
        f"usr/share/doc/python3.99/html/_sources/lib/m{i}.rst.txt": _words(rng, 25000 if i < 2 else 3000).encode()
        for i in range(5)})
    _fake_deb(debs / "postgresql-doc-99_1.0_all.deb", {
        f"usr/share/doc/postgresql-doc-99/html/p{i}.html":
            f"<html><body><div class='navheader'>nav</div><p>{_words(rng, 3000)}</p></body></html>".encode()
        for i in range(4)})
    _fake_deb(debs / "linux-doc-9.9_1.0_all.deb", {
        f"usr/share/doc/linux-doc-9.9/Documentation/d{i}.rst.gz": gzip.compress(_words(rng, 22000).encode())
        for i in range(6)})


@pytest.fixture(scope="module")
def debian_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("debian")
    _fake_debian_packages(root / "debs", np.random.default_rng(0))
    folder = prepare("debian", root / "corpus", progress=False, debs=root / "debs")
    return root, folder


def test_debian_recipe_end_to_end_on_fake_packages(debian_corpus):
    root, folder = debian_corpus
    meta = read_meta(folder)
    by_source = {s["source"]: s for s in meta["sources"]}
    assert set(by_source) == {s.name for s in debian.SOURCES}
    assert by_source["python-docs"]["package"] == "python3.99-doc" and by_source["linux-docs"]["version"] == "1.0"
    assert by_source["jargon"]["val_documents"] == 0  # fewer than 4 documents: all training
    assert by_source["austen"]["val_documents"] == 1 and by_source["linux-docs"]["val_documents"] >= 1
    assert by_source["postgresql-docs"]["val_documents"] == 0  # no document long enough to hold out
    for name in by_source["python-docs"]["val_document_names"]:
        assert name.endswith(("m0.rst.txt", "m1.rst.txt"))  # only long documents are held out
    val = load_tokens(folder, "val")
    offsets = np.load(folder / "val.docs.npy")
    enc = corpus_tokenizer(folder)
    assert all(val[o - 1] == enc.eot_token for o in offsets[1:])
    first = enc.decode(val[offsets[0] : offsets[1] - 1].tolist())
    assert "navheader" not in first and first.endswith(".")
    assert meta["splits"]["train"]["tokens"] == sum(s["train_tokens"] for s in meta["sources"])
    assert check_files(folder, hashes=True) == []


def test_debian_prepare_again_is_a_no_op_and_repairs_corruption(debian_corpus, capsys):
    root, folder = debian_corpus
    stamp = (folder / "train.bin").stat().st_mtime_ns
    prepare("debian", folder, progress=True, debs=root / "debs")
    assert "up to date" in capsys.readouterr().out
    assert (folder / "train.bin").stat().st_mtime_ns == stamp
    good = (folder / "train.bin").read_bytes()
    (folder / "train.bin").write_bytes(good[:-2])  # a half-written file
    with pytest.raises(CorpusError):
        load_tokens(folder, "train")
    prepare("debian", folder, progress=False, debs=root / "debs")
    assert (folder / "train.bin").read_bytes() == good


def test_debian_packages_read_without_dpkg(debian_corpus, monkeypatch, tmp_path):
    root, _ = debian_corpus
    real_which = debian.shutil.which
    monkeypatch.setattr(debian.shutil, "which", lambda name: None if name == "dpkg-deb" else real_which(name))
    deb = root / "debs" / "jargon-text_1.0_all.deb"
    assert debian.extract_wanted(deb, lambda p: p.endswith(".gz"), tmp_path) == 1
    assert (tmp_path / "usr/share/doc/jargon-text/jargon.txt.gz").is_file()
    assert debian.deb_version(Path("x/python3.11-doc_3.11.2-6%3a1_all.deb")) == ("python3.11-doc", "3.11.2-6:1")


def test_missing_apt_gives_instructions(tmp_path, monkeypatch):
    monkeypatch.setattr(debian.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="apt is not available.*Download the packages by hand"):
        debian.fetch_packages(tmp_path / "debs", progress=False)


def _owt_shards(raw: Path, docs_per_xz, rng):
    raw.mkdir(parents=True)
    texts = []
    for s, sizes in enumerate(docs_per_xz):
        outer = io.BytesIO()
        with tarfile.open(fileobj=outer, mode="w") as shard:
            for x, n in enumerate(sizes):
                inner = io.BytesIO()
                with tarfile.open(fileobj=inner, mode="w:xz") as t:
                    for d in range(n):
                        text = f"doc {s}-{x}-{d}\n\n\n\n" + _words(rng, int(rng.integers(50, 400))) + "\n\n"
                        texts.append(text)
                        data = text.encode()
                        info = tarfile.TarInfo(f"{s:04d}-{x}-{d}.txt")
                        info.size = len(data)
                        t.addfile(info, io.BytesIO(data))
                blob = inner.getvalue()
                info = tarfile.TarInfo(f"openwebtext/urlsf_subset{s:02d}-{x}_data.xz")
                info.size = len(blob)
                shard.addfile(info, io.BytesIO(blob))
        (raw / openwebtext.shard_name(s)).write_bytes(outer.getvalue())
    return texts


def test_openwebtext_recipe_on_synthetic_shards(tmp_path, capsys):
    texts = _owt_shards(tmp_path / "raw", [[600, 700], [701]], np.random.default_rng(1))
    folder = prepare("openwebtext", tmp_path / "owt", progress=False, raw=tmp_path / "raw", n_shards=2)
    enc = tok.gpt2_tokenizer()
    cleaned = [openwebtext._clean(t.encode()) for t in texts]
    assert cleaned[0].startswith("doc 0-0-0\n\n") and "\n\n\n" not in cleaned[0]
    train_idx, val_idx = openwebtext.split_indices(len(texts))
    assert len(val_idx) == 2  # ceil(0.0005 * 2001): rounded up, as datasets does
    assert sorted(np.concatenate([train_idx, val_idx]).tolist()) == list(range(len(texts)))
    expect_val = [t for i in val_idx for t in enc.encode_ordinary(cleaned[i]) + [50256]]
    np.testing.assert_array_equal(load_tokens(folder, "val"), expect_val)  # val in permutation order
    is_val = set(val_idx.tolist())
    train = load_tokens(folder, "train")
    offsets = np.load(folder / "train.docs.npy")
    kept = [i for i in range(len(texts)) if i not in is_val]
    assert len(offsets) - 1 == len(kept)
    for k in (0, 1234, len(kept) - 1):  # spot-check documents in source order
        assert enc.decode(train[offsets[k] : offsets[k + 1] - 1].tolist()) == cleaned[kept[k]]
    assert read_meta(folder)["sources"][0]["documents"] == len(texts)
    assert not (folder / "work").exists()
    prepare("openwebtext", tmp_path / "owt", progress=True, raw=tmp_path / "raw", n_shards=2)
    assert "up to date" in capsys.readouterr().out


def test_data_cli(debian_corpus, capsys):
    from pathlab.cli import main

    _, folder = debian_corpus
    assert main(["data", "info", str(folder)]) == 0
    assert "train" in capsys.readouterr().out
    assert main(["data", "verify", str(folder)]) == 0
    assert main(["data", "info", str(folder / "nowhere")]) == 1
    assert "pathlab data info" in capsys.readouterr().err
    json.loads((folder / "meta.json").read_text())
    assert os.access(folder / "meta.json", os.R_OK)


# ----------------------------------------------------------------------------------------------- pinning and ids


def test_pinned_package_versions_are_used_or_fetched_by_version(debian_corpus, tmp_path, monkeypatch):
    import shutil
    import subprocess

    root, folder = debian_corpus
    debs = tmp_path / "debs"
    shutil.copytree(root / "debs", debs)
    jargon = debs / "jargon-text_1.0_all.deb"
    shutil.copy(jargon, debs / "jargon-text_2.0_all.deb")  # a newer version arrived: unpinned, it is taken
    assert debian.fetch_packages(debs, progress=False)["jargon"].name == "jargon-text_2.0_all.deb"
    pins = debian.read_pins(folder / "meta.json")
    assert pins["jargon-text"] == "1.0" and pins["python3.99-doc"] == "1.0" and len(pins) == len(debian.SOURCES)
    assert debian.fetch_packages(debs, progress=False, pins=pins)["jargon"].name == "jargon-text_1.0_all.deb"
    pin_file = tmp_path / "pins.txt"
    pin_file.write_text("# package=version, as apt-get download takes them\n"
                        + "".join(f"{p}={v}\n" for p, v in pins.items()))
    assert debian.read_pins(pin_file) == pins
    env = tmp_path / "env.json"  # a run's env.json records the versions its corpus was made from
    env.write_text(json.dumps({"corpus_identity": {"packages": [f"{p}={v}" for p, v in pins.items()]}}))
    assert debian.read_pins(env) == pins

    calls = []

    def fake_apt(cmd, cwd=None):
        calls.append(cmd)
        if cmd[-1] != "jargon-text=3.0":
            raise subprocess.CalledProcessError(100, cmd, stderr=f"E: Version '{cmd[-1]}' was not found")
        (Path(cwd) / "jargon-text_3.0_all.deb").write_bytes(jargon.read_bytes())
        return ""

    monkeypatch.setattr(debian, "_run", fake_apt)
    monkeypatch.setattr(debian.shutil, "which", lambda name: f"/usr/bin/{name}")
    got = debian.fetch_packages(debs, progress=False, pins={**pins, "jargon-text": "3.0"})
    assert got["jargon"].name == "jargon-text_3.0_all.deb" and calls == [["apt-get", "download", "jargon-text=3.0"]]
    with pytest.raises(RuntimeError, match=r"pinned jargon-text=4.0 .*not offered by apt.*by hand"):
        debian.fetch_packages(debs, progress=False, pins={**pins, "jargon-text": "4.0"})
    with pytest.raises(ValueError, match="names no package for source 'jargon'"):
        debian.fetch_packages(debs, progress=False, pins={p: v for p, v in pins.items() if p != "jargon-text"})


def test_pinned_prepare_reproduces_the_corpus(debian_corpus, tmp_path, capsys):
    import shutil

    from pathlab.cli import main

    root, folder = debian_corpus
    debs = tmp_path / "debs"
    shutil.copytree(root / "debs", debs)
    shutil.copy(debs / "jargon-text_1.0_all.deb", debs / "jargon-text_2.0_all.deb")
    out = tmp_path / "again"
    assert main(["data", "prepare", "debian", "--out", str(out), "--debs", str(debs), "--pin",
                 str(folder / "meta.json"), "--no-progress"]) == 0
    a, b = read_meta(folder), read_meta(out)
    assert a["splits"] == b["splits"] and a["sources"] == b["sources"]  # the same tokens, file for file
    prepare("debian", out, progress=True, debs=debs, pin=folder / "meta.json")
    assert "up to date" in capsys.readouterr().out
    prepare("debian", out, progress=False, debs=debs, pin={**debian.read_pins(folder / "meta.json"),
                                                           "jargon-text": "2.0"})
    assert {s["source"]: s["version"] for s in read_meta(out)["sources"]}["jargon"] == "2.0"  # other pins: rebuilt
    assert main(["data", "prepare", "debian", "--out", str(out), "--pin", str(tmp_path / "nowhere.txt")]) == 1
    assert "nowhere.txt" in capsys.readouterr().err


def test_token_ids_are_checked_against_the_vocabulary(tmp_path):
    write_corpus(tmp_path, "t", {"train": [[1, 2, 3], [4]], "val": [[5, 6]]}, {"name": "t", "vocab_size": 10,
                                                                               "eot": 9})
    open_split(tmp_path, "train", vocab_size=10)
    data = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    data[2] = 10
    data.tofile(tmp_path / "train.bin")
    open_split(tmp_path, "train")  # sizes only, unless a vocabulary is given
    with pytest.raises(CorpusError, match=r"train.bin: token id 10 at position 2 .*vocabulary of 10"):
        open_split(tmp_path, "train", vocab_size=10)


# ----------------------------------------------------------------------------------------- bad input loses nothing


def _copy_corpus(debian_corpus, tmp_path):
    """A private copy of the prepared fake corpus and of its packages, for tests that damage or replace them."""
    import shutil

    root, folder = debian_corpus
    shutil.copytree(root / "debs", tmp_path / "debs")
    return shutil.copytree(folder, tmp_path / "corpus"), tmp_path / "debs"


def _intact(folder: Path, meta: dict) -> bool:
    return read_meta(folder) == meta and check_files(folder, hashes=True) == []


def test_a_pin_apt_does_not_offer_leaves_the_corpus_prepared(debian_corpus, tmp_path, monkeypatch, capsys):
    import subprocess

    from pathlab.cli import main

    folder, debs = _copy_corpus(debian_corpus, tmp_path)
    meta = read_meta(folder)

    def no_such_version(cmd, cwd=None):
        raise subprocess.CalledProcessError(100, cmd, stderr=f"E: Version '{cmd[-1]}' was not found")

    monkeypatch.setattr(debian, "_run", no_such_version)
    monkeypatch.setattr(debian.shutil, "which", lambda name: f"/usr/bin/{name}")
    pins = tmp_path / "pins.txt"
    typo = {**debian.read_pins(folder / "meta.json"), "jargon-text": "4.4.7-9"}
    pins.write_text("".join(f"{p}={v}\n" for p, v in typo.items()))
    assert main(["data", "prepare", "debian", "--out", str(folder), "--debs", str(debs), "--pin", str(pins),
                 "--no-progress"]) == 1
    assert "pinned jargon-text=4.4.7-9 is not offered by apt" in capsys.readouterr().err
    assert _intact(folder, meta)  # the typo lost nothing
    assert main(["data", "info", str(folder)]) == 0


def test_a_corrupt_package_is_named_and_the_corpus_kept(debian_corpus, tmp_path):
    folder, debs = _copy_corpus(debian_corpus, tmp_path)
    meta = read_meta(folder)
    good = (debs / "jargon-text_1.0_all.deb").read_bytes()
    broken = debs / "jargon-text_2.0_all.deb"
    broken.write_bytes(good[: len(good) // 2])  # an interrupted download
    pins = {**debian.read_pins(folder / "meta.json"), "jargon-text": "2.0"}
    with pytest.raises(ValueError, match=r"jargon-text_2\.0_all\.deb is not a readable Debian package .*"
                                         r"delete it and prepare again"):
        prepare("debian", folder, progress=False, debs=debs, pin=pins)
    assert _intact(folder, meta)
    assert not (folder / "work").exists() and not any(p.name.startswith(".prepare") for p in folder.iterdir())


def test_a_corrupt_package_is_named_with_the_way_out(debian_corpus, tmp_path, monkeypatch):
    _, debs = _copy_corpus(debian_corpus, tmp_path)
    deb = debs / "linux-doc-9.9_1.0_all.deb"
    deb.write_bytes(deb.read_bytes()[:-100])  # an interrupted download
    message = "linux-doc-9.9_1.0_all.deb is not a readable Debian package .*delete it and prepare again"
    if debian.shutil.which("dpkg-deb"):
        with pytest.raises(ValueError, match=message.replace(" .*", r" \(dpkg-deb --fsys-tarfile failed: .*")):
            debian.extract_wanted(deb, lambda p: True, tmp_path / "out")
    real_which = debian.shutil.which
    monkeypatch.setattr(debian.shutil, "which", lambda name: None if name == "dpkg-deb" else real_which(name))
    with pytest.raises(ValueError, match=message):
        debian.extract_wanted(deb, lambda p: True, tmp_path / "out")
    deb = debs / "jargon-text_1.0_all.deb"  # incompressible content, stored: a damaged byte decodes without error
    _fake_deb(deb, {"usr/share/doc/jargon-text/jargon.txt.gz": np.random.default_rng(0).bytes(100_000)})
    data = bytearray(deb.read_bytes())
    data[len(data) // 2] ^= 0xFF  # only the checksum at the end of data.tar.xz tells
    deb.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="data.tar.xz: .*delete it and prepare again"):
        debian.extract_wanted(deb, lambda p: True, tmp_path / "out")


def test_prepare_refuses_a_folder_that_holds_another_corpus(debian_corpus, tmp_path, capsys):
    from pathlab.cli import main

    folder, debs = _copy_corpus(debian_corpus, tmp_path)
    other = {**read_meta(folder), "name": "debian-bpe4k"}
    (folder / "meta.json").write_text(json.dumps(other))
    (folder / "tokenizer.tiktoken").write_text("its trained BPE\n")
    assert main(["data", "prepare", "debian", "--out", str(folder), "--debs", str(debs), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "holds the corpus 'debian-bpe4k', not 'debian'" in err and "another folder" in err
    assert _intact(folder, other) and (folder / "tokenizer.tiktoken").read_text() == "its trained BPE\n"


def test_prepare_clears_what_a_killed_preparation_left(debian_corpus, tmp_path, capsys):
    folder, debs = _copy_corpus(debian_corpus, tmp_path)
    stamp = (folder / "train.bin").stat().st_mtime_ns
    leftovers = [folder / ".train.bin.k1ll3d.tmp", folder / ".val.bin.x8y9z0.tmp",
                 folder / ".prepare.tmp" / "val.bin"]
    for path in leftovers:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"\0" * 64)
    prepare("debian", folder, progress=True, debs=debs)
    assert "up to date" in capsys.readouterr().out and (folder / "train.bin").stat().st_mtime_ns == stamp
    assert not any(p.exists() for p in leftovers) and not (folder / ".prepare.tmp").exists()


@pytest.mark.parametrize("damage,message", [
    (lambda meta: [], "holds an array, not a JSON object"),
    (lambda meta: {k: v for k, v in meta.items() if k != "splits"}, "splits is missing"),
    (lambda meta: {**meta, "splits": {**meta["splits"], "train": {**meta["splits"]["train"], "tokens": "6"}}},
     r"splits\.train\.tokens is a string \('6'\), expected an integer"),
    (lambda meta: {**meta, "tokenizer": {"name": "t"}}, "tokenizer.vocab_size is missing"),
])
def test_meta_json_of_the_wrong_shape_is_refused_by_key(tmp_path, capsys, damage, message):
    from pathlab.cli import main

    write_corpus(tmp_path, "t", {"train": [[1, 2, 3], [4]], "val": [[5, 6]]}, {"name": "t", "vocab_size": 10,
                                                                               "eot": 9})
    (tmp_path / "meta.json").write_text(json.dumps(damage(read_meta(tmp_path))))
    with pytest.raises(CorpusError, match=f"meta.json:? {message}"):
        read_meta(tmp_path)
    for action in ("info", "verify"):
        assert main(["data", action, str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert f"pathlab data {action}: {tmp_path / 'meta.json'}" in err and "prepare" in err


def test_data_info_warns_of_a_truncated_split(debian_corpus, tmp_path, capsys):
    from pathlab.cli import main

    folder, _ = _copy_corpus(debian_corpus, tmp_path)
    data = (folder / "train.bin").read_bytes()
    (folder / "train.bin").write_bytes(data[: len(data) // 2])
    assert main(["data", "info", str(folder)]) == 1
    out = capsys.readouterr().out
    assert f"WARNING: {folder / 'train.bin'} has {len(data) // 2} bytes, expected {len(data)}" in out
    assert "prepare it again" in out


def test_read_pins_names_what_is_wrong_with_the_file(debian_corpus, tmp_path):
    _, folder = debian_corpus
    with pytest.raises(ValueError, match="is a folder; give a file in it"):
        debian.read_pins(folder)
    meta = read_meta(folder)
    del meta["sources"][1]["version"]
    damaged = tmp_path / "meta.json"
    damaged.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"meta.json: sources\[1\] has package 'sword-text-web' and version None"):
        debian.read_pins(damaged)
    (tmp_path / "env.json").write_text(json.dumps({"corpus_identity": {"packages": "jargon-text=1.0"}}))
    with pytest.raises(ValueError, match="corpus_identity.packages is not a list"):
        debian.read_pins(tmp_path / "env.json")
