"""The figure pipeline: studies and their committed results, the notebooks that draw them, and what they share.

* :mod:`~pathlab.figures.study`: a study's cells (``configs/studies/``), ``pathlab study run`` (train, evaluate,
  probe) and the results under ``results/<study>/``;
* :mod:`~pathlab.figures.pipeline`: ``pathlab figures``, every notebook through papermill, and the helpers a
  notebook calls (its parameters, its output folder, the scale note of its title);
* :mod:`~pathlab.figures.plotting`: the figure style and the writer of PNG, PDF and the JSON beside them;
* :mod:`~pathlab.figures.kernel_report`: the kernel-performance figure from ``benchmarks/results/``.
"""
