"""Studies: a grid of language models, each trained, evaluated to long lengths and probed, with compact results.

    pathlab study list                               # the study configs under configs/studies/
    pathlab study status owt16-debian                # which cells have results
    pathlab study run owt16-debian --cells rope,path --budget-s 540
    pathlab study run tiny-cpu                       # the small CPU study behind `make figures`
    pathlab study compare owt16-debian nope rope     # r(L) of one cell over another's, paired intervals

A study config (``configs/studies/<name>.yaml``, :mod:`~pathlab.study.config`) names a training config and the
overrides every cell shares, the evaluation protocol, the probe settings, the cells (an attention variant, its
options and per-cell overrides) and the cells each figure compares. ``pathlab study run`` trains, evaluates and
probes each cell, every stage resumable (:mod:`~pathlab.study.runner`), and writes its compact results to
``results/<study>/<cell>/``; the notebooks, the docs' tables and ``pathlab study compare`` read them
(:mod:`~pathlab.study.cells`, :mod:`~pathlab.study.tables`, :mod:`~pathlab.study.cli`). Checkpoints stay in
``runs/`` (hundreds of MB): only the compact results are meant to be kept.

Several GPUs: run one process per GPU, each on its own cells
(``CUDA_VISIBLE_DEVICES=1 pathlab study run owt16-debian --cells alibi,fox``); cells share nothing but the
corpus, and each run directory is locked by its trainer.
"""

from pathlab.study.cells import figure_inputs, load_cells, missing_cells, read_cell_file, seed_margins
from pathlab.study.config import (available_studies, cell_config, cell_names, cell_results_dir, load_study,
                                  results_dir, run_dir, runs_here)
from pathlab.study.runner import StudyPaused, cell_status, run_cell, run_study

__all__ = ["StudyPaused", "available_studies", "cell_config", "cell_names", "cell_results_dir", "cell_status",
           "figure_inputs", "load_cells", "load_study", "missing_cells", "read_cell_file", "results_dir", "run_cell",
           "run_dir", "run_study", "runs_here", "seed_margins"]
