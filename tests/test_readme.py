"""The README's library snippet runs as written (its inputs defined, the fp64 reference at a size of seconds)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_snippet_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python snippet"
    exec(compile(blocks[0], "README.md", "exec"), {})
    out = capsys.readouterr().out
    error = float(re.search(r"relative error against the fp64 reference: (\S+)", out).group(1))
    assert error < 1e-4
