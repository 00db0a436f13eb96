"""Figures of a comparison (or of a single run): convergence, communication, per-layer diagnostics.

Each function takes ``{optimizer name: metrics dict}`` as written by ``metrics.write_metrics``.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from onebitlamb.train import files

LABELS = {"lamb": "LAMB", "onebitlamb": "1-bit LAMB", "onebitadam": "1-bit Adam", "zerooneadam": "0/1 Adam"}
COLORS = {"lamb": "tab:blue", "onebitlamb": "tab:orange", "onebitadam": "tab:green", "zerooneadam": "tab:red"}
# line and marker per optimizer, so that curves can be told apart where they overlap (the two
# 1-bit optimizers send the same bytes) and in grey print
ADAMS = ("onebitadam", "zerooneadam")
STYLES = {"lamb": ("-", "o"), "onebitlamb": ("--", "s"), "onebitadam": ("-.", "^"), "zerooneadam": (":", "v")}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# the stages a step can run in (``metrics["stage"]``), shaded in a run's curves; the warm-up
# (LAMB's whole run) is left blank
STAGE_SHADES = {"compression": ("tab:purple", "compression stage (1-bit)"),
                "local": ("tab:olive", "local steps (no exchange)")}


def _legend(ax, **kwargs) -> None:
    """A legend when the axes has something labelled: matplotlib warns and draws an empty box
    otherwise."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def stage_spans(stages: List[str]) -> List[tuple]:
    """``(stage, first step, last step)`` for each run of consecutive steps in one stage, steps
    1-based (``stages[0]`` is step 1's)."""
    spans: List[list] = []
    for step, stage in enumerate(stages, 1):
        if spans and spans[-1][0] == stage:
            spans[-1][2] = step
        else:
            spans.append([stage, step, step])
    return [tuple(span) for span in spans]


def _shade_stages(ax, stages: List[str]) -> None:
    """Every step outside the warm-up shaded by its stage, step ``s`` covering ``[s - 1, s]`` (so
    the compression stage starts at the freeze step's line); one legend entry per stage."""
    labelled = set()
    for stage, first, last in stage_spans(stages):
        if stage in STAGE_SHADES:
            color, label = STAGE_SHADES[stage]
            ax.axvspan(first - 1, last, color=color, alpha=0.12, lw=0,
                       label=None if stage in labelled else label)
            labelled.add(stage)


def plot_compare(runs: Dict[str, dict], path: str) -> None:
    """Against the step, every panel: held-out MLM loss; cumulative bytes sent per worker;
    cumulative rounds (collectives called) per worker. Each 1-bit optimizer's freeze in each."""
    fig = compare_figure(runs)
    files.save_figure(fig, path, dpi=110)
    _plt().close(fig)


