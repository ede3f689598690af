"""Training and evaluating the language models, on one process or several (``torchrun``).

* :mod:`~pathlab.training.trainer`: ``train`` (``pathlab train``), ``load_run``, the run directory;
* :mod:`~pathlab.training.config`: the layered YAML configs and their checks;
* :mod:`~pathlab.training.checkpoint`: checksummed checkpoints with a fallback copy;
* :mod:`~pathlab.training.distributed`: DDP/FSDP set-up;
* :mod:`~pathlab.training.optimization`: AdamW's groups, the schedule and autocast, shared with the task runner;
* :mod:`~pathlab.training.evaluate`: length extrapolation, r(L) = PPL(L)/PPL_train(L) (``pathlab eval``).
"""

from pathlab.training.evaluate import evaluate
from pathlab.training.trainer import load_run, train

__all__ = ["evaluate", "load_run", "train"]
