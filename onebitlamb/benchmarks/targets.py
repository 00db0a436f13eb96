"""The convergence targets with the defaults, at one seed: the check to run first after a change.

    python -m onebitlamb.benchmarks.targets            # every run (~2 h on 2 cores)
    python -m onebitlamb.benchmarks.targets --list     # what would run

The full convergence study (``python -m onebitlamb.benchmarks.convergence``, docs/convergence.md)
takes most of a day with its sweeps and seeds. This runs the part of it that the issue's targets
are about, at the main job's seed: on every preset LAMB and 1-bit LAMB with the automatic freeze
and every default (the study's 75% cap, so that the criterion decides: "within 1% of LAMB, no
divergence, and the volume reduction next to it"); on ``b4096`` 1-bit Adam with the automatic
freeze too ("1-bit LAMB ahead of 1-bit Adam at a batch of 4K"); on ``b1024`` the hand-picked 20%
freeze ("as good as the best hand-picked fraction", the target still open there). The runs are
the study's own rows, in its folders (``--out`` is shared with it by default), so each benchmark
reuses what the other has run.
Results go to the "targets" section of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from onebitlamb.benchmarks.convergence import (_ADAM_AUTO, _AUTO, PRESETS, VARIANTS, _gap, _loss, folder_name,
                                               pretrain_config, run_one)
from onebitlamb.benchmarks.report import command_line, heading, write_section

HAND_PICKED = "1bit-lamb freeze 20%"
# preset -> the study's variants this check runs there (LAMB and the default automatic freeze first)
CHECKS: Dict[str, List[str]] = {
    "b512": ["lamb", _AUTO],
    "demo": ["lamb", _AUTO],
    "b4096": ["lamb", _AUTO, _ADAM_AUTO],
    "b1024": ["lamb", _AUTO, HAND_PICKED],
}
WITHIN = 0.01  # the target: at most 1% above LAMB's held-out loss


def runs() -> List[Tuple[str, str]]:
    """(preset, variant) in the order they run: the short presets first."""
    return [(preset, variant) for preset, variants in CHECKS.items() for variant in variants]


def command(preset: str, variant: str) -> str:
    optimizer, flags = VARIANTS[variant]
    return f"onebitlamb pretrain --preset demo --optimizer {optimizer} {' '.join(PRESETS[preset] + flags)}".rstrip()


def _freeze(metrics: dict, preset: str) -> str:
    """The automatic freeze's step, marked where the cap made it rather than the criterion."""
    step = metrics.get("freeze_step")
    if not step:
        return "-"
    optimizer, flags = VARIANTS[_AUTO]
    cap = pretrain_config(optimizer, PRESETS[preset] + flags).freeze_step  # with --auto-freeze: the latest
    return f"{step} (the cap)" if step == cap else str(step)


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def render(results: Dict[Tuple[str, str], dict], command_text: str) -> str:
    lines = heading("Convergence targets with the defaults, at one seed", command_text)
    lines += [
        "Held-out MLM loss at the end of each preset's run (seed 1234), 1-bit LAMB with `--auto-freeze "
        "--freeze-frac 0.75` and otherwise the defaults (the study's row \"" + _AUTO + "\"). Freeze: the "
        "step at whose end it froze (\"the cap\": 75% of the steps, where the criterion had not fired yet). "
        "Volume: LAMB's bytes per worker over the run divided by the run's. "
        "Target: within 1% of LAMB's loss (or ahead), no divergence.",
        "",
        "| preset | LAMB | 1-bit LAMB auto: freeze, loss, vs LAMB | volume | within 1% |",
        "|---|---:|---|---:|---|",
    ]
    verdicts = []
    for preset in CHECKS:
        lamb, auto = results[(preset, "lamb")], results[(preset, _AUTO)]
        loss = auto["final_eval_loss"]
        ok = loss <= (1 + WITHIN) * lamb["final_eval_loss"]  # False for NaN: a divergence
        verdicts.append(ok)
        volume = (f"{lamb['bytes_sent_per_rank'] / auto['bytes_sent_per_rank']:.2f}x"
                  if auto["bytes_sent_per_rank"] else "-")
        lines.append(f"| {preset} | {_loss(lamb['final_eval_loss'])} | {_freeze(auto, preset)}, "
                     f"{_loss(loss)}, {_gap(loss, lamb['final_eval_loss'])} | {volume} | {_met(ok)} |")
    lines += ["", f"- Within 1% of LAMB with the defaults: {_met(all(verdicts))} on {sum(verdicts)} of "
                  f"{len(verdicts)} presets."]
    lamb, auto, adam = (results[("b4096", v)] for v in ("lamb", _AUTO, _ADAM_AUTO))
    # a NaN is a divergence: 1-bit LAMB is ahead where it did not diverge and 1-bit Adam did or ended higher
    lamb_loss, adam_loss = auto["final_eval_loss"], adam["final_eval_loss"]
    ahead = lamb_loss == lamb_loss and not adam_loss <= lamb_loss
    lines.append(f"- `b4096` (a batch of 4096): 1-bit LAMB {_loss(auto['final_eval_loss'])} against 1-bit Adam "
                 f"(\"{_ADAM_AUTO}\") {_loss(adam['final_eval_loss'])}, "
                 f"{_gap(adam['final_eval_loss'], lamb['final_eval_loss'])} against LAMB: 1-bit LAMB ahead: "
                 f"{_met(ahead)}.")
    auto, hand = results[("b1024", _AUTO)], results[("b1024", HAND_PICKED)]
    lines.append(f"- `b1024`: the automatic freeze {_loss(auto['final_eval_loss'])} against the hand-picked 20% "
                 f"(step {hand.get('freeze_step')}) {_loss(hand['final_eval_loss'])}, "
                 f"{_gap(auto['final_eval_loss'], hand['final_eval_loss'])}: as good as it: "
                 f"{_met(auto['final_eval_loss'] <= hand['final_eval_loss'])} at this seed (one seed cannot settle "
                 f"this target; docs/convergence.md has seven).")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onebitlamb.benchmarks.targets",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/convergence",
                        help="run folders, the convergence study's by default (reused when finished)")
    parser.add_argument("--results", default=None, help="results file (default: BENCHMARKS.md)")
    parser.add_argument("--list", action="store_true", help="print the runs and exit")
    args = parser.parse_args(argv)
    if args.list:
        for preset, variant in runs():
            print(f"{preset:6s} {command(preset, variant)}")
        return 0
    cache = os.path.join(args.out, "cache")
    results = {}
    for k, (preset, variant) in enumerate(runs(), start=1):
        print(f"[{k}/{len(runs())}] {preset}: {variant}", file=sys.stderr, flush=True)
        optimizer, flags = VARIANTS[variant]
        results[(preset, variant)] = run_one(os.path.join(args.out, preset, folder_name(variant)), optimizer,
                                             PRESETS[preset] + flags, cache)
    body = render(results, command_line(argv))
    print(body)
    write_section("targets", body, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
