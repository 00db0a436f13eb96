"""The main job's figures (onebitlamb/train/plots.py), drawn from hand-made metrics in the shapes a
run writes: no panel without data, no empty legend, no warning, and the freeze and the stage in a
run's curves. The figures of real runs: tests/test_train_e2e.py (which uses ``assert_no_holes``)."""
import warnings

import pytest

from onebitlamb.train import plots


def assert_no_holes(fig):
    """Every axes shows data (a curve or points, not only reference lines and shading) and every
    legend has entries."""
    for ax in fig.axes:
        data = [line for line in ax.get_lines() if line.get_transform() is ax.transData]  # not axhline/axvline
        assert data or ax.collections, f"empty panel: {ax.get_title()!r}"
        legend = ax.get_legend()
        assert legend is None or legend.get_texts(), f"empty legend in {ax.get_title()!r}"


@pytest.fixture
def figures():
    """Draws with every warning recorded, then closes the figures and checks none was raised."""
    import matplotlib.pyplot as plt

    drawn = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield lambda fig: drawn.append(fig) or fig
    for fig in drawn:
        if fig is not None:
            plt.close(fig)
    assert not [str(w.message) for w in caught]


def _run(optimizer="onebitlamb", steps=8, freeze=6, spread_from=None, with_rounds=True):
    """A run's metrics.json: 2 workers, 16 samples a step, evaluations at 0, steps/2 and steps, the
    freeze at ``freeze`` (None: LAMB), spread and trust-ratio rise recorded from step ``spread_from``
    (None: no window passed before the freeze, as on the tiny preset)."""
    layers = ["bert.embeddings.word_embeddings.weight", "bert.encoder.layer.0.attention.self.query.weight",
              "bert.encoder.layer.0.output.dense.weight", "cls.predictions.bias"]
    stage = ["warmup" if freeze is None or s <= freeze else "compression" for s in range(1, steps + 1)]
    bytes_per_step = [100_000 if st == "warmup" else 3_000 for st in stage]
    records = None
    if freeze is not None:
        records = [{"stage": stage[s - 1], "frozen_at": freeze if s >= freeze else None, "floor_step": 2,
                    "cap_step": 6, "ready_step": freeze, "trust_peak_step": None,
                    "levels": [-5.0 - j + 0.1 * s for j in range(len(layers))] if s <= freeze else None,
                    "spread": 0.5 + 4 / s if spread_from and s >= spread_from else None,
                    "trust_rise": 0.1 - 0.02 * s if spread_from and s >= spread_from else None}
                   for s in range(1, steps + 1)]
    diagnostics = [{"step": s, "layers": [{"name": n, "trust_ratio": 0.9 + 0.01 * j,
                                           "frozen_coeff": 0.9 if freeze and s > freeze else None,
                                           "factor": 1.02 if freeze and s > freeze else None,
                                           "rel_step": 1e-3 * (j + 1)} for j, n in enumerate(layers)]}
                   for s in (steps // 2, steps)]
    return {
        "optimizer": optimizer, "world_size": 2, "steps": steps, "samples": 16 * steps,
        "freeze_step": freeze, "stage": stage,
        "train_loss": [6.3 - 0.01 * s for s in range(1, steps + 1)],
        "eval_curve": [[0, 6.3], [16 * steps // 2, 6.25], [16 * steps, 6.2]],
        "bytes_curve": [[s, sum(bytes_per_step[:s])] for s in range(1, steps + 1)],
        "rounds_curve": [[s, s + max(0, s - (freeze or steps)) if with_rounds else None]
                         for s in range(1, steps + 1)],
        "diagnostics": diagnostics, "config": {"freeze": "auto" if freeze else 0.35},
        "freeze": records, "layers": layers,
    }


@pytest.mark.parametrize("optimizer,freeze", [("onebitlamb", 6), ("lamb", None)])
def test_a_runs_curves_have_no_holes_and_show_the_freeze_and_the_stage(figures, optimizer, freeze):
    fig = figures(plots.run_figure(_run(optimizer, freeze=freeze)))
    assert len(fig.axes) == 3  # loss, MB sent, rounds
    assert_no_holes(fig)
    for ax in fig.axes:
        labels = ax.get_legend_handles_labels()[1]
        if freeze:  # a dotted line at the freeze, the compression stage shaded from it to the end
            assert "freeze (step 6)" in labels and "compression stage (1-bit)" in labels
            (span,) = ax.patches
            assert (span.get_x(), span.get_x() + span.get_width()) == (6, 8)
        else:
            assert not ax.patches and not any("freeze" in label for label in labels)
    if not freeze:
        assert "no freeze" in fig.axes[0].get_title()


def test_a_run_without_rounds_has_two_panels(figures):
    """Metrics from before the rounds were recorded: no third panel rather than an empty one."""
    fig = figures(plots.run_figure(_run(with_rounds=False)))
    assert len(fig.axes) == 2
    assert_no_holes(fig)


def test_stage_spans_shade_each_run_of_steps():
    assert plots.stage_spans(["warmup", "warmup", "compression", "local", "local", "compression"]) == [
        ("warmup", 1, 2), ("compression", 3, 3), ("local", 4, 5), ("compression", 6, 6)]
    assert plots.stage_spans([]) == []


def test_freeze_figure_of_a_short_run_is_the_levels_alone(figures):
    """No window passed before the freeze (the tiny preset): no spread, no panel for it; the floor,
    the cap and the freeze on the levels, and the title says why."""
    fig = figures(plots.freeze_figure(_run()))
    (ax,) = fig.axes
    assert_no_holes(fig)
    labels = ax.get_legend_handles_labels()[1]
    assert {"floor (step 2)", "cap (step 6)", "freeze (step 6)"} <= set(labels)
    assert "no spread to show" in ax.get_title()


def test_freeze_figure_with_the_spread(figures):
    fig = figures(plots.freeze_figure(_run(steps=40, freeze=20, spread_from=5)))
    assert len(fig.axes) == 3  # the levels, the spread, the trust-ratio rise on its own scale
    assert_no_holes(fig)
    trust = fig.axes[2]  # the wait's threshold drawn where the policy applies it, not at 0
    (line,) = [l for l in trust.get_lines() if l.get_label().startswith("the wait ends")]
    assert list(line.get_ydata()) == [0.15, 0.15] and "(0.15)" in line.get_label()


def test_no_freeze_figure_without_the_automatic_freeze(figures):
    assert plots.freeze_figure(_run("lamb", freeze=None)) is None
    assert plots.plot_freeze(_run("lamb", freeze=None), "unused.png") is False


@pytest.mark.parametrize("names", [("lamb", "onebitlamb", "onebitadam"), ("onebitadam", "zerooneadam")])
def test_comparison_figures_have_no_holes(figures, names):
    """compare.png and diagnostics.png; with the Adams alone there is no coefficient to draw (it is
    1), so no row for it."""
    runs = {n: _run(n, freeze=None if n == "lamb" else 6) for n in names}
    compare = figures(plots.compare_figure(runs))
    assert len(compare.axes) == 3
    assert_no_holes(compare)
    diagnostics = figures(plots.diagnostics_figure(runs))
    assert len(diagnostics.axes) == (8 if "lamb" in names else 4)
    assert_no_holes(diagnostics)


def test_compare_figure_without_rounds_has_two_panels(figures):
    fig = figures(plots.compare_figure({n: _run(n, with_rounds=False) for n in ("lamb", "onebitlamb")}))
    assert len(fig.axes) == 2
    assert_no_holes(fig)


def test_compare_figure_marks_each_freeze_in_every_panel_against_the_step(figures):
    """compare.png: each panel against the step, each 1-bit optimizer's freeze a line in each with
    its legend entry; where LAMB's loss and 1-bit LAMB's coincide (here: equal values), the curve
    drawn above is the thinner, so the one below shows at its edges, and the markers are hollow."""
    runs = {"lamb": _run("lamb", freeze=None), "onebitlamb": _run("onebitlamb", freeze=6),
            "onebitadam": _run("onebitadam", freeze=5)}
    fig = figures(plots.compare_figure(runs))
    for ax in fig.axes:
        assert ax.get_xlabel() == "step", ax.get_title()
        labels = ax.get_legend().get_texts()
        assert {"freeze of 1-bit LAMB (step 6)", "freeze of 1-bit Adam (step 5)"} <= {t.get_text() for t in labels}
        freezes = {line.get_label(): line.get_xdata()[0] for line in ax.get_lines() if "freeze" in line.get_label()}
        assert freezes == {"freeze of 1-bit LAMB (step 6)": 6, "freeze of 1-bit Adam (step 5)": 5}
    ax_loss = fig.axes[0]
    assert max(x for line in ax_loss.get_lines() for x in line.get_xdata()) == 8  # steps, not samples
    lamb, onebit = (next(line for line in ax_loss.get_lines() if line.get_label() == label)
                    for label in ("LAMB", "1-bit LAMB"))
    assert list(lamb.get_ydata()) == list(onebit.get_ydata())  # the case where one hid the other
    assert onebit.get_zorder() > lamb.get_zorder() and lamb.get_linewidth() > onebit.get_linewidth()
    assert lamb.get_marker() != onebit.get_marker() and onebit.get_markerfacecolor() == "none"
