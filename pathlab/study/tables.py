"""Markdown tables of a study's committed results, so that every number the docs quote is read from its files.

Two tables per study, each written between markers into the documents that show it::

    <!-- table: pathlab study table owt16-debian cells -->     the ledger: every cell with results
    ...
    <!-- end of table -->
    <!-- table: pathlab study table owt16-debian headline -->  r(L) per cell of one group
    ...                                                         (``headline``, ``window-sweep``, ``seeds``, ``m8``)
    <!-- end of table -->

``pathlab study table <study>`` prints them; ``--write`` replaces every marked block in ``README.md`` and in the
study's ``results/<study>/README.md``. A marker naming a group the study lacks is an error, never a silent skip.
"""

from __future__ import annotations

import re
from pathlib import Path

from pathlab.atomic import atomic_write_text
from pathlab.probes.published import PUBLISHED

END = "<!-- end of table -->"
LENGTHS = (2048, 8192, 32768, 65536)


def _marker(study: str, table: str) -> str:
    return f"<!-- table: pathlab study table {study} {table} -->"


def _k(L: int) -> str:
    """2048 -> 2K, 32768 -> 32K, 65536 -> 65K: the names the paper and the docs use."""
    return f"{L // 1024}K" if L < 65536 else f"{L // 1000}K"


def ratio_text(ev: dict, L: int, scaling: str = "lengths") -> str:
    """``r [lo, hi]`` at length L of one eval.json (its ``scaling`` section), or ``—`` when L was not evaluated."""
    row = ev.get(scaling, {}).get(str(L))
    if row is None:
        return "—"
    lo, hi = row["ratio_ci95"]
    return f"{row['ratio']:.2f} [{lo:.2f}, {hi:.2f}]"


def _revision(cell: dict) -> str:
    rev = cell.get("git_revision") or "unknown"
    return rev[:7] + ("-dirty" if rev.endswith("-dirty") else "")


def _card(cell: dict) -> str:
    """The accelerator a cell ran on, as the ledger names it ("NVIDIA H100 80GB HBM3" -> "H100"), or "CPU"."""
    gpu = cell.get("environment", {}).get("gpu")
    if not gpu:
        return "CPU"
    found = re.search(r"\b[A-Z]\d{2,4}\b", gpu)
    return found.group(0) if found else gpu


def cells_table(study: dict, results: dict) -> str:
    """The ledger's table: one row per cell with results, in the study's order. Stage times depend on the card."""
    head = ("| cell | tokens | iterations | loss at 512 | r(8K) [95%] | r(65K) [95%] | "
            "stage times (s): train / eval / probes | card | code |")
    rows = [head, "|" + "---|" * 9]
    for name in study["cells"]:
        entry = results.get(name)
        if entry is None:
            continue
        cell, ev = entry["cell"], entry["eval"]
        s = cell.get("seconds", {})
        times = " / ".join(f"{s[k]:.0f}" if k in s else "—" for k in ("train_s", "eval_s", "probes_s"))
        rows.append(f"| {name} | {cell['tokens'] / 1e6:.1f}M | {cell['iterations']} | "
                    f"{ev['lengths'][str(ev['train_length'])]['loss']:.3f} | {ratio_text(ev, 8192)} | "
                    f"{ratio_text(ev, 65536)} | {times} | {_card(cell)} | {_revision(cell)} |")
    return "\n".join(rows)


def _published(attention: str) -> str:
    found = [f"r({_k(L)}) = {r}" for model, L, _, r in PUBLISHED if model == attention]
    return ", ".join(found) or "—"


def group_table(study: dict, results: dict, group: str) -> str:
    """r(L) at 2K, 8K, 32K and 65K with 95% intervals for every cell of one group, in the study's order; a cell
    without results says so. The headline group adds the published ratios and NTK-scaled RoPE at evaluation."""
    names = [c for c, spec in study["cells"].items() if spec.get("group") == group]
    if not names:
        groups = sorted({spec.get("group") for spec in study["cells"].values()} - {None})
        raise ValueError(f"study {study['name']!r} has no cells in group {group!r}; its groups: {', '.join(groups)}")
    headline = group == "headline"
    cols = [f"r({_k(L)})" for L in LENGTHS] + ["loss at 512", "tokens"] + (["published"] if headline else [])
    rows = ["| cell | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for name in names:
        entry = results.get(name)
        extra = [_published(study["cells"][name]["attention"])] if headline else []
        if entry is None:
            rows.append(f"| {name} | not yet run |" + " |" * (len(cols) - 2 - len(extra)) + " |"
                        + "".join(f" {e} |" for e in extra))
            continue
        cell, ev = entry["cell"], entry["eval"]
        loss = ev["lengths"][str(ev["train_length"])]["loss"]
        rows.append(f"| {name} | " + " | ".join(ratio_text(ev, L) for L in LENGTHS)
                    + f" | {loss:.3f} | {cell['tokens'] / 1e6:.0f}M |" + "".join(f" {e} |" for e in extra))
        if headline and "ntk" in ev:
            rows.append(f"| {name}, NTK-scaled at evaluation | "
                        + " | ".join(ratio_text(ev, L, "ntk") for L in LENGTHS) + " | — | — | — |")
    return "\n".join(rows)


def render(study: dict, table: str, results: dict) -> str:
    """One table by name: ``cells`` or a group of the study's cells. ``results`` maps each cell with results to
    ``{"cell": cell.json, "eval": eval.json}`` (as :func:`pathlab.study.load_cells` gives)."""
    return cells_table(study, results) if table == "cells" else group_table(study, results, table)


def fill(text: str, study: dict, results: dict) -> str:
    """``text`` with every block marked for this study replaced by its current table (other studies' blocks and
    everything outside the markers are left as they are)."""
    pattern = re.compile(re.escape(_marker(study["name"], "@")).replace("@", r"(\S+)") + r"\n.*?" + re.escape(END),
                         re.S)

    def one(match):
        return f"{_marker(study['name'], match.group(1))}\n{render(study, match.group(1), results)}\n{END}"

    return pattern.sub(one, text)


def write_tables(study: dict, results: dict, paths) -> list[Path]:
    """Rewrite the marked blocks in each of ``paths`` that has any; returns the files that changed."""
    changed = []
    for path in map(Path, paths):
        if not path.is_file():
            continue
        old = path.read_text()
        new = fill(old, study, results)
        if new != old:
            atomic_write_text(path, new)
            changed.append(path)
    return changed
