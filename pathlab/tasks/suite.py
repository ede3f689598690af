"""Many task runs at once: the A5 depth sweep and the whole three-task suite, optionally in parallel workers.

**A5 depth sweep.** For each (attention, length k), train with 1, 2, ... layers (the ``layers`` list, ascending)
and stop at the first depth whose test sequence accuracy exceeds ``solved_at`` (90%, Merrill et al.): that depth
is the minimum number of layers for k (None when no depth in the list solves it).

**Suite.** Flip-flop per attention, MQRAR-N per attention and N, and the A5 sweep, all from one preset of
``configs/tasks/*.yaml``. Small models leave a GPU mostly idle, so ``workers > 1`` runs independent jobs in
separate processes sharing the device. Each task's aggregate JSON is rewritten (atomically) after every finished
job, so a run cut short still leaves every finished result on disk, and the same suite run again resumes: it
keeps the finished records of its files and trains only the jobs they lack. A file of another preset or other
settings is refused, never mixed with this suite's results or replaced by them. Each file lists the jobs planned
for it and whether all of them finished (``pathlab.tasks.records``).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from pathlab.attention.registry import attention_class
from pathlab.tasks import records
from pathlab.tasks.runner import build_task_model, check_output_file, run_task, write_json
from pathlab.tasks.settings import resolve_settings, sweep_preset
from pathlab.tasks.specs import TASKS

DEFAULT_ATTENTIONS = ("rope", "fox", "path", "path_fox")
# the lists a task's suite sweeps (the value when neither the preset nor the caller gives one), and for each
# setting the suite sets from them, (list, option of `pathlab tasks suite`)
SWEEP_DEFAULTS = {"a5": {"lengths": [16], "layers": [1, 2, 3, 4]}, "mqrar": {"n_back": [1, 2, 3, 4]}}
SWEPT = {"a5": {"length": ("lengths", "--lengths"), "n_layer": ("layers", "--layers")},
         "mqrar": {"n_back": ("n_back", "--n-back")}}


class SuiteFailed(RuntimeError):
    """Jobs of a suite failed; the others finished and are written (the message names the failed ones)."""


def a5_chain(attention: str, length: int, layers: Sequence[int], *, preset: str | None,
             overrides: Mapping[str, Any] | None = None, progress: bool = False, done: Sequence[dict] = ()) -> dict:
    """Train A5 at one length with increasing depth until one solves it; returns the chain record. ``done``: runs
    of this chain that an interrupted suite finished, taken instead of training their depths again."""
    kept = {int(r["settings"]["n_layer"]): r for r in done}
    runs = []
    min_layers = None
    for n_layer in sorted(layers):
        rec = kept.get(int(n_layer)) or run_task(
            "a5", attention, preset=preset,
            overrides={**dict(overrides or {}), "length": int(length), "n_layer": int(n_layer)}, progress=progress)
        runs.append(rec)
        if rec["summary"]["sequence_accuracy"] > rec["settings"]["solved_at"]:
            min_layers = int(n_layer)
            break
    return {"attention": attention, "length": int(length), "layers_tried": [r["settings"]["n_layer"] for r in runs],
            "min_layers": min_layers, "runs": runs}


def merge_chains(chains: Sequence[dict]) -> dict:
    """One chain from chains of the same (attention, length) that tried different depths (``parallel_depths``):
    the runs in depth order (one per depth, the later chain's where two hold it), the minimum depth among those
    that solved the length (None when none did) and the chains' fallback notes."""
    by_depth = {r["settings"]["n_layer"]: r for c in chains for r in c["runs"]}
    runs = [by_depth[n] for n in sorted(by_depth)]
    solved = [c["min_layers"] for c in chains if c["min_layers"] is not None]
    merged = {"attention": chains[0]["attention"], "length": chains[0]["length"],
              "layers_tried": [r["settings"]["n_layer"] for r in runs], "min_layers": min(solved, default=None),
              "runs": runs}
    notes = list(dict.fromkeys(c["fallback"] for c in chains if c.get("fallback")))
    if notes:
        merged["fallback"] = "; ".join(notes)
    return merged


def _worker_threads(workers: int) -> int:
    """CPU threads for each of ``workers`` processes: one where a GPU does the work, else the cores shared out
    (more threads than cores make every worker wait on the others)."""
    import torch

    return 1 if torch.cuda.is_available() else max(1, (os.cpu_count() or 1) // workers)


def _job(kind: str, attention: str, preset, overrides, extra, threads: int | None = None) -> dict:
    """One unit of work in a worker process (top-level, so that it pickles); ``threads``: torch's CPU threads."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)

    def go(overrides):
        if kind == "a5":
            return a5_chain(attention, extra["length"], extra["layers"], preset=preset, overrides=overrides,
                            done=extra.get("done", ()))
        return run_task(kind, attention, preset=preset, overrides={**dict(overrides or {}), **extra},
                        progress=False)

    try:
        try:
            return go(overrides)
        except Exception as err:
            kwargs = dict((overrides or {}).get("attention_kwargs") or {})
            fallback = dict(attention_class(attention).fallback_options)
            if not fallback or all(kwargs.get(key) == value for key, value in fallback.items()):
                raise
            # a kernel failure (PaTH's Triton kernels) must not cost the result: rerun on the variant's plain
            # PyTorch path, and say so
            rec = go({**dict(overrides or {}), "attention_kwargs": {**kwargs, **fallback}})
            options = ", ".join(f"{key}={value!r}" for key, value in fallback.items())
            rec["fallback"] = f"reran with {options} after {type(err).__name__}: {str(err)[:300]}"
            return rec
    except Exception as err:
        # exceptions that hold frames (torch.compile's) cannot be pickled back from a worker: send the text, with
        # the traceback unless it is a ValueError (a bad setting or input), whose message says all there is
        import traceback

        detail = "" if isinstance(err, ValueError) else "\n" + traceback.format_exc()[-3000:]
        raise RuntimeError(f"{type(err).__name__}: {err}{detail}") from None


def _aggregate(task: str, preset, command, results: list[dict], planned: list[dict], pending: int = 0,
               **fields) -> dict:
    """A task's suite file: its records, the jobs planned for it and whether it is complete: every planned job
    has its finished record and none of this suite's (``pending``) is left."""
    key = records.records_key(task)
    # a stable order whatever order the workers finished in
    results = sorted(results, key=lambda r: (r["attention"], r.get("length", 0),
                                             r.get("settings", {}).get("n_back", 0)))
    doc = {"task": records.FILE_TASK[task], "preset": preset, "command": command, **fields, "planned": planned,
           key: results}
    doc["complete"] = not pending and not records.missing_jobs(task, doc)
    return doc


def _earlier_file(task: str, path: Path) -> dict | None:
    """The suite file an earlier run left at ``path`` (None where there is none, or where it holds no record: a
    suite stopped before its first job ended). One that cannot be read or is not this task's is refused, never
    overwritten."""
    if not path.exists():
        return None
    way_out = "move it away, or write elsewhere (--out-dir; --out of sweep-a5)"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} holds earlier results but cannot be read ({type(err).__name__}: {err}); restore "
                         f"it (e.g. from git), or {way_out}") from None
    key = records.records_key(task)
    if not isinstance(doc, dict) or doc.get("task") != records.FILE_TASK[task] or not isinstance(doc.get(key), list):
        raise ValueError(f"{path} is not a suite file of {task} (no task {records.FILE_TASK[task]!r} with a list "
                         f"of {key}); {way_out}")
    return doc if doc[key] else None


