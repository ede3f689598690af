"""environment.yml wraps `pip install -e .[...]`; pyproject.toml stays the single source of dependencies."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _load():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return env, project


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ \[;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_installs_the_project_with_existing_extras():
    env, project = _load()
    pip_sections = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pip_sections) == 1, "environment.yml needs one pip: section"
    editable = [line for line in pip_sections[0] if re.match(r"^-e\s+\.(\[|$)", line)]
    assert len(editable) == 1, f"environment.yml must install the project with `-e .[extras]`, got {pip_sections[0]}"
    extras = re.findall(r"\[([^\]]*)\]", editable[0])
    known = set(project["optional-dependencies"])
    for extra in (e.strip() for group in extras for e in group.split(",")):
        assert extra in known, f"environment.yml asks for extra {extra!r}; pyproject.toml has {sorted(known)}"
    assert "pip" in env["dependencies"]


def test_all_extra_covers_every_extra():
    _, project = _load()
    extras = project["optional-dependencies"]
    all_line = " ".join(extras.get("all", []))
    for name in extras:
        if name != "all":
            assert re.search(rf"\b{name}\b", all_line), f"the 'all' extra misses {name!r}"


def test_no_dependency_is_listed_twice_with_different_sources():
    env, project = _load()
    declared = {_name(r) for r in project["dependencies"]}
    declared |= {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    for dep in conda:
        name = _name(dep)
        assert name in ("python", "pip") or name in declared, (
            f"environment.yml installs {dep!r}, which pyproject.toml does not declare: add it to pyproject.toml")
    pip_lines = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    for line in pip_lines:
        if not line.startswith("-e"):
            assert _name(line) in declared, f"environment.yml pip-installs {line!r}, undeclared in pyproject.toml"


def test_python_versions_agree():
    env, project = _load()
    pinned = [d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python")]
    assert pinned, "environment.yml should pin python"
    version = tuple(int(x) for x in re.findall(r"\d+", pinned[0])[:2])
    minimum = tuple(int(x) for x in re.findall(r"\d+", project["requires-python"])[:2])
    assert version >= minimum, f"environment.yml python {version} < requires-python {project['requires-python']}"
