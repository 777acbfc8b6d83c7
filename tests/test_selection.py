"""TRACE's selection rule, on hand-built labelings with known answers."""

from __future__ import annotations

import pytest

from trace_plugin.mining.selection import Label, SelectionRule, bootstrap_runs, run_metrics, select

L, P, NA = Label.LACKING, Label.PRESENT, Label.NA


def test_run_metrics_follow_the_paper():
    #          failed ---------------  succeeded -------
    labels = [L, L, L, P, NA, L, P, P, P, L]
    success = [False] * 5 + [True] * 5
    m = run_metrics(labels, success)
    assert (m.lacking_failed, m.present_failed, m.lacking_success, m.present_success) == (3, 1, 2, 3)
    assert m.coverage == pytest.approx(3 / 5)  # LF / failed, NA episodes included in "failed"
    assert m.er_failed == pytest.approx(3 / 4) and m.er_success == pytest.approx(2 / 5)
    assert m.contrast == pytest.approx(0.75 - 0.4)


def test_empty_groups_do_not_divide_by_zero():
    m = run_metrics([NA, NA], [True, False])
    assert (m.coverage, m.er_failed, m.er_success) == (0.0, 0.0, 0.0)


def test_selection_needs_both_coverage_and_contrast():
    success = [False] * 10 + [True] * 10
    planted = [L] * 8 + [P] * 2 + [P] * 10  # missing exactly where the agent fails
    everywhere = [L] * 20  # missing always: coverage, but no contrast
    rare = [L] + [NA] * 9 + [P] * 10  # perfect contrast, but explains one failure in ten
    labels = {"planted": planted, "everywhere": everywhere, "rare": rare}
    paper = SelectionRule(pervasive=None)
    results = {s.capability: s for s in select([(labels, success)] * 10, paper)}
    assert results["planted"].selected and results["planted"].passed == 10
    assert not results["everywhere"].selected and results["everywhere"].mean_contrast == 0
    assert results["rare"].selected and results["rare"].mean_coverage == pytest.approx(0.1)
    strict = {
        s.capability: s for s in select([(labels, success)] * 10, SelectionRule(rho=0.11, pervasive=None))
    }
    assert not strict["rare"].selected and strict["planted"].selected


def test_a_deficit_every_episode_shares_is_selected_as_pervasive_after_contrastive_ones():
    success = [False] * 10 + [True] * 10
    labels = {
        "planted": [L] * 8 + [P] * 2 + [P] * 10,
        "everywhere": [L] * 20,
        "mostly": [L] * 10 + [L] * 8 + [P, NA],  # 8 of 9 labeled successes lack it: below the 0.9 bar
        # The write no ticket got: missing wherever a write was asked (6 failures, and the 4
        # refusal tickets that succeeded anyway), not applicable elsewhere.
        "writes": [L] * 6 + [NA] * 4 + [L] * 4 + [NA] * 6,
    }
    ranked = select([(labels, success)] * 10)
    assert [(s.capability, s.selected, s.reason) for s in ranked] == [
        ("planted", True, "contrast"),
        ("everywhere", True, "pervasive"),
        ("writes", True, "pervasive"),
        ("mostly", False, "contrast"),
    ]
    # Missing wherever it applies, but from 1 failure in 10: below a coverage of 0.15.
    rare = {"rare": [L] + [NA] * 9 + [L] * 10}
    assert select([(rare, success)] * 10)[0].selected
    assert not select([(rare, success)] * 10, SelectionRule(rho=0.15))[0].selected
    assert ranked[1].passed == 10


def test_k_of_n_consistency_across_noisy_runs():
    success = [False] * 10 + [True] * 10
    good = {"cap": [L] * 8 + [P] * 2 + [P] * 10}
    noise = {"cap": [P] * 20}
    [seven] = select([(good, success)] * 7 + [(noise, success)] * 3)
    [eight] = select([(good, success)] * 8 + [(noise, success)] * 2)
    assert (seven.passed, seven.selected) == (7, False)
    assert (eight.passed, eight.selected) == (8, True)


def test_ranking_by_mean_contrast():
    success = [False] * 10 + [True] * 10
    labels = {"strong": [L] * 10 + [P] * 10, "weaker": [L] * 10 + [L] * 4 + [P] * 6, "absent": [P] * 20}
    ranked = [s.capability for s in select([(labels, success)] * 10)]
    assert ranked == ["strong", "weaker", "absent"]


def test_with_no_success_ties_in_contrast_go_to_the_capability_missing_from_more_failures():
    """No success: every applicable capability's Δ is 1. The one lacking in 8 of 10 failures
    ranks before the one lacking in 2 (and NA elsewhere), whatever their names."""
    success = [False] * 10
    labels = {"a_rare": [L] * 2 + [NA] * 8, "z_common": [L] * 8 + [NA] * 2}
    ranked = [s.capability for s in select([(labels, success)] * 10)]
    assert ranked == ["z_common", "a_rare"]


def test_bootstrap_resamples_are_deterministic_and_keep_pairs_together():
    labels = {"cap": [L, P, L, P, NA, L]}
    success = [False, True, False, True, True, False]
    runs = bootstrap_runs(labels, success, 10, seed=3)
    assert runs == bootstrap_runs(labels, success, 10, seed=3) and len(runs) == 10
    for resampled, outcomes in runs:  # an episode's label travels with its outcome
        for label, ok in zip(resampled["cap"], outcomes, strict=True):
            assert (label is L) == (not ok) or label is NA
    [result] = select(runs)
    assert result.selected and result.mean_contrast == pytest.approx(1.0)