def _settings_difference(task: str, run: Mapping, preset: str, overrides: Mapping[str, Any]) -> str | None:
    """How an earlier run's settings differ from those this suite gives the same job (None where they agree). A
    run redone on its variant's plain path after a kernel failed (``fallback_options``) agrees."""
    from pathlab.results import to_jsonable

    have = dict(run.get("settings") or {})
    swept = {key: have[key] for key in SWEPT.get(task, {}) if key in have}
    try:
        want = to_jsonable(resolve_settings(task, preset=preset, overrides={**overrides, **swept}))
    except ValueError as err:
        return f"this suite's settings do not take its {swept} ({err})"
    try:
        fallback = dict(attention_class(run["attention"]).fallback_options)
    except ValueError:  # a variant no longer registered
        fallback = {}
    if fallback and have.get("attention_kwargs") == {**want["attention_kwargs"], **fallback}:
        want["attention_kwargs"] = have["attention_kwargs"]
    for key in sorted(set(want) | set(have)):
        if key not in have or key not in want or have[key] != want[key]:
            there = repr(have[key]) if key in have else "absent"
            here = repr(want[key]) if key in want else "absent"
            return f"{key}: {there} there, {here} in this suite"
    return None


def _check_earlier(task: str, path: Path, doc: Mapping, preset: str, overrides: Mapping[str, Any],
                   fields: Mapping[str, Any]) -> None:
    """Records of another preset or other settings are refused, naming the file: kept, they would mix two
    experiments in one file; replaced, an experiment would be lost."""
    def refuse(what):
        raise ValueError(f"{path} holds {task} results of {what}; to keep them, write elsewhere (--out-dir; --out "
                         f"of sweep-a5), or delete or move the file to replace them")

    earlier = records.records(task, doc)
    if doc.get("preset") != preset:
        refuse(f"preset {doc.get('preset')!r}, not {preset!r}")
    if task == "a5" and earlier and sorted(doc.get("layers") or []) != sorted(fields["layers"]):
        refuse(f"the depths {doc.get('layers')}, not {fields['layers']}")
    for record in earlier:
        for run in records.runs_of(task, record):
            if run.get("preset") != preset:
                refuse(f"preset {run.get('preset')!r} ({run['attention']}), not {preset!r}")
            difference = _settings_difference(task, run, preset, overrides)
            if difference:
                refuse(f"other settings ({run['attention']}, {difference})")


