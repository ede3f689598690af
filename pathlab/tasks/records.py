"""The suite's result files and the jobs their records answer, shared by the suite (which resumes from them) and
the report (which must not read an interrupted suite as a finished one).

A file holds records: runs (``flipflop.json``, ``mqrar.json``) or A5 chains (``a5_sweep.json``). Each answers one
job, named by a dict: ``{"attention"}`` for flip-flop, ``{"attention", "n_back"}`` for MQRAR-N and
``{"attention", "length"}`` for an A5 chain. The suite writes the jobs it planned (``planned``) and whether every
one of them has its record (``complete``); a file written before it did lacks both and reads as complete as
written.
"""

from __future__ import annotations

from typing import Mapping

FILES = {"flipflop": "flipflop.json", "mqrar": "mqrar.json", "a5": "a5_sweep.json"}
FILE_TASK = {"flipflop": "flipflop", "mqrar": "mqrar", "a5": "a5_sweep"}  # the "task" field of each file


def records_key(task: str) -> str:
    """The key of a suite file's records: ``chains`` (A5) or ``runs``."""
    return "chains" if task == "a5" else "runs"


def records(task: str, doc: Mapping) -> list[dict]:
    """The runs (flip-flop, MQRAR-N) or chains (A5) of a suite file."""
    return list(doc.get(records_key(task)) or [])


def runs_of(task: str, record: Mapping) -> list[dict]:
    """The training runs behind one record: a chain's runs, or the run itself."""
    return list(record["runs"]) if task == "a5" else [dict(record)]


def job_of(task: str, record: Mapping) -> dict:
    """The job a record answers."""
    job = {"attention": record["attention"]}
    if task == "a5":
        job["length"] = int(record["length"])
    elif task == "mqrar":
        job["n_back"] = int(record["settings"]["n_back"])
    return job


def job_key(job: Mapping) -> tuple:
    return tuple(sorted(job.items()))


def sorted_jobs(jobs) -> list[dict]:
    """Jobs without repeats, in a stable order."""
    unique = {job_key(j): dict(j) for j in jobs}
    return [unique[k] for k in sorted(unique)]


def chain_complete(chain: Mapping, layers) -> bool:
    """Whether an A5 chain holds every depth of ``layers`` it needs: those up to the depth that solved the length,
    all of them when none did. A chain whose depths ran as separate jobs lacks those that did not finish."""
    solved = chain["min_layers"]
    need = {int(d) for d in layers if solved is None or int(d) <= solved}
    return need <= {int(d) for d in chain["layers_tried"]}


def finished_jobs(task: str, doc: Mapping) -> set[tuple]:
    """The keys of the jobs a file holds a finished record of (an A5 chain over all the file's ``layers``)."""
    layers = doc.get("layers") or []
    return {job_key(job_of(task, r)) for r in records(task, doc) if task != "a5" or chain_complete(r, layers)}


def missing_jobs(task: str, doc: Mapping) -> list[dict]:
    """The planned jobs a file lacks a finished record of; none for a file without ``planned`` (written before the
    suite recorded its plan: complete as written)."""
    if "planned" not in doc:
        return []
    finished = finished_jobs(task, doc)
    return [dict(job) for job in doc["planned"] if job_key(job) not in finished]
