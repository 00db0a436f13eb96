"""The harness a redesign runs before and after: does every optimizer give the same bits?

    python tests/bit_identity.py --write before.json      # on the commit before the change
    python tests/bit_identity.py --compare before.json    # on the change: lists every difference

Bit-identity is a property of two runs on one machine (compiled loops, the CPU's vector unit), so
the fingerprints are compared on the machine that wrote them, never committed as expected values.
On 2 real gloo ranks, each configuration below steps the toy layers (``toy.py``) through its warm-up
and its stage 2 (0/1 Adam: its variance steps, 1-bit steps, local steps and syncs), with a
checkpoint round trip in the middle; its fingerprint is the SHA-256 of every parameter after every
step, of the state dict after the round trip, and the bytes of every step. ``test_bit_identity``
checks that two runs of the harness agree with each other and that a changed number is seen.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import warnings
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import onebitlamb  # noqa: E402
from toy import grads_for, initial_params, through_a_checkpoint  # noqa: E402

STEPS, FREEZE, SAVE_AT = 16, 6, 9
CONFIGS: Dict[str, tuple] = {
    "lamb": (onebitlamb.Lamb, {}),
    "onebitlamb": (onebitlamb.OneBitLamb, {"freeze_step": FREEZE}),
    "onebitlamb-momentum": (onebitlamb.OneBitLamb, {"freeze_step": FREEZE, "compression_space": "momentum"}),
    "onebitlamb-live": (onebitlamb.OneBitLamb, {"freeze_step": FREEZE, "trust_ratio_after_freeze": "live"}),
    "onebitlamb-unbounded": (onebitlamb.OneBitLamb, {"freeze_step": FREEZE, "bound_direction": False}),
    "onebitlamb-int8": (onebitlamb.OneBitLamb, {"freeze_step": FREEZE, "warmup_dtype": "int8"}),
    "onebitlamb-buckets": (onebitlamb.OneBitLamb, {"freeze_step": FREEZE, "bucket_cap_mb": 1e-4}),
    "onebitlamb-auto": (onebitlamb.OneBitLamb, {"freeze_step": onebitlamb.AutoFreeze(total_steps=STEPS)}),
    "onebitadam": (onebitlamb.OneBitAdam, {"freeze_step": FREEZE}),
    "zerooneadam": (onebitlamb.ZeroOneAdam, {"var_freeze_step": FREEZE, "var_update_scaler": 1,
                                             "local_step_scaler": 2, "local_step_clipper": 2}),
}


def _digest(value) -> str:
    blob = io.BytesIO()
    torch.save(value, blob)
    return hashlib.sha256(blob.getvalue()).hexdigest()


def _fingerprints(rank: int, world: int) -> Dict[str, dict]:
    warnings.simplefilter("ignore")  # the early freeze's warning: the toy run freezes early on purpose
    out = {}
    for name, (cls, options) in CONFIGS.items():
        def fresh(init):
            params = [torch.nn.Parameter(t.clone()) for t in init]
            return params, cls(params, lr=0.02, weight_decay=0.01, **options)

        params, opt = fresh(initial_params())
        steps: List[str] = []
        sent: List[int] = []
        state = None
        for t in range(1, STEPS + 1):
            for p, g in zip(params, grads_for(params, rank, t)):
                p.grad = g
            opt.step()
            steps.append(_digest([p.detach() for p in params]))
            sent.append(opt.last_step_bytes)
            if t == SAVE_AT:
                params, opt = through_a_checkpoint(params, opt, fresh)
                state = _digest(opt.state_dict()["state"])
        out[name] = {"steps": steps, "bytes": sent, "state after the round trip": state}
    return out


def fingerprints() -> Dict[str, dict]:
    """Rank by rank, each configuration's fingerprint (two gloo ranks on loopback)."""
    from onebitlamb.comm.launch import spawn_local

    ranks = spawn_local(_fingerprints, 2, (), timeout_s=600, collective_timeout_s=300)
    return {f"{name} rank {r}": value for r, by_name in enumerate(ranks) for name, value in by_name.items()}


def differences(before: Dict[str, dict], after: Dict[str, dict]) -> List[str]:
    """What differs, one line a configuration, rank and quantity (the first step that differs)."""
    out = []
    for key in sorted(set(before) | set(after)):
        if key not in before or key not in after:
            out.append(f"{key}: only {'after' if key in after else 'before'}")
            continue
        for quantity in ("steps", "bytes", "state after the round trip"):
            a, b = before[key][quantity], after[key][quantity]
            if a != b:
                where = next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y), None) if isinstance(a, list) else None
                out.append(f"{key}: {quantity} differ" + (f" from step {where}" if where else ""))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/bit_identity.py", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="JSON", help="write this checkout's fingerprints")
    mode.add_argument("--compare", metavar="JSON", help="compare this checkout's with those written before")
    args = parser.parse_args(argv)
    now = fingerprints()
    if args.write:
        with open(args.write, "w") as f:
            json.dump(now, f, indent=1)
        print(f"{len(now)} fingerprints written to {args.write}")
        return 0
    with open(args.compare) as f:
        found = differences(json.load(f), now)
    print("\n".join(found) if found else f"bit-identical: {len(now)} configurations and ranks")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