def _joined(earlier, new):
    """A provenance field (command, git revision) of a file whose records come from several suites: the one value,
    or the list of the distinct ones, the earlier first."""
    values = list(earlier) if isinstance(earlier, list) else [earlier] if earlier is not None else []
    values = list(dict.fromkeys(values + [new]))
    return values[0] if len(values) == 1 else values


class _SuiteFile:
    """One task's file during a suite: the earlier records it keeps and the new ones, the jobs planned for it (the
    earlier suite's and this one's) and the sweep lists of both."""

    def __init__(self, task: str, path: Path, earlier: Mapping | None, jobs: Sequence[tuple], fields: Mapping,
                 preset: str, command: str | None):
        self.task, self.path, self.earlier, self.preset = task, path, earlier, preset
        self.records = records.records(task, earlier or {})
        planned = (earlier or {}).get("planned") or [records.job_of(task, r) for r in self.records]
        self.planned = records.sorted_jobs(planned + [_planned(j) for j in jobs])
        self.fields = dict(fields)
        for name in ("lengths", "n_back"):
            if earlier is not None and name in self.fields:
                self.fields[name] = sorted(set(self.fields[name]) | set(earlier.get(name) or []))
        self.command = _joined((earlier or {}).get("command"), command) if earlier is not None else command
        self.pending, self.added = 0, 0

    def by_job(self) -> dict[tuple, dict]:
        return {records.job_key(records.job_of(self.task, r)): r for r in self.records}

    def add(self, rec: dict) -> dict:
        """Add a finished job's record (an A5 chain joins the chain of its length) and write the file."""
        if self.task == "a5":  # depths trained as separate jobs join their chain
            same = [c for c in self.records if (c["attention"], c["length"]) == (rec["attention"], rec["length"])]
            self.records = [c for c in self.records if c not in same]
            rec = merge_chains(same + [rec])
        self.records.append(rec)
        self.pending, self.added = self.pending - 1, self.added + 1
        self.write()
        return rec

    def write(self) -> None:
        doc = _aggregate(self.task, self.preset, self.command, self.records, self.planned, pending=self.pending,
                         **self.fields)
        if self.earlier is not None:  # the revision of the kept records stays on record
            from pathlab.results import git_revision

            revision = self.earlier.get("git_revision")
            doc["git_revision"] = _joined(revision, git_revision()) if self.added else revision
        write_json(self.path, doc)


def _check_names(attentions: Sequence[str], tasks: Sequence[str]) -> None:
    """Every attention and task is known and named once, checked before any job starts: a misspelt name must
    not fail the suite after the jobs before it have trained."""
    from pathlab import available_attention

    for argument, names, valid in (("attentions", list(attentions), available_attention()),
                                   ("tasks", list(tasks), list(TASKS))):
        if not names:
            raise ValueError(f"{argument} is empty; name at least one of {', '.join(valid)}")
        unknown = [n for n in names if n not in valid]
        if unknown:
            raise ValueError(f"{argument}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(valid)}")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"{argument} names {', '.join(twice)} more than once; each job would run twice")


