"""Turn the formats Debian ships documentation in (HTML, hard-wrapped plain text, OSIS XML) into clean prose."""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser

_BLOCK_TAGS = {
    "p", "div", "br", "li", "ul", "ol", "dl", "dt", "dd", "tr", "table", "pre", "h1", "h2", "h3", "h4", "h5",
    "h6", "blockquote", "section", "hr", "title",
}
_SKIP_TAGS = {"script", "style", "head"}
_SKIP_CLASSES = {"navheader", "navfooter", "toc", "navigation", "footer"}


class _TextExtractor(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip_stack: list[str] = []  # tags whose content we are inside and drop
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        classes = set((dict(attrs).get("class") or "").split())
        if self.skip_stack or tag in _SKIP_TAGS or classes & _SKIP_CLASSES:
            if tag not in ("br", "hr", "img", "meta", "link", "input"):
                self.skip_stack.append(tag)
            return
        if tag == "pre":
            self.pre += 1
        if tag in _BLOCK_TAGS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if self.skip_stack:
            if self.skip_stack[-1] == tag:
                self.skip_stack.pop()
            return
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in _BLOCK_TAGS:
            self.parts.append("\n")

    def handle_data(self, data):
        if self.skip_stack:
            return
        self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))


def html_to_text(markup: str) -> str:
    """Visible text of an HTML page: navigation, scripts and styles dropped, blocks on their own lines."""
    parser = _TextExtractor()
    parser.feed(markup)
    parser.close()
    return normalize_whitespace("".join(parser.parts))


def normalize_whitespace(text: str) -> str:
    """Strip trailing spaces, collapse runs of blank lines to one, and trim the ends."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def unwrap_paragraphs(lines: list[str]) -> str:
    """Join hard-wrapped lines into paragraphs (blank line = paragraph break), e.g. Project Gutenberg text."""
    paragraphs, current = [], []
    for line in lines:
        line = (line or "").strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs)


_OSIS_NOTE = re.compile(r"<note\b[^>]*?(?:/>|>.*?</note>)", re.S)
_OSIS_TITLE = re.compile(r"<title\b[^>]*>(.*?)</title>", re.S)
_TAG = re.compile(r"<[^>]+>")


def osis_to_text(markup: str) -> str:
    """Plain text of an OSIS (SWORD) verse: footnotes dropped, titles on their own lines, tags removed."""
    # A footnote often stands in for the space between two words ("God<note>...</note>created").
    markup = _OSIS_NOTE.sub("\x00", markup)
    markup = _OSIS_TITLE.sub(lambda m: "\n" + m.group(1) + "\n", markup)
    text = html.unescape(_TAG.sub("", markup))
    text = re.sub(r"(?<=\w)\x00+(?=\w)", " ", text).replace("\x00", "")
    return re.sub(r"[ \t]+", " ", text).strip(" ")
