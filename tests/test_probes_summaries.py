"""Figure summaries from compact records: every claim is computed for every cell, follows the numbers, and can
fail (negative controls on synthetic inputs); theorems are checks, not claims."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch

from pathlab import ModelConfig, build_model
from pathlab.probes import records, summaries
from pathlab.probes.model import learned_head_windows, measure_model

L_TRAIN = 64


def _eval(ratios: dict) -> dict:
    """A minimal eval.json with the given r(L)."""
    lengths = {}
    for L, r in ratios.items():
        lengths[str(L)] = {"ratio": r, "ratio_ci95": [r * 0.95, r * 1.05], "loss": 3.0 + math.log(r),
                           "loss_train_context": 3.0, "n_windows": 4,
                           "buckets": [{"start": 0, "stop": L, "loss": 3.0, "loss_train_context": 3.0}]}
    return {"train_length": L_TRAIN, "lengths": lengths}


@pytest.fixture(scope="module")
def cells():
    out = {}
    for name in ("rope", "alibi", "rot_random_qk", "rot_random_qkv"):
        torch.manual_seed(0)
        model = build_model(ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, attention=name))
        m2 = torch.randint(0, 64, (2, 256), generator=torch.Generator().manual_seed(1))
        near = learned_head_windows(model, m2, n_max=255, fallback=L_TRAIN)
        raw = {}
        for L in (64, 256):
            windows = torch.randint(0, 64, (2, L), generator=torch.Generator().manual_seed(L))
            raw[L] = measure_model(model, windows, n_queries=6, span=32, near_windows=[near["W"], 8, 32],
                                   angle_lag=min(63, L - 1) if L == 256 else None)
        settings = {"near": [8, 32], "eps": 0.05, "n_queries": 6, "n_windows": 2}
        rec = records.reduce(raw, near, L_TRAIN, settings)
        out[name] = {"cell": {"attention": name, "attention_kwargs": {}}, "record": rec,
                     "eval": _eval({64: 1.0, 256: 1.5})}
    return out


def _all(cells):
    return [summaries.far_mass_summary(cells), summaries.far_mass_summary(cells, width=8),
            summaries.bound_summary(cells), summaries.score_summary(cells), summaries.coherence_summary(cells),
            summaries.learned_summary(cells, width=8), summaries.extrapolation_summary(cells),
            summaries.ablation_summary(cells)]


def test_claims_are_bool_or_none_checks_bool_and_every_cell_is_covered(cells):
    for data, claims, checks in _all(cells):
        assert all(v is None or isinstance(v, bool) for v in claims.values())
        assert all(isinstance(v, bool) for v in checks.values())
    data, claims, _ = summaries.far_mass_summary(cells, width=8)
    for c in cells:  # the theory variants' claims are also computed for RoPE and ALiBi (their negative controls)
        assert f"{c}_far_mass_rises_with_length" in claims and f"{c}_prediction_within_0.1" in claims
    assert summaries.fixed_widths(cells) == ["8", "32"]
    with pytest.raises(ValueError, match="width must be one of"):
        summaries.far_mass_summary(cells, width=5)


def test_theorems_are_checks_that_hold(cells):
    _, claims, checks = summaries.bound_summary(cells)
    assert checks["bound_never_violated"] is True and "bound_never_violated" not in claims
    _, _, checks = summaries.coherence_summary(cells)
    assert checks["rot_random_qk_kappa_is_one"] is True and "rot_random_qkv_kappa_is_one" not in checks


def test_a_violated_bound_fails_the_check(cells):
    bad = copy.deepcopy(cells)
    bad["rope"]["record"]["L256"]["bound_violations"] = np.array([3, 0, 0])
    assert summaries.bound_summary(bad)[2]["bound_never_violated"] is False


def _with_far_mass(cells, **rho):
    """A copy of ``cells`` whose far mass at L = 64 and 256 is ``rho[cell] = (at 64, at 256)`` in every head."""
    out = copy.deepcopy(cells)
    for c, values in rho.items():
        for L, value in zip((64, 256), values):
            out[c]["record"][f"L{L}"]["heads"]["far_mass"][:] = value
    return out


def test_far_mass_rise_follows_the_numbers(cells):
    up = _with_far_mass(cells, rot_random_qk=(0.2, 0.7), rope=(0.7, 0.2))
    _, claims, _ = summaries.far_mass_summary(up, width=8)
    assert claims["rot_random_qk_far_mass_rises_with_length"] is True
    assert claims["rope_far_mass_rises_with_length"] is False


def test_a_near_zero_far_mass_drifting_up_does_not_rise(cells):
    """The negative control of the rise claim: a far mass that rises at every step but stays near zero (ALiBi's
    0.008 to 0.014 at the paper's shape) does not count as rising; a rise of 0.06 from 0.2 does."""
    drift = _with_far_mass(cells, rope=(0.008, 0.014), rot_random_qk=(0.2, 0.26))
    _, claims, _ = summaries.far_mass_summary(drift, width=8)
    assert claims["rope_far_mass_rises_with_length"] is False
    assert claims["rot_random_qk_far_mass_rises_with_length"] is True
    assert summaries.far_mass_summary(drift, width=8, min_rise=0.0)[1]["rope_far_mass_rises_with_length"] is True


def test_prediction_claim_undefined_without_predictable_heads_and_false_when_off(cells):
    none = copy.deepcopy(cells)
    none["rope"]["record"]["gap_hat"][:] = np.nan
    assert summaries.far_mass_summary(none)[1]["rope_prediction_within_0.1"] is None
    off = copy.deepcopy(cells)
    for L in (64, 256):
        off["rot_random_qk"]["record"][f"L{L}"]["predicted_far_mass"][:] = 0.0
        off["rot_random_qk"]["record"][f"L{L}"]["heads"]["far_mass"][:] = 0.9
    assert summaries.far_mass_summary(off, width=8)[1]["rot_random_qk_prediction_within_0.1"] is False
    on = copy.deepcopy(off)
    for L in (64, 256):
        on["rot_random_qk"]["record"][f"L{L}"]["predicted_far_mass"][:] = 0.85
    assert summaries.far_mass_summary(on, width=8)[1]["rot_random_qk_prediction_within_0.1"] is True


def _flatten_far_scores(rec, shift_beyond):
    """Make the first layer's median-head μ, σ constant across distances, then shift μ beyond the training
    length by ``shift_beyond`` σ."""
    e = rec["L256"]
    edges = np.asarray(e["edges"])
    for k, v in (("mean", 0.0), ("std", 1.0)):
        e["bins"][k]["first"][:] = v
    e["bins"]["count"]["first"][:] = 10
    e["bins"]["mean"]["first"][edges[:-1] >= L_TRAIN] = shift_beyond


def test_far_score_stationarity_can_fail(cells):
    good, bad = copy.deepcopy(cells), copy.deepcopy(cells)
    _flatten_far_scores(good["rot_random_qk"]["record"], 0.0)
    _flatten_far_scores(bad["rope"]["record"], 1.0)
    assert summaries.score_summary(good)[1]["rot_random_qk_far_scores_stationary_beyond_training"] is True
    assert summaries.score_summary(bad)[1]["rope_far_scores_stationary_beyond_training"] is False


def _kappa_cells(cells, kappa_qkv, kappa_qk):
    """The two rotation cells at four lengths whose incoherent prediction √(1 + 2W)/√M_eff halves at each
    length (1, 1/2, 1/4, 1/8), with κ set per length by ``kappa_qkv(pred)`` and ``kappa_qk(pred)``."""
    fake = {c: copy.deepcopy(cells[c]) for c in ("rot_random_qk", "rot_random_qkv")}
    lengths = [256, 512, 1024, 2048]
    for c, kappa in (("rot_random_qk", kappa_qk), ("rot_random_qkv", kappa_qkv)):
        rec = fake[c]["record"]
        template = rec["L256"]
        for i, L in enumerate(lengths):
            e = copy.deepcopy(template)
            pred = 0.5 ** i
            e["sample"]["W"][:] = 4.0
            e["sample"]["m_eff"][:] = 9.0 / pred ** 2
            e["sample"]["kappa"][:] = kappa(pred)
            e["far_near_ratio_median"] = np.full_like(np.asarray(e["far_near_ratio_median"], float), 1.0 + i)
            rec[f"L{L}"] = e
        rec["lengths"] = lengths
    return fake


def test_kappa_claims_follow_the_numbers_and_need_a_rejected_control(cells):
    claims = summaries.coherence_summary(_kappa_cells(cells, lambda p: p, lambda p: 1.0))[1]
    assert claims["rot_random_qkv_kappa_matches_incoherent_prediction"] is True
    assert claims["rot_random_qkv_kappa_falls_as_predicted"] is True
    assert not any(k.startswith("rot_random_qk_kappa") for k in claims)  # the control gets no claim of its own

    plateau = summaries.coherence_summary(_kappa_cells(cells, lambda p: 0.12, lambda p: 1.0))[1]
    assert plateau["rot_random_qkv_kappa_matches_incoherent_prediction"] is True  # 0.12 / 0.125 at the longest
    assert plateau["rot_random_qkv_kappa_falls_as_predicted"] is False  # but κ stopped falling

    far = summaries.coherence_summary(_kappa_cells(cells, lambda p: 10 * p, lambda p: 1.0))[1]
    assert far["rot_random_qkv_kappa_matches_incoherent_prediction"] is False
    assert far["rot_random_qkv_kappa_falls_as_predicted"] is True

    # a control that passes the same test makes the test say nothing: None, not True
    data, blind, _ = summaries.coherence_summary(_kappa_cells(cells, lambda p: p, lambda p: 2 * p))
    assert blind["rot_random_qkv_kappa_matches_incoherent_prediction"] is None
    assert blind["rot_random_qkv_kappa_falls_as_predicted"] is None
    assert data["controls_rejected"] == {"kappa_matches_incoherent_prediction": False,
                                         "kappa_falls_as_predicted": False}
    alone = {"rot_random_qkv": _kappa_cells(cells, lambda p: p, lambda p: 1.0)["rot_random_qkv"]}
    assert summaries.coherence_summary(alone)[1]["rot_random_qkv_kappa_falls_as_predicted"] is None


def test_kappa_leaves_out_queries_whose_far_weights_underflowed(cells):
    """M_eff = ρ²/Σ_F α² is infinite where every far weight underflowed (a forget gate): such a query has no
    prediction, and a κ of 0 there must neither count nor warn (0/0)."""
    fake = _kappa_cells(cells, lambda p: p, lambda p: 1.0)
    kept = summaries.coherence_summary(fake)[0]["cells"]["rot_random_qkv"]
    sample = fake["rot_random_qkv"]["record"]["L2048"]["sample"]
    sample["m_eff"][0], sample["kappa"][0] = np.inf, 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        data, claims, _ = summaries.coherence_summary(fake)
    assert len(data["cells"]["rot_random_qkv"]["kappa"]) == len(kept["kappa"]) - 1
    assert claims["rot_random_qkv_kappa_matches_incoherent_prediction"] is True


def test_rho_s_vanishing_can_fail(cells):
    fake = copy.deepcopy(cells)
    fake["rot_random_qk"]["record"]["L256"]["rho_s_far_median"] = np.array([0.02, 0.02, 0.02])
    fake["rope"]["record"]["L256"]["rho_s_far_median"] = np.array([0.6, 0.6, 0.6])
    _, claims, _ = summaries.learned_summary(fake, width=8)
    assert claims["rot_random_qk_rho_s_vanishes_beyond_window"] is True
    assert claims["rope_rho_s_vanishes_beyond_window"] is False
    fake["rot_random_qk"]["record"]["L256"]["rho_s_far_median"] = np.array([0.6, 0.6, 0.6])
    assert summaries.learned_summary(fake, width=8)[1]["rot_random_qk_rho_s_vanishes_beyond_window"] is False


def test_rho_s_vanishing_is_undecided_where_the_control_passes_too(cells):
    """RoPE's ρ_s dephases: where it vanishes too, the mixing cells' claims are None (RoPE keeps its verdict), and
    without a control cell they are None as well."""
    fake = copy.deepcopy(cells)
    for c in ("rot_random_qk", "rope"):
        fake[c]["record"]["L256"]["rho_s_far_median"] = np.array([0.02, 0.02, 0.02])
    data, claims, _ = summaries.learned_summary(fake, width=8)
    assert claims["rot_random_qk_rho_s_vanishes_beyond_window"] is None
    assert claims["rope_rho_s_vanishes_beyond_window"] is True
    assert data["controls_rejected"] == {"rho_s_vanishes_beyond_window": False}
    alone = {c: fake[c] for c in ("rot_random_qk", "rot_random_qkv")}
    assert summaries.learned_summary(alone, width=8)[1]["rot_random_qk_rho_s_vanishes_beyond_window"] is None


def test_which_variants_mix():
    """PaTH and accumulated rotations mix; RoPE, NoPE, ALiBi and FoX do not, nor random rotations of dispersion 0
    (RoPE's angles at every step)."""
    from pathlab.attention.registry import attention_class, attention_settings

    def mixes(name, **kw):
        return attention_class(name).mixes(**attention_settings(name, **kw))

    assert all(mixes(n) for n in ("path", "path_fox", "rot_random_qk", "rot_random_qkv", "rot_learned_qk"))
    assert not any(mixes(n) for n in ("rope", "nope", "alibi", "fox"))
    assert not mixes("rot_random_qk", dispersion=0.0) and mixes("rot_random_qk", window=64)


def test_extrapolation_claims_follow_the_numbers(cells):
    fake = copy.deepcopy(cells)
    fake["rope"]["eval"] = _eval({64: 1.0, 8192: 16.0})
    fake["alibi"]["eval"] = _eval({64: 1.0, 8192: 0.97})
    fake["rot_random_qk"]["eval"] = _eval({64: 1.0, 8192: 7.0})
    fake["rot_random_qkv"]["eval"] = _eval({64: 1.0, 8192: 1.6})
    _, claims, _ = summaries.extrapolation_summary(fake)
    assert claims == {"rope_degrades_beyond_training": True, "alibi_stays_flat": True,
                      "accumulated_rotations_beat_rope": True, "qkv_flatter_than_qk": True}
    fake["rot_random_qkv"]["eval"] = _eval({64: 1.0, 8192: 9.0})
    fake["rope"]["eval"] = _eval({64: 1.0, 8192: 1.5})
    _, claims, _ = summaries.extrapolation_summary(fake)
    assert claims["qkv_flatter_than_qk"] is False and claims["rope_degrades_beyond_training"] is False
    fake["rope"]["eval"] = _eval({64: 1.0, 8192: 2.05})  # the interval [1.95, 2.15] straddles 2
    fake["rot_random_qkv"]["eval"] = _eval({64: 1.0, 8192: 7.2})  # overlaps Q/K's [6.65, 7.35]
    _, claims, _ = summaries.extrapolation_summary(fake)
    assert claims["rope_degrades_beyond_training"] is None and claims["qkv_flatter_than_qk"] is None


def _sweep(ratios: dict, qk: dict | None = None) -> dict:
    out = {"rope": {"cell": {"attention": "rope"}, "eval": _eval({64: 1.0, 1024: ratios.pop("rope")})}}
    for attention, group in (("rot_random_qkv", ratios), ("rot_random_qk", qk or {})):
        for W, r in group.items():
            out[f"{attention}_W{W}"] = {"cell": {"attention": attention, "attention_kwargs": {"window": W}},
                                        "eval": _eval({64: 1.0, 1024: r})}
    return out


def test_window_sweep_separation_holds_and_fails():
    _, claims, _ = summaries.window_sweep_summary(_sweep({16: 1.1, 32: 1.2, 256: 5.0, "rope": 9.0}), lengths=(1024,))
    assert claims["qkv_windows_below_training_length_extrapolate_better"] is True
    assert claims["qkv_ratio_rises_with_window"] is True
    assert claims["qk_windows_below_training_length_extrapolate_better"] is None  # no Q/K sweep cell
    _, claims, _ = summaries.window_sweep_summary(_sweep({16: 6.0, 32: 1.2, 256: 5.0, "rope": 9.0}), lengths=(1024,))
    assert claims["qkv_windows_below_training_length_extrapolate_better"] is False
    assert claims["qkv_ratio_rises_with_window"] is False


def test_rope_is_the_infinite_window_of_the_qk_group_only():
    """σ → 0 turns a Q/K rotation into RoPE, but a Q/K/V rotation would still rotate the values: a RoPE flatter
    than every window breaks the Q/K rise and leaves the Q/K/V one alone (it is only reported there)."""
    sweep = _sweep({16: 1.1, 32: 1.2, 256: 5.0, "rope": 0.5}, {16: 1.1, 32: 1.2, 256: 5.0})
    data, claims, _ = summaries.window_sweep_summary(sweep, lengths=(1024,))
    assert [p["cell"] for p in data["groups"]["qk"]][-1] == "rope"
    assert "rope" not in [p["cell"] for p in data["groups"]["qkv"]]
    assert claims["qkv_ratio_rises_with_window"] is True and claims["qk_ratio_rises_with_window"] is False
    assert data["rope_over_widest"]["qkv"]["W"] == 256
    assert data["rope_over_widest"]["qkv"]["ratio"] == pytest.approx(0.1)


def test_window_sweep_pairs_qkv_with_qk_at_each_window():
    def claim(qkv, qk):
        _, claims, _ = summaries.window_sweep_summary(_sweep({**qkv, "rope": 9.0}, qk), lengths=(1024,))
        return claims["qkv_flatter_than_qk_at_equal_window"]

    assert claim({16: 1.1, 256: 2.0}, {16: 1.5, 256: 2.5}) is True
    assert claim({16: 1.1, 256: 5.3}, {16: 1.5, 256: 2.7}) is False  # one window against the prediction
    assert claim({16: 1.1}, {256: 2.7}) is None  # no window in both groups
    assert claim({16: 1.1}, {}) is None
    assert claim({16: 1.5}, {16: 1.52}) is None  # overlapping intervals (±5%) decide nothing
    assert claim({16: 1.1, 256: 2.6}, {16: 1.5, 256: 2.7}) is None  # one decided, one open


def test_window_sweep_claims_compare_intervals_not_point_estimates():
    def claims(ratios):
        return summaries.window_sweep_summary(_sweep(ratios), lengths=(1024,))[1]

    # W = 16 and W = 256 (L_train = 64) overlap: the point estimates order them, the intervals do not
    assert claims({16: 5.0, 256: 5.2, "rope": 9.0})["qkv_windows_below_training_length_extrapolate_better"] is None
    # a dip within the intervals is no fall: the rise from W = 16 to RoPE is decided
    assert claims({16: 2.0, 32: 1.95, 256: 5.0, "rope": 9.0})["qkv_ratio_rises_with_window"] is True
    assert claims({16: 2.0, 32: 2.05, 256: 2.1, "rope": 2.0})["qkv_ratio_rises_with_window"] is None
    assert claims({16: 2.0, 32: 1.5, 256: 5.0, "rope": 9.0})["qkv_ratio_rises_with_window"] is False


def _windowed_eval(d: np.ndarray) -> dict:
    """An eval.json at L = 1024 whose 32 windows have loss − loss at the training context = d."""
    from pathlab.intervals import bootstrap_ratio

    row = {"window_loss": list(3.0 + d), "window_loss_train_context": [3.0] * d.size,
           "window_starts": list(range(d.size)), "ratio": float(np.exp(d.mean())),
           "ratio_ci95": list(bootstrap_ratio(3.0 + d, np.full_like(d, 3.0))), "loss": 3.0 + float(d.mean()),
           "loss_train_context": 3.0, "n_windows": d.size, "buckets": [{"start": 0, "stop": 1, "loss": 3.0,
                                                                        "loss_train_context": 3.0}]}
    base = {**row, "ratio": 1.0, "ratio_ci95": [1.0, 1.0], "window_loss": [3.0] * d.size, "loss": 3.0}
    return {"train_length": L_TRAIN, "lengths": {"64": base, "1024": row}}


def test_window_sweep_pairs_cells_on_their_shared_windows():
    text = np.random.default_rng().normal(1.0, 0.5, 32)  # the windows' difficulty, shared by every cell
    cells = {"rope": {"cell": {"attention": "rope"}, "eval": _windowed_eval(text + 2.0)}}
    for attention, shift in (("rot_random_qkv", 0.15), ("rot_random_qk", 0.0)):
        cells[f"{attention}_W16"] = {"cell": {"attention": attention, "attention_kwargs": {"window": 16}},
                                     "eval": _windowed_eval(text + shift)}
    data, claims, _ = summaries.window_sweep_summary(cells, lengths=(1024,))
    qkv, qk = data["groups"]["qkv"][0]["r1024_ci"], data["groups"]["qk"][0]["r1024_ci"]
    assert qkv[0] < qk[1]  # the marginal intervals overlap ...
    assert claims["qkv_flatter_than_qk_at_equal_window"] is False  # ... the paired one decides


def test_paired_ratios_to_rope_on_shared_and_on_other_windows():
    """Each cell's r(L) / r_RoPE(L) beyond the training length, with the paired interval: it holds the true ratio
    (about ×e^{−2} here, the windows' shared difficulty cancelling), and is None when the cells saw other windows."""
    rng = np.random.default_rng()
    text, own = rng.normal(1.0, 0.5, 32), rng.normal(0.0, 0.05, 32)
    cells = {"rope": {"eval": _windowed_eval(text + 2.0)}, "path": {"eval": _windowed_eval(text + own)}}
    data, claims, _ = summaries.extrapolation_summary(cells)
    (row,) = data["paired_to_rope"]["path"]
    lo, hi = row["paired_ci95"]
    assert row["L"] == 1024 and math.isclose(row["ratio"], math.exp(own.mean() - 2.0))
    assert lo <= row["ratio"] <= hi < 1 and hi / lo < 1.1  # paired: narrow, although the text varies by ±0.5
    assert claims["path_flatter_than_rope"] is True
    cells["path"]["eval"]["lengths"]["1024"]["window_starts"] = list(range(100, 132))
    data, _, _ = summaries.extrapolation_summary(cells)
    assert data["paired_to_rope"]["path"][0]["paired_ci95"] is None


def test_a_seed_margin_leaves_open_what_retraining_alone_could_move():
    """The same cells, decided by their windows alone and then against a spread between seeds: each claim that
    compares cells (M7 pairs, the W sweep, the M8 gate) holds by the windows, falls to None when the margin is
    wider than the effect, and holds again when the effect clears the margin."""
    rng = np.random.default_rng()
    text = rng.normal(1.0, 0.5, 32)

    def noise():
        return rng.normal(0.0, 0.01, 32)

    def claims_at(effect, margin):
        margins = {1024: margin} if margin else None
        pair = {"rope": {"cell": {"attention": "rope"}, "eval": _windowed_eval(text + 0.5 + noise())},
                "path": {"cell": {"attention": "path"}, "eval": _windowed_eval(text + 0.5 - effect + noise())}}
        sweep = {"rope": pair["rope"],
                 "rot_random_qk_W16": {"cell": {"attention": "rot_random_qk", "attention_kwargs": {"window": 16}},
                                       "eval": _windowed_eval(text + 0.5 - effect + noise())}}
        gate = {"rot_random_qk": {"cell": {"attention": "rot_random_qk"}, "eval": pair["rope"]["eval"]},
                "rot_random_qk_fox": {"cell": {"attention": "rot_random_qk_fox"}, "eval": pair["path"]["eval"]}}
        m7 = summaries.extrapolation_summary(pair, margins)[1]["path_flatter_than_rope"]
        w = summaries.window_sweep_summary(sweep, lengths=(1024,), margins=margins)[1]
        m8 = summaries.ablation_summary(gate, margins)[1]["gate_improves_rotations"]
        return m7, w["qk_windows_below_training_length_extrapolate_better"], m8

    assert claims_at(0.1, None) == (True, True, True)  # e^0.1 ≈ ×1.105, decided by the windows
    assert claims_at(0.1, 1.2) == (None, None, None)  # within a ×1.2 spread between seeds: open
    assert claims_at(0.4, 1.2) == (True, True, True)  # e^0.4 ≈ ×1.49 clears it
    assert summaries.extrapolation_summary({"rope": {"eval": _windowed_eval(text + 0.5)}}, {1024: 1.2})[0][
        "seed_margins"] == {1024: 1.2}


def test_a_gate_limits_far_mass_growth_only_where_the_gated_mass_rises_less(cells):
    """M8 (b) by the probes: the gated cell's far mass rises less than its ungated twin's. The negative control
    swaps the two records, and the claim must then fail."""

    def with_far_mass(short, long):
        entry = copy.deepcopy(cells["rope"])
        for L, value in ((64, short), (256, long)):
            entry["record"][f"L{L}"]["heads"]["far_mass"][...] = value
        return entry

    rising, flat = with_far_mass(0.1, 0.6), with_far_mass(0.01, 0.02)
    pairs = {"forget_gate_limits_far_mass_growth": ("path", "path_fox"),
             "gate_limits_rotation_far_mass_growth": ("rot_random_qk", "rot_random_qk_fox")}
    for name, (ungated, gated) in pairs.items():
        data, claims, _ = summaries.ablation_summary({ungated: rising, gated: flat})
        assert claims[name] is True
        np.testing.assert_allclose(data["far_mass_control_rho"][gated], [0.01, 0.02])
        assert summaries.ablation_summary({ungated: flat, gated: rising})[1][name] is False
    assert "gate_limits_rotation_far_mass_growth" not in summaries.ablation_summary({"path": rising})[1]


def test_markdown_table_lists_cells_and_published_numbers(cells):
    data, _, _ = summaries.extrapolation_summary(cells)
    text = summaries.extrapolation_markdown(data)
    assert "| rope |" in text and "published" in text and "[" in text


def test_seeds_repeat_the_pair_claims_and_flag_a_spread_beyond_the_windows():
    """A second seed that moves RoPE's r(1K) by e^{0.3} differs beyond the windows' interval, one that moves each
    of PaTH's windows by ±0.002 nats and their mean not at all does not; ``path_flatter_than_rope_at_seed2`` is
    decided on the second seeds alone, and fails where the second seeds rank the other way."""
    rng = np.random.default_rng()
    text = rng.normal(1.0, 0.5, 32)  # the windows' difficulty, shared by every cell

    def noise():
        return rng.normal(0.0, 0.01, 32)

    path = text + noise()
    wobble = 0.002 * (-1.0) ** np.arange(32)  # a second seed that differs window by window but not on average
    cells = {"rope": {"eval": _windowed_eval(text + 2.0 + noise())},
             "rope-seed2": {"eval": _windowed_eval(text + 1.7 + noise())},
             "path": {"eval": _windowed_eval(path)},
             "path-seed2": {"eval": _windowed_eval(path + wobble)}}
    data, claims, _ = summaries.seeds_summary(cells)
    assert set(data["pairs"]) == {"rope", "path"}
    assert data["pairs"]["rope"]["seeds_differ_beyond_windows"] is True
    assert data["pairs"]["path"]["seeds_differ_beyond_windows"] is False
    (row,) = [r for r in data["pairs"]["rope"]["seed_ratio"] if r["L"] == 1024]
    assert row["paired_ci95"][0] <= row["ratio"] <= row["paired_ci95"][1] and row["paired_ci95"][0] > 1.2
    assert claims == {"path_flatter_than_rope_at_seed2": True}
    cells["path-seed2"]["eval"] = _windowed_eval(text + 2.5 + noise())  # now worse than RoPE's second seed
    assert summaries.seeds_summary(cells)[1] == {"path_flatter_than_rope_at_seed2": False}
    assert summaries.seeds_summary({c: cells[c] for c in ("rope", "path")}) == ({"pairs": {}}, {}, {})
    cells["rope-seed2"]["eval"]["lengths"]["1024"]["window_starts"] = list(range(100, 132))  # other windows
    assert summaries.seeds_summary(cells)[0]["pairs"]["rope"]["seeds_differ_beyond_windows"] is None


def _budget_cell(attention: str, tokens: float, shift: float, text: np.ndarray, **kwargs) -> dict:
    return {"cell": {"attention": attention, "attention_kwargs": kwargs, "tokens": int(tokens)},
            "eval": _windowed_eval(text + shift + np.random.default_rng().normal(0.0, 0.01, text.size))}


def test_the_dispersion_sweep_starts_from_the_rope_of_its_own_budget():
    """τ = 0 is the RoPE trained on the sweep's budget. Here the 100M-token RoPE degrades most and the 50M-token
    one least, with the τ cells (50M) in between: read against the 100M RoPE, dispersion would seem to help (the
    defect this guards against); against its own budget's RoPE it does not. The negative control puts the same-budget
    RoPE above the τ cells, where the claim must hold."""
    text = np.random.default_rng().normal(1.0, 0.5, 32)

    def sweep(rope_50m_shift):
        return {"rope": _budget_cell("rope", 100e6, 2.5, text),
                "rope_50M": _budget_cell("rope", 50e6, rope_50m_shift, text),
                "rot_iid_tau0.5": _budget_cell("rot_random_qk", 50e6, 1.6, text, table="position", dispersion=0.5),
                "rot_iid_tau1": _budget_cell("rot_random_qk", 50e6, 1.5, text, table="position", dispersion=1.0)}

    data, claims, _ = summaries.ablation_summary(sweep(1.0))
    assert data["dispersion_baseline"] == "rope_50M"
    assert [(p["tau"], p["cell"]) for p in data["dispersion_sweep"]] == [
        (0.0, "rope_50M"), (0.5, "rot_iid_tau0.5"), (1.0, "rot_iid_tau1")]
    assert claims["extrapolation_improves_with_dispersion"] is False
    assert summaries.ablation_summary(sweep(2.0))[1]["extrapolation_improves_with_dispersion"] is True
    # without a RoPE of the sweep's budget there is no τ = 0: the claim is open, not decided against another budget
    no_baseline = {c: e for c, e in sweep(1.0).items() if c != "rope_50M"}
    data, claims, _ = summaries.ablation_summary(no_baseline)
    assert data["dispersion_baseline"] is None and claims["extrapolation_improves_with_dispersion"] is None
    assert [p["cell"] for p in data["dispersion_sweep"]] == ["rot_iid_tau0.5", "rot_iid_tau1"]


def test_comparisons_of_cells_of_different_budgets_are_refused():
    """A sweep or a pair whose cells were trained on different budgets compares budgets, not variants: every
    summary that compares r between cells stops with each cell's budget. Its control: the same cells at one budget."""
    text = np.random.default_rng().normal(1.0, 0.5, 32)
    tau = {"table": "position"}
    cases = [
        (lambda b: summaries.ablation_summary({
            "rot_iid_tau0.5": _budget_cell("rot_random_qk", 50e6, 1.6, text, dispersion=0.5, **tau),
            "rot_iid_tau1": _budget_cell("rot_random_qk", b, 1.5, text, dispersion=1.0, **tau)}),
         "the dispersion sweep"),
        (lambda b: summaries.ablation_summary({"path": _budget_cell("path", 50e6, 1.0, text),
                                               "path_fox": _budget_cell("path_fox", b, 0.5, text)}),
         "forget_gate_improves_extrapolation"),
        (lambda b: summaries.extrapolation_summary({"path": _budget_cell("path", 50e6, 1.0, text),
                                                    "rope": _budget_cell("rope", b, 2.0, text)}),
         "path_flatter_than_rope"),
        (lambda b: summaries.window_sweep_summary({
            "rope_50M": _budget_cell("rope", 50e6, 2.0, text),
            "rot_window_qk_W16": _budget_cell("rot_random_qk", b, 1.0, text, window=16, **tau)}, lengths=(1024,)),
         "the window sweep")]
    for summary, what in cases:
        summary(50e6)  # one budget: compared
        with pytest.raises(ValueError, match=rf"{what}: the cells were trained on different budgets \(.*100.0M"):
            summary(100e6)