def _sweep_lists(task: str, preset: str, sweeps: Mapping[str, Any]) -> dict[str, list]:
    """The lists the suite sweeps for ``task`` (``SWEEP_DEFAULTS`` <- the preset's ``sweep:`` section <- ``sweeps``),
    each non-empty and without repeats (a repeated value would train its jobs twice)."""
    known = SWEEP_DEFAULTS.get(task, {})
    unknown = sorted(set(sweeps) - set(known))
    if unknown:
        raise ValueError(f"sweeps[{task!r}]: unknown {', '.join(map(repr, unknown))}; the {task} suite sweeps "
                         f"{', '.join(map(repr, known)) or 'nothing'}")
    lists = {name: list(values) for name, values in {**known, **sweep_preset(task, preset), **sweeps}.items()}
    for name, values in lists.items():
        if not values or len(set(values)) < len(values):
            raise ValueError(f"the {task} suite's {name} must be a non-empty list without repeats, got {values!r}")
    return lists


def _check_overrides(task: str, overrides: Mapping[str, Any], lists: Mapping[str, list]) -> None:
    """A setting the suite sweeps would be replaced by every swept value without a word: refused, pointing to
    the sweep's own option."""
    for key, (name, option) in SWEPT.get(task, {}).items():
        if key in overrides:
            raise ValueError(f"{task} setting {key}={overrides[key]!r} would be ignored: the suite sweeps {key} "
                             f"over {lists[name]}; give the values with {option} (sweeps={{{task!r}: {{{name!r}: "
                             f"[...]}}}} from Python)")


def _run_settings(task: str, extra: Mapping[str, Any]) -> list[dict]:
    """The swept settings of each run of one job (an A5 chain has one run per depth)."""
    if task == "a5":
        return [{"length": extra["length"], "n_layer": n} for n in extra["layers"]]
    return [dict(extra)]


def _check_jobs(jobs: Sequence[tuple], preset: str, overrides: Mapping[str, Mapping[str, Any]]) -> None:
    """The settings of every run, and each variant's options (by building its model once per task), checked
    before any job starts: a bad value must not fail the suite after the jobs before it have trained."""
    built = set()
    for task, attention, extra in jobs:
        for swept in _run_settings(task, extra):
            try:
                s = resolve_settings(task, preset=preset, overrides={**overrides[task], **swept})
                if (task, attention) not in built:
                    build_task_model(task, attention, {**s, "n_layer": 1})
                    built.add((task, attention))
            except ValueError as err:
                raise ValueError(f"{task} settings: {err}") from None


def _describe(job: tuple) -> str:
    task, attention, extra = job
    return " ".join([task, attention] + [f"{key}={value}" for key, value in extra.items() if key != "done"])


def _planned(job: tuple) -> dict:
    """The job of ``pathlab.tasks.records`` that a unit of work answers (depths of one A5 chain answer one)."""
    task, attention, extra = job
    return {"attention": attention, **{key: extra[key] for key in ("n_back", "length") if key in extra}}


def _resume(job: tuple, earlier: Mapping[tuple, dict], parallel_depths: bool) -> tuple | None:
    """The job still to run given the earlier records by job key: None when one holds its result, the job itself
    otherwise; a sequential A5 chain takes the depths it has (``a5_chain``'s ``done``)."""
    task, attention, extra = job
    record = earlier.get(records.job_key(_planned(job)))
    if record is None:
        return job
    if task != "a5":
        return None
    if parallel_depths:
        return None if extra["layers"][0] in record["layers_tried"] else job
    if records.chain_complete(record, extra["layers"]):
        return None
    return task, attention, {**extra, "done": record["runs"]}