def compare_figure(runs: Dict[str, dict]):
    """``plot_compare``'s figure. Each optimizer has its own line style and marker; where curves
    coincide (LAMB's loss and 1-bit LAMB's, the 1-bit optimizers' bytes) each later curve is drawn
    above and thinner than the earlier ones, so the earlier shows at its edges; the markers are
    hollow (those of the byte and round curves shifted against each other), and a byte curve equal
    to an earlier one says so in the legend. Every panel is against the step (the runs of a
    comparison take the same samples a step) and marks each freeze, with a legend entry."""
    plt = _plt()
    with_rounds = any(r is not None for m in runs.values() for _, r in m.get("rounds_curve") or [])
    fig, axes = plt.subplots(1, 3 if with_rounds else 2, figsize=(17 if with_rounds else 11.5, 4.5))
    ax_loss, ax_bytes, ax_rounds = (*axes, None)[:3]
    drawn: Dict[str, list] = {}
    for i, (name, m) in enumerate(runs.items()):
        label, color = LABELS.get(name, name), COLORS.get(name)
        ls, marker = STYLES.get(name, ("-", "."))
        every = max(len(runs), len(m["bytes_curve"]) // 8)  # about 8 markers a curve, each curve's at other steps
        style = dict(ls=ls, marker=marker, color=color, zorder=2 + i, lw=1.2 + 1.2 * (len(runs) - 1 - i),
                     markerfacecolor="none", markeredgewidth=1.5)
        batch = m["samples"] / m["steps"]
        xs, ys = zip(*m["eval_curve"])
        ax_loss.plot([x / batch for x in xs], ys, label=label, **style)  # a marker at each evaluation
        steps, cum = zip(*([[0, 0]] + list(m["bytes_curve"])))
        same = [LABELS.get(n, n) for n, other in drawn.items() if other == list(cum)]
        drawn[name] = list(cum)
        ax_bytes.plot(steps, [b / 1e6 for b in cum], markevery=(i * every // len(runs), every),
                      label=label + (f" (same bytes as {' and '.join(same)})" if same else ""), **style)
        rounds = [(step, r) for step, r in m.get("rounds_curve") or [] if r is not None]
        if rounds and ax_rounds is not None:
            r_steps, r_cum = zip(*([(0, 0)] + rounds))
            ax_rounds.plot(r_steps, r_cum, markevery=(i * every // len(runs), every), label=label, **style)
    for name, m in runs.items():
        if m.get("freeze_step"):
            for ax in axes:
                ax.axvline(m["freeze_step"], color=COLORS.get(name), ls=":", lw=1.2, zorder=1,
                           label=f"freeze of {LABELS.get(name, name)} (step {m['freeze_step']})")
    ax_loss.set(xlabel="step", ylabel="held-out MLM loss", title="convergence (the same samples each step)")
    ax_bytes.set(xlabel="step", ylabel="MB sent per worker (cumulative)", title="communication volume")
    if ax_rounds is not None:
        ax_rounds.set(xlabel="step", ylabel="rounds per worker (cumulative)",
                      title="communication rounds (collectives called)")
    for ax in axes:
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=8)
    fig.tight_layout()
    return fig


def plot_run(metrics: dict, path: str) -> bool:
    """One run's curves, from its ``metrics.json``; ``run_figure`` draws them."""
    fig = run_figure(metrics)
    files.save_figure(fig, path, dpi=100)
    _plt().close(fig)
    return True


def run_figure(metrics: dict):
    """``plot_run``'s figure, every panel against the step: the training loss of every step and the
    held-out loss at each evaluation; the cumulative MB this worker sent; the cumulative rounds
    (collectives called), when the run recorded them. In each, the freeze step dotted and the steps
    after the warm-up shaded by their stage (a LAMB run has neither)."""
    plt = _plt()
    name = metrics["optimizer"]
    label, color = LABELS.get(name, name), COLORS.get(name)
    batch = metrics["samples"] / metrics["steps"]
    rounds = [(step, r) for step, r in metrics.get("rounds_curve") or [] if r is not None]
    fig, axes = plt.subplots(1, 3 if rounds else 2, figsize=(17 if rounds else 11.5, 4.5))
    ax_loss, ax_bytes = axes[:2]
    train = metrics["train_loss"]
    ax_loss.plot(range(1, len(train) + 1), train, color=color, alpha=0.45, lw=1, label="training loss (rank 0)")
    xs, ys = zip(*metrics["eval_curve"])
    ax_loss.plot([x / batch for x in xs], ys, color=color, marker="o", label="held-out loss")
    steps, cum = zip(*([[0, 0]] + list(metrics["bytes_curve"])))
    ax_bytes.plot(steps, [b / 1e6 for b in cum], color=color, label="MB sent by this worker")
    ax_loss.set(xlabel="step", ylabel="MLM loss", title=f"{label}: loss")
    ax_bytes.set(xlabel="step", ylabel="MB sent per worker (cumulative)",
                 title=f"{label}: communication volume ({metrics['world_size']} workers)")
    if rounds:
        ax_rounds = axes[2]
        ax_rounds.plot(*zip(*([(0, 0)] + rounds)), color=color, label="collectives called by this worker")
        ax_rounds.set(xlabel="step", ylabel="rounds per worker (cumulative)", title=f"{label}: communication rounds")
    freeze = metrics.get("freeze_step")
    for ax in axes:
        _shade_stages(ax, metrics.get("stage") or [])
        if freeze:
            ax.axvline(freeze, color="0.3", ls=":", lw=1.2, label=f"freeze (step {freeze})")
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=8)
    if not freeze and set(metrics.get("stage") or []) <= {"warmup"}:
        ax_loss.set_title(f"{label}: loss (full precision every step, no freeze)")
    fig.tight_layout()
    return fig


def _pick_layers(names: List[str], k: int = 3) -> List[str]:
    """A few representative layers: the word embeddings, a first-layer attention matrix, a
    last-layer feed-forward matrix (falling back to the first names)."""
    wanted = []
    for pattern in ("word_embeddings", "layer.0.attention.self.query.weight", "output.dense.weight"):
        hits = [n for n in names if pattern in n and "attention.output" not in n]
        if hits:
            wanted.append(hits[-1] if pattern == "output.dense.weight" else hits[0])
    for n in names:
        if len(wanted) >= k:
            break
        if n not in wanted:
            wanted.append(n)
    return wanted[:k]


def _coefficient(layer: dict) -> Optional[float]:
    """The coefficient applied: frozen x factor in 1-bit LAMB's compression stage, else the live
    trust ratio."""
    if layer.get("frozen_coeff") is not None and layer.get("factor") is not None:
        return layer["frozen_coeff"] * layer["factor"]
    return layer.get("trust_ratio")


def plot_diagnostics(runs: Dict[str, dict], path: str) -> None:
    """Per-layer diagnostics (``diagnostics_figure``); nothing when no run has any."""
    fig = diagnostics_figure(runs)
    if fig is not None:
        files.save_figure(fig, path, dpi=100)
        _plt().close(fig)


def diagnostics_figure(runs: Dict[str, dict]):
    """Top: per-layer coefficient over steps (LAMB's live trust ratio vs 1-bit LAMB's frozen
    coefficient times factor), when a LAMB-type optimizer is among the runs (Adam's is 1). Bottom:
    relative step size |dx|/|x| per layer, for every optimizer. Last column: every layer at the last
    diagnostic step. None when no run has diagnostics."""
    runs = {n: m for n, m in runs.items() if m.get("diagnostics")}
    if not runs:
        return None
    plt = _plt()
    any_run = next(iter(runs.values()))
    names = [l["name"] for l in any_run["diagnostics"][0]["layers"]]
    chosen = _pick_layers(names)
    cols = len(chosen) + 1
    with_coeff = any(name not in ADAMS for name in runs)
    fig, axes = plt.subplots(2 if with_coeff else 1, cols, figsize=(4.2 * cols, 7.5 if with_coeff else 4),
                             squeeze=False)
    coeff_row, rel_row = (axes[0] if with_coeff else None), axes[-1]
    for j, lname in enumerate(chosen):
        for name, m in runs.items():
            steps, coeff, rel = [], [], []
            for d in m["diagnostics"]:
                layer = next((l for l in d["layers"] if l["name"] == lname), None)
                if layer is not None:
                    steps.append(d["step"])
                    coeff.append(_coefficient(layer))
                    rel.append(layer["rel_step"])
            color, label = COLORS.get(name), LABELS.get(name, name)
            if name not in ADAMS:  # Adam has no layer-wise coefficient (it is 1)
                coeff_row[j].plot(steps, coeff, marker=".", color=color,
                                  ls="--" if name == "onebitlamb" else "-", label=label)
            rel_row[j].plot(steps, rel, marker=".", color=color, label=label)
            if m.get("freeze_step"):
                for ax in axes[:, j]:
                    ax.axvline(m["freeze_step"], color=color, ls=":", lw=1)
        short = lname.replace("bert.", "").replace(".weight", "")
        xlabel = "step (dotted: the freeze)" if any(m.get("freeze_step") for m in runs.values()) else "step"
        if with_coeff:
            coeff_row[j].set(title=f"{short}\ncoefficient (trust ratio / frozen x factor)", xlabel=xlabel)
        rel_row[j].set(title=f"{short}\nrelative step |dx|/|x|", xlabel=xlabel, yscale="log")
    # every layer at the last diagnostic point
    for name, m in runs.items():
        last = m["diagnostics"][-1]
        color, label = COLORS.get(name), LABELS.get(name, name)
        idx = list(range(len(last["layers"])))
        if name not in ADAMS:
            coeff_row[-1].plot(idx, [_coefficient(l) for l in last["layers"]], marker=".", color=color,
                               ls="--" if name == "onebitlamb" else "-", label=label)
        rel_row[-1].plot(idx, [l["rel_step"] for l in last["layers"]], marker=".", color=color, label=label)
    step = any_run["diagnostics"][-1]["step"]
    if with_coeff:
        coeff_row[-1].set(title=f"all layers at step {step}\ncoefficient", xlabel="layer (optimizer order)",
                          yscale="log")
    rel_row[-1].set(title=f"all layers at step {step}\nrelative step |dx|/|x|", xlabel="layer (optimizer order)",
                    yscale="log")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=8)
    fig.tight_layout()
    return fig


def plot_freeze(metrics: dict, path: str, highlighted: int = 4) -> bool:
    """How an automatic freeze decided (``freeze_figure``). Returns False (and draws nothing) for a
    run without the automatic freeze."""
    fig = freeze_figure(metrics, highlighted)
    if fig is None:
        return False
    files.save_figure(fig, path, dpi=100)
    _plt().close(fig)
    return True


def freeze_figure(metrics: dict, highlighted: int = 4):
    """How an automatic freeze decided, from the run's per-step ``freeze`` records. Top: every
    layer's ``log ||v_hat||`` over the warm-up, the layers that rose most in colour (on a plateau a
    layer sits low and flat; its exit is the rise). Bottom: the spread the criterion watches (the
    least settled layer's movement over the window) against AutoFreeze's thresholds; for 1-bit LAMB,
    on its own scale, the median layer's trust-ratio rise, which the freeze waits to fall to
    ``trust_tolerance`` from the step the criterion held. A run whose warm-up ended before a window
    had passed (a short run) has no spread: the top alone. None for a run without the automatic
    freeze."""
    records = metrics.get("freeze") or []
    if metrics.get("config", {}).get("freeze") != "auto":
        return None
    rows = [(i + 1, r["levels"]) for i, r in enumerate(records)
            if r and r.get("levels") is not None and metrics["stage"][i] == "warmup"]
    if not rows:
        return None
    import onebitlamb

    policy = onebitlamb.AutoFreeze(total_steps=metrics["steps"])  # the main job runs it with its defaults
    last = records[-1]
    names = metrics.get("layers") or [f"layer {j}" for j in range(len(rows[0][1]))]
    steps = [s for s, _ in rows]
    series = [[row[j] if row[j] is not None else float("nan") for _, row in rows] for j in range(len(names))]

    def rise(j: int) -> float:
        seen = [v for v in series[j] if v == v]
        return seen[-1] - min(seen) if seen else 0.0

    top = sorted(range(len(names)), key=rise, reverse=True)[:highlighted]
    spread = [(s, records[s - 1]["spread"]) for s in steps if records[s - 1].get("spread") is not None]
    trust = [records[s - 1].get("trust_rise") for s in steps]
    has_trust = any(v is not None for v in trust)
    plt = _plt()
    if spread or has_trust:
        fig, (ax_levels, ax_spread) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    else:  # no window filled before the freeze (a run shorter than a few windows): nothing to draw below
        fig, ax_levels = plt.subplots(1, 1, figsize=(12, 4.8))
        ax_spread = None
    for j in range(len(names)):
        if j not in top:
            ax_levels.plot(steps, series[j], color="0.75", lw=0.8)
    for j in top:
        ax_levels.plot(steps, series[j], lw=1.8, label=names[j].replace("bert.", ""))
    # the step markers go below, beside the criterion, or on the levels when there is no panel below
    marks = ax_levels if ax_spread is None else ax_spread
    if ax_spread is not None:
        if spread:
            ax_spread.plot(*zip(*spread), color="black", label=f"spread over the window ({policy.window} steps)")
        for value, text, style in ((policy.transient, "transient", "--"),
                                   (policy.transient_end, "transient end", "-."), (policy.tolerance, "tolerance", ":")):
            ax_spread.axhline(value, color="tab:red", ls=style, lw=1, label=f"{text} ({value:g})")
    if ax_spread is not None and has_trust:
        # NaN where no window was in: a gap, not a line across it
        ax_trust = ax_spread.twinx()
        ax_trust.plot(steps, [float("nan") if v is None else v for v in trust], color="tab:green", lw=1.2,
                      label="median trust-ratio rise (right scale)")
        ax_trust.axhline(policy.trust_tolerance, color="tab:green", ls=":", lw=1,
                         label=f"the wait ends at or below ({policy.trust_tolerance:g})")
        ax_trust.set_ylabel("trust-ratio rise over the window (log)", color="tab:green")
        ax_trust.legend(fontsize=8, loc="lower right")
    for step, text, style in ((last.get("floor_step"), "floor", "--"), (last.get("cap_step"), "cap", "-.")):
        if step:
            marks.axvline(step, color="0.5", ls=style, lw=1, label=f"{text} (step {step})")
    ready, waited, freeze = last.get("ready_step"), last.get("trust_peak_step"), metrics.get("freeze_step")
    if ready and ready != freeze:
        marks.axvline(ready, color="tab:green", ls="--", lw=1.2, label=f"criterion held (step {ready})")
    if waited and waited != freeze:  # the freeze came later, at the floor
        marks.axvline(waited, color="tab:green", ls="-.", lw=1.2, label=f"the wait ended (step {waited})")
    panels = [ax for ax in (ax_levels, ax_spread) if ax is not None]
    if freeze:
        for ax in panels:
            ax.axvline(freeze, color="tab:orange", ls=":", lw=1.5, label=f"freeze (step {freeze})")
    ax_levels.set(ylabel="log ||v_hat|| per layer", title="the automatic freeze: each layer's variance level")
    if ax_spread is None:
        ax_levels.set(xlabel="step", title="the automatic freeze: each layer's variance level\n"
                      f"(no spread to show: the warm-up ended before a window of {policy.window} steps had passed)")
    else:
        ax_spread.set(xlabel="step", ylabel="max - min over the window (log)",
                      title="the least settled layer's movement over the window")
    for ax in panels:
        ax.grid(alpha=0.3)
        if ax_spread is None:  # beside the panel: over the levels it would hide some
            _legend(ax, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
        else:
            _legend(ax, fontsize=8)
    fig.tight_layout()
    return fig
