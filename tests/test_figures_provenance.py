"""Committed figures match the committed code that made them: each JSON's recorded revision is clean, and the
code its figure depends on (its notebook, the probes, the study, the plotting, the interval rules that decide its
claims) is the same at that revision as at HEAD. A figure made by other code must be regenerated (`pathlab figures`) before it is committed."""

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = ["pathlab/probes", "pathlab/figures", "pathlab/study", "pathlab/training/evaluate.py", "pathlab/results.py",
        "pathlab/intervals.py"]
TASKS_CODE = "pathlab/tasks"  # the report and the generators it measures baselines with: for notebooks using them


def _git(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def _made_by() -> dict:
    """figure stem -> the notebook that declares it."""
    out = {}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for stem in json.loads(nb.read_text())["metadata"].get("pathlab", {}).get("writes", []):
            out[stem] = f"notebooks/{nb.name}"
    return out


FIGURES = sorted(p for p in (ROOT / "figures").rglob("*.json"))


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git history of a checkout")
@pytest.mark.parametrize("path", FIGURES, ids=[str(p.relative_to(ROOT / "figures")) for p in FIGURES])
def test_figure_was_made_by_the_committed_code(path):
    record = json.loads(path.read_text())
    rev = record.get("git_revision") or ""
    assert rev and not rev.endswith("-dirty"), f"{path.name}: made from uncommitted code ({rev!r}); regenerate it"
    assert _git("cat-file", "-e", f"{rev}^{{commit}}").returncode == 0, \
        f"{path.name}: revision {rev} is not in this repository's history (a shallow clone cannot check it)"
    notebook = _made_by().get(path.stem)
    assert notebook, f"{path.name}: no notebook declares this figure in its metadata (pathlab.writes)"
    code = CODE + ([TASKS_CODE] if "pathlab.tasks" in (ROOT / notebook).read_text() else [])
    diff = _git("diff", "--stat", rev, "HEAD", "--", notebook, *code)
    assert diff.returncode == 0 and not diff.stdout.strip(), \
        f"{path.name}: the code that makes it changed since {rev[:10]}:\n{diff.stdout}"


def test_an_archive_records_its_commit(tmp_path):
    """``git archive`` of HEAD expands ``pathlab/REVISION`` to HEAD's commit, which :func:`git_revision` reports
    outside a checkout (an archive is that commit exactly); a checkout's unexpanded placeholder reads as None."""
    import subprocess
    import tarfile

    from pathlab.results import archived_revision

    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout
    tar = tmp_path / "head.tar"
    subprocess.run(["git", "archive", "-o", str(tar), "HEAD", "pathlab/REVISION"], cwd=root, check=True)
    with tarfile.open(tar) as archive:
        text = archive.extractfile("pathlab/REVISION").read().decode().strip()
    assert text == head.strip()
    assert archived_revision() is None  # this checkout holds the placeholder