def run_suite(*, preset: str, attentions: Sequence[str] = DEFAULT_ATTENTIONS,
              tasks: Sequence[str] = ("flipflop", "mqrar", "a5"), out_dir: str | Path,
              workers: int = 1, overrides: Mapping[str, Mapping[str, Any]] | None = None,
              sweeps: Mapping[str, Mapping[str, Any]] | None = None, paths: Mapping[str, Path] | None = None,
              parallel_depths: bool = False, command: str | None = None, log=print) -> dict[str, Path]:
    """Run the suite of ``preset`` and write ``<out_dir>/{flipflop,mqrar,a5_sweep}.json``.

    ``parallel_depths``: train every A5 depth as its own job (in parallel workers) instead of deepening one chain
    until a depth solves the length; the minimum depth is the same, found sooner with enough workers, at the cost
    of training the depths above it too.

    ``overrides`` maps a task name to settings applied on top of the preset (e.g. ``{"a5": {"steps": 50}}``);
    the sweep lists (A5 ``lengths``/``layers``, MQRAR ``n_back``) come from the ``sweep:`` section of each task's
    YAML, updated by ``sweeps[task]``. ``paths`` overrides the output file of a task. Returns the paths by task.

    Names, sweep lists and the settings of every job are checked before the first job starts (``ValueError``).
    A file that a task's path already holds is resumed: its records are kept and the jobs they answer skipped;
    records of another preset or other settings are refused (``ValueError`` naming the file). A job that fails
    does not stop the others; once they are done, :class:`SuiteFailed` names the failed jobs.
    """
    _check_names(attentions, tasks)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    for t in sorted({t for t, o in (overrides or {}).items() if o} | {t for t, sw in (sweeps or {}).items() if sw}):
        if t not in tasks:
            raise ValueError(f"settings or sweeps given for {t!r}, which this suite does not run (tasks: "
                             f"{', '.join(tasks)}); add it to the tasks or leave them out")
    overrides = {t: dict((overrides or {}).get(t, {})) for t in tasks}
    lists = {t: _sweep_lists(t, preset, dict((sweeps or {}).get(t) or {})) for t in tasks}
    for t in tasks:
        _check_overrides(t, overrides[t], lists[t])
    jobs: list[tuple[str, str, dict]] = []
    fields: dict[str, dict] = {}
    if "a5" in tasks:
        lengths, layers = lists["a5"]["lengths"], lists["a5"]["layers"]
        solved_at = resolve_settings("a5", preset=preset, overrides=overrides["a5"])["solved_at"]
        fields["a5"] = {"lengths": lengths, "layers": layers, "solved_at": solved_at}
        depth_sets = [[n] for n in sorted(layers, reverse=True)] if parallel_depths else [layers]
        jobs += [("a5", a, {"length": k, "layers": d}) for k in sorted(lengths, reverse=True) for a in attentions
                 for d in depth_sets]
    if "mqrar" in tasks:
        n_backs = lists["mqrar"]["n_back"]
        fields["mqrar"] = {"n_back": n_backs}
        jobs += [("mqrar", a, {"n_back": n}) for n in n_backs for a in attentions]
    if "flipflop" in tasks:
        fields["flipflop"] = {}
        jobs += [("flipflop", a, {}) for a in attentions]
    _check_jobs(jobs, preset, overrides)
    # the longest jobs first (flip-flop and the deepest A5 chains), so the pool drains evenly
    order = {"flipflop": 0, "a5": 1, "mqrar": 2}
    jobs.sort(key=lambda j: order[j[0]])

    paths = {t: Path((paths or {}).get(t) or Path(out_dir) / records.FILES[t]) for t in tasks}
    for t in tasks:
        check_output_file(paths[t], f"out_dir: the {t} file")
    with contextlib.ExitStack() as stack:
        for folder in sorted({p.parent for p in paths.values()}):
            stack.enter_context(_locked(folder, [p.name for p in paths.values() if p.parent == folder]))
        earlier = {t: _earlier_file(t, paths[t]) for t in tasks}
        for t in tasks:
            if earlier[t] is not None:
                _check_earlier(t, paths[t], earlier[t], preset, overrides[t], fields[t])
        # the earlier records are kept and the jobs they answer skipped
        files = {t: _SuiteFile(t, paths[t], earlier[t], [j for j in jobs if j[0] == t], fields[t], preset, command)
                 for t in tasks}
        todo = [j for j in (_resume(job, files[job[0]].by_job(), parallel_depths) for job in jobs) if j is not None]
        for t, file in files.items():
            file.pending = sum(j[0] == t for j in todo)
            if earlier[t] is None or file.pending:  # the plan is on disk before the first job ends
                file.write()
            if file.records:
                log(f"{file.path}: kept {len(file.records)} earlier records; {file.pending} of "
                    f"{sum(j[0] == t for j in jobs)} jobs to run")
        _execute(todo, files, preset, overrides, workers, log)
    return paths


