"""Theory-validation probes: pure functions that the notebooks call (M1-M8 of docs/theory.md).

Synthetic (no trained model): :mod:`~pathlab.probes.mixing` (M1 mixing curves and windows),
:mod:`~pathlab.probes.tails` (M3 far-score concentration), :mod:`~pathlab.probes.farmass` (M4 far mass and its
prediction), :mod:`~pathlab.probes.bounds` (M5 far-mass lower bound), :mod:`~pathlab.probes.coherence` (M6 value
incoherence). Trained models: :mod:`~pathlab.probes.capture` (per-layer inputs through forward pre-hooks),
:mod:`~pathlab.probes.scores` (streamed logits per distance bin, never T×T), :mod:`~pathlab.probes.learned`
(M2 learned gaps), :mod:`~pathlab.probes.runs` (trained runs of a profile).
"""
