"""Theory-validation probes: pure functions that the notebooks call (M1-M8 of docs/theory.md).

Synthetic (no trained model): :mod:`~pathlab.probes.mixing` (M1 mixing curves and windows),
:mod:`~pathlab.probes.tails` (M3 far-score concentration), :mod:`~pathlab.probes.farmass` (M4 far mass and its
prediction), :mod:`~pathlab.probes.bounds` (M5 far-mass lower bound), :mod:`~pathlab.probes.coherence` (M6 value
incoherence), :mod:`~pathlab.probes.synthetic` (the notebooks' synthetic experiments). Trained models:
:mod:`~pathlab.probes.model` (hooks on every layer, streamed measurements), :mod:`~pathlab.probes.scores`
(streamed logits per distance bin, never T×T), :mod:`~pathlab.probes.learned` (M2 angle statistics),
:mod:`~pathlab.probes.records` (the compact record of one model), :mod:`~pathlab.probes.summaries` (the figures'
numbers and claims from records), :mod:`~pathlab.probes.published` (the numbers to compare with).
"""