@contextlib.contextmanager
def _locked(folder: Path, names: Sequence[str]):
    """Hold ``folder``'s lock while a suite writes its files there: two suites resuming into one folder would each
    rewrite the files without the other's records. Temporary files of writes a kill cut short are cleared."""
    from pathlab.atomic import DirectoryLock, DirectoryLocked, remove_stale_temporaries

    try:
        lock = DirectoryLock(folder).acquire()
    except DirectoryLocked as err:
        raise ValueError(f"out_dir: another suite writes there: {err}") from None
    try:
        remove_stale_temporaries(folder, names)
        yield
    finally:
        lock.release()


def _execute(jobs: Sequence[tuple], files: Mapping[str, _SuiteFile], preset: str,
             overrides: Mapping[str, Mapping[str, Any]], workers: int, log) -> None:
    """Run the jobs (in ``workers`` processes when more than one), each record added to its file as it comes; a
    failed job is logged and the others still run, then :class:`SuiteFailed` names the failed ones."""
    t0 = time.perf_counter()
    failed: list[tuple[tuple, str]] = []

    def finish(job, rec):
        rec = files[job[0]].add(rec)
        if job[0] == "a5":
            desc = f"A5 k={rec['length']}: min layers {rec['min_layers']} (tried {rec['layers_tried']})"
        else:
            desc = f"{job[0]} {job[2] or ''}: {_short(rec['summary'])} ({rec['steps']} steps, {rec['stopped']})"
        log(f"[{time.perf_counter() - t0:7.1f}s] {job[1]:>9} {desc}")

    def fail(job, err):
        failed.append((job, str(err)))
        log(f"FAILED {_describe(job)}: {err}")

    if workers == 1:
        for job in jobs:
            try:
                rec = _job(job[0], job[1], preset, overrides[job[0]], job[2])
            except Exception as err:
                fail(job, err)
                continue
            finish(job, rec)
    else:
        ctx = mp.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            threads = _worker_threads(workers)
            futures = {pool.submit(_job, j[0], j[1], preset, overrides[j[0]], j[2], threads): j for j in jobs}
            for fut in cf.as_completed(futures):
                try:
                    rec = fut.result()
                except Exception as err:
                    fail(futures[fut], err)
                    continue
                finish(futures[fut], rec)
    if failed:
        listed = "; ".join(f"{_describe(job)} ({text.splitlines()[0] if text else 'no message'})"
                           for job, text in failed)
        where = ", ".join(str(file.path) for file in files.values())
        raise SuiteFailed(f"{len(failed)} of {len(jobs)} jobs failed: {listed}. The others finished and are in "
                          f"{where}; the same command again runs only the jobs left")


def _short(summary: Mapping) -> str:
    parts = []
    for key, value in summary.items():
        if isinstance(value, Mapping):
            parts.append(f"{key} " + " ".join(f"{k}={v:.4g}" for k, v in value.items() if isinstance(v, float)))
        elif isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
    return "; ".join(parts)


def sweep_a5(*, preset: str, attentions: Sequence[str] = DEFAULT_ATTENTIONS, lengths: Sequence[int] | None = None,
             layers: Sequence[int] | None = None, out: str | Path, workers: int = 1,
             overrides: Mapping[str, Any] | None = None, command: str | None = None, log=print) -> Path:
    """The A5 depth sweep alone, written to ``out``; ``lengths``/``layers`` default to the preset's sweep section."""
    sweep = {}
    if lengths:
        sweep["lengths"] = [int(k) for k in lengths]
    if layers:
        sweep["layers"] = [int(n) for n in layers]
    paths = run_suite(preset=preset, attentions=attentions, tasks=("a5",), out_dir=Path(out).parent,
                      workers=workers, overrides={"a5": dict(overrides or {})}, sweeps={"a5": sweep},
                      paths={"a5": Path(out)}, command=command, log=log)
    return paths["a5"]
