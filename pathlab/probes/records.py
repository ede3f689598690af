"""The compact probe record of one trained model: what every model-based figure needs, in a few hundred KB.

:func:`measure_cell` runs the M2 pass (per-head mixing windows from the model's own step angles) and the
streamed probes (:func:`pathlab.probes.model.measure_model`) at each probe length, and :func:`reduce` turns the
per-query measurements (tens of MB at 65K tokens) into per-(layer, width, head) statistics, per-bin curves and a
fixed-size sample of queries for the scatter plots. The figure summaries (:mod:`pathlab.probes.summaries`) read
records only, whether they were measured a minute ago on the CPU or on a GPU machine and committed.

Near-set widths (docs/theory.md#near-set). Width 0 is per (layer, head): W_h = min{n : c_h(n) ≤ ε} from M2,
measured on ``m2_windows`` windows of ``m2_length`` tokens, and the training length for heads with no window
within the measured lags (no mixing: RoPE, ALiBi, FoX, NoPE, PaTH, slow rotations). The fixed widths of the
settings' ``near`` follow (indices 1, 2, …), so the M4 prediction is also tested where every head has far keys at
the training length.

Record layout (a nested dict of numpy arrays, saved with :func:`save_record`)::

    train_length, lengths [n_L], width_labels [n_W], widths [n_W, layers, H], width_source [layers, H],
    eps, m2: {W_m2 [layers, H], lags [n_lag], coherence, rho_s_pred [n_lag, layers, H]},
    angles: {gamma, W_emp, W_pred, mean_angle [layers, H, Db]}          (models with step angles)
    L<length>: {
        edges [n_bins + 1],                                   common distance bins (scores.distance_bin_edges)
        bins: {count, mean, std, log_mean_exp, rho_s}: {heads_median [layers, n_bins], first, last [n_bins, H]},
        heads: {far_mass, gap, delta_max, delta_mean, lam, bound, m_eff, log_z_near, log_m_far, k_near, m_far}
               -> mean over queries [layers, n_W, H]; gap and lam also as "<name>_median",
        predicted_far_mass [layers, n_W, H]     ρ̂_D from the training length's Γ̂ (M4), NaN where Γ̂ is undefined,
        kappa_median, far_near_ratio_median [layers, H]   (M6, width 0),
        bound_violations, bound_checked [n_W]   queries with ρ_D below the M5 bound, and queries checked,
        max_safe_length_median [n_W]            L_max(ε = 0.5) = W + K e^{2λ} (M5),
        rho_s_far_median [n_W]                  median |ρ_s| over the bins at distances ≥ W (M2),
        sample: {far_mass, bound, kappa, m_eff, W, layer} for ≤ SAMPLE queries × heads (width 0),
    }
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np

from pathlab.probes import farmass
from pathlab.probes.bounds import max_safe_length

FORMAT = 1
SAMPLE = 1000  # (query, head, layer) points kept per length for the scatter plots
HEAD_FIELDS = ("far_mass", "gap", "delta_max", "delta_mean", "lam", "bound", "m_eff", "log_z_near", "log_m_far",
               "k_near", "m_far")
BIN_FIELDS = ("count", "mean", "std", "log_mean_exp", "rho_s")
DEFAULTS = {"n_windows": 4, "n_queries": 64, "span": 512, "near": [64, 128], "m2_windows": 16,
            "angle_lag": 4096, "eps": 0.05, "seed": 0}
SAFE_EPS = 0.5  # ε of the implied maximum safe length L_max(ε)


def settings_for(probes: dict, train_length: int) -> dict:
    """The probe settings with defaults: ``lengths`` (the first must be the training length), ``m2_length``
    (default: the first probe length ≥ 8 × the training length, else the longest)."""
    s = {**DEFAULTS, **probes}
    lengths = [int(L) for L in s.get("lengths", [train_length])]
    if lengths[0] != train_length or sorted(lengths) != lengths or len(set(lengths)) != len(lengths):
        raise ValueError(f"probes.lengths must be increasing and start at the training length {train_length}, "
                         f"got {lengths}")
    s["lengths"] = lengths
    if "m2_length" not in s:
        s["m2_length"] = next((L for L in lengths if L >= 8 * train_length), lengths[-1])
    if s["m2_length"] not in lengths:
        raise ValueError(f"probes.m2_length must be one of the probe lengths {lengths}, got {s['m2_length']}")
    return s


def _nanmedian(a, axis=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices -> NaN, by design
        return np.nanmedian(a, axis=axis)


def _nanmean(a, axis=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(a, axis=axis)


def _finite(a):
    a = np.asarray(a, np.float64)
    return np.where(np.isfinite(a), a, np.nan)


def measure_cell(model, run_cfg: dict, probes: dict, *, progress: bool = False):
    """Measure a trained model at every probe length and reduce it: ``(record, raw)``.

    ``raw`` is ``{length: measure_model(...) result}`` (large; for re-reduction only).
    """
    from pathlab.probes.model import learned_head_windows, measure_model

    L0 = int(run_cfg["data"]["block_size"])
    s = settings_for(probes, L0)
    m2_windows = validation_windows(run_cfg, s["m2_length"], s["m2_windows"], s["seed"] + 1)
    near = learned_head_windows(model, m2_windows, n_max=min(s["angle_lag"], s["m2_length"] - 1), fallback=L0,
                                eps=s["eps"])
    widths = [near["W"], *s["near"]]
    raw = {}
    for L in s["lengths"]:
        if progress:
            print(f"  probes at L={L}", flush=True)
        windows = validation_windows(run_cfg, L, s["n_windows"], s["seed"])
        lag = min(s["angle_lag"], L - 1) if L == s["m2_length"] else None
        raw[L] = measure_model(model, windows, n_queries=s["n_queries"], span=min(s["span"], L),
                               near_windows=widths, angle_lag=lag, seed=s["seed"], eps=s["eps"])
    return reduce(raw, near, L0, s), raw


def validation_windows(run_config: dict, length: int, n_windows: int, seed: int = 0):
    """``[n, L]`` token windows from the run's validation split, identical for every model (seeded by L).

    Non-overlapping when the split is long enough (random starts otherwise).
    """
    import torch

    from pathlab.data.corpus import load_tokens

    tokens = load_tokens(run_config["data"]["corpus"], "val")
    n_tok = len(tokens)
    if n_tok < length + 1:
        raise ValueError(f"the validation split of {run_config['data']['corpus']!r} has {n_tok} tokens, fewer than "
                         f"one window of {length}; use shorter lengths or a larger corpus")
    rng = np.random.default_rng(seed * 1_000_003 + length)
    slots = n_tok // length
    if slots >= n_windows:
        starts = np.sort(rng.choice(slots, size=n_windows, replace=False)) * length
    else:
        starts = rng.integers(0, n_tok - length, size=n_windows)
    return torch.from_numpy(np.stack([np.asarray(tokens[s:s + length], dtype=np.int64) for s in starts]))


def _bins(per_bin: dict) -> dict:
    out = {}
    for k in BIN_FIELDS:
        a = per_bin.get(k)
        if a is None:
            continue
        a = np.asarray(a, np.float64)  # [layers, n_bins, H]
        out[k] = {"heads_median": _nanmedian(a, axis=-1), "first": a[0], "last": a[-1]}
    return out


def _sample(pq: dict, W: np.ndarray, seed: int) -> dict:
    """A fixed-size random sample of (layer, query, head) points of width 0 for the scatter plots."""
    rho = np.asarray(pq["far_mass"])[:, 0]  # [layers, Q, H]
    layers, Q, H = rho.shape
    layer = np.broadcast_to(np.arange(layers)[:, None, None], rho.shape)
    Wq = np.broadcast_to(W[:, None, :], rho.shape)
    fields = {"far_mass": rho, "bound": np.asarray(pq["bound"])[:, 0], "m_eff": np.asarray(pq["m_eff"])[:, 0],
              "W": Wq, "layer": layer}
    if pq.get("kappa") is not None:
        fields["kappa"] = np.asarray(pq["kappa"])
    keep = np.random.default_rng(seed).permutation(rho.size)[:SAMPLE]
    return {k: np.asarray(v, np.float64).ravel()[keep] for k, v in fields.items()}


def reduce(raw: dict, near: dict, train_length: int, settings: dict) -> dict:
    """The compact record (module docstring) of measurements ``raw = {L: measure_model(...)}``."""
    lengths = sorted(raw)
    base = raw[lengths[0]]
    widths = np.asarray(base["near_windows"], np.float64)  # [n_W, layers, H]
    labels = ["per-head"] + [str(int(w)) for w in settings["near"]]
    source = np.where(np.asarray(near.get("fallback", np.zeros(widths.shape[1:], bool))), "fallback", "m2")
    rec = {"format": FORMAT, "train_length": train_length, "lengths": np.asarray(lengths),
           "width_labels": np.asarray(labels), "widths": widths, "width_source": source,
           "eps": float(settings["eps"]), "settings_n_queries": int(settings["n_queries"]),
           "settings_n_windows": int(settings["n_windows"])}
    m2 = {"W_m2": np.asarray(near["W_m2"], np.float64)}
    if near.get("coherence") is not None:
        n = np.asarray(near["coherence"]).shape[0]
        lags = np.unique(np.round(np.geomspace(1, n, 80)).astype(int))
        m2.update(lags=lags, coherence=np.asarray(near["coherence"])[lags - 1],
                  rho_s_pred=np.asarray(near["rho_s_pred"])[lags - 1])
    rec["m2"] = m2
    with_angles = [L for L in lengths if "angles" in raw[L]]
    if with_angles:
        a = raw[with_angles[0]]["angles"]
        rec["angles"] = {k: np.asarray(a[k], np.float64) for k in ("gamma", "W_emp", "W_pred", "mean_angle")}
    gap_train = _finite(np.asarray(base["per_query"]["gap"]))  # [layers, n_W, Q0, H]
    gap_hat = farmass.fit_gap_per_head(gap_train, axis=-2)  # [layers, n_W, H]
    rec["gap_hat"] = gap_hat
    for L in lengths:
        m = raw[L]
        pq = m["per_query"]
        r = {"edges": np.asarray(m["edges"]), "bins": _bins(m["per_bin"]), "heads": {}}
        for k in HEAD_FIELDS:
            a = _finite(pq[k])  # [layers, n_W, Q, H]
            r["heads"][k] = _nanmean(a, axis=2)
            if k in ("gap", "lam", "far_mass"):
                r["heads"][f"{k}_median"] = _nanmedian(a, axis=2)
        m_far = np.asarray(pq["m_far"], np.float64)
        pred = farmass.far_mass_from_gap(m_far, gap_hat[:, :, None, :])  # [layers, n_W, Q, H]
        r["predicted_far_mass"] = _nanmean(np.where(np.isfinite(gap_hat[:, :, None, :]), pred, np.nan), axis=2)
        if pq.get("kappa") is not None:
            r["kappa_median"] = _nanmedian(_finite(pq["kappa"]), axis=1)
        r["far_near_ratio_median"] = _nanmedian(_finite(pq["far_near_norm_ratio"]), axis=1)
        rho, bound = np.asarray(pq["far_mass"], np.float64), np.asarray(pq["bound"], np.float64)
        checked = np.isfinite(rho) & (m_far > 0)
        r["bound_checked"] = checked.sum(axis=(0, 2, 3))
        r["bound_violations"] = (checked & (rho < bound * (1 - 1e-9))).sum(axis=(0, 2, 3))
        Wq = np.broadcast_to(widths.transpose(1, 0, 2)[:, :, None, :], rho.shape)  # [layers, n_W, Q, H]
        lmax = max_safe_length(SAFE_EPS, np.maximum(np.asarray(pq["k_near"], np.float64), 1),
                               np.asarray(pq["lam"], np.float64), Wq)
        r["max_safe_length_median"] = _nanmedian(np.moveaxis(lmax, 1, 0).reshape(lmax.shape[1], -1), axis=1)
        if m["per_bin"].get("rho_s") is not None:
            rho_s = np.abs(np.asarray(m["per_bin"]["rho_s"], np.float64))  # [layers, n_bins, H]
            lower = np.asarray(m["edges"])[:-1]
            counted = np.asarray(m["per_bin"]["count"]) > 0
            r["rho_s_far_median"] = np.array([
                _nanmedian(np.where((lower[None, :, None] >= w[:, None, :]) & counted, rho_s, np.nan))
                for w in widths])
        r["sample"] = _sample(pq, widths[0], seed=int(L))
        rec[f"L{L}"] = r
    return rec


# ----------------------------------------------------------------------------------------------------------------
# files


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        elif v is not None:
            a = np.asarray(v)
            if a.dtype == np.float64:  # beyond float32's range (e.g. L_max = K e^{2λ}) is stored as inf
                with np.errstate(over="ignore"):
                    a = a.astype(np.float32)
            out[f"{prefix}{k}"] = a
    return out


def _unflatten(arrays) -> dict:
    out: dict = {}
    for key in arrays.files:
        node = out
        *path, leaf = key.split("/")
        for p in path:
            node = node.setdefault(p, {})
        value = arrays[key]
        if value.dtype == np.float32:
            value = value.astype(np.float64)
        node[leaf] = value.item() if value.ndim == 0 else value
    return out


def save_record(path, record: dict) -> Path:
    """Write a record as a compressed ``.npz`` (floats stored as float32), atomically."""
    from pathlab.atomic import atomic_write_bytes

    buf = io.BytesIO()
    np.savez_compressed(buf, **_flatten(record))
    return atomic_write_bytes(Path(path), buf.getvalue())


def load_record(path) -> dict:
    """Read a record written by :func:`save_record`; a file of another format is refused with the fix."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no probe record at {path}; run the cell's study (`pathlab study run`) first")
    with np.load(path, allow_pickle=False) as arrays:
        record = _unflatten(arrays)
    if record.get("format") != FORMAT:
        raise ValueError(f"{path}: probe record format {record.get('format')!r}, this pathlab reads {FORMAT}; "
                         "run the cell again")
    record["lengths"] = [int(L) for L in np.atleast_1d(record["lengths"])]
    return record


def length_entry(record: dict, L: int) -> dict:
    return record[f"L{int(L)}"]


def save_raw(folder, raw: dict) -> None:
    """The full measurements (per query), one compressed ``L<length>.npz`` per length, for re-reduction."""
    from pathlab.atomic import atomic_write_bytes

    folder = Path(folder)
    for L, m in raw.items():
        m = dict(m)
        if "angles" in m:  # c(n) per block at every lag is large; the reduction keeps γ and the windows
            m["angles"] = {k: v for k, v in m["angles"].items() if k != "coherence"}
        buf = io.BytesIO()
        np.savez_compressed(buf, **_flatten(m))
        atomic_write_bytes(folder / f"L{L}.npz", buf.getvalue())
