"""The figure pipeline: the notebooks that draw a study's committed results, and what they share.

The results come from :mod:`pathlab.study`; this package draws them:

* :mod:`~pathlab.figures.pipeline`: ``pathlab figures``, every notebook through papermill, and the helpers a
  notebook calls (its parameters, its output folder, the scale note of its title);
* :mod:`~pathlab.figures.plotting`: the figure style and the writer of PNG, PDF and the JSON beside them;
* :mod:`~pathlab.figures.kernel_report`: the kernel-performance figure from ``benchmarks/results/``.
"""
