"""The `onebitlamb` command line: one sub-command per tool, each living next to the code it drives.

Every sub-command module exposes ``add_arguments(parser)`` and ``run(args) -> int``; they are
imported only when chosen, so ``onebitlamb --help`` stays fast and the optimizers never pull in
the example's dependencies.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from typing import List, Optional, Sequence

# name -> (module, one-line help)
COMMANDS = {
    "pretrain": ("onebitlamb.train.pretrain", "pretrain a small BERT with one optimizer"),
    "compare": ("onebitlamb.train.compare", "LAMB, 1-bit LAMB and 1-bit Adam side by side"),
    "estimate": ("onebitlamb.comm.costmodel", "the speed-up over LAMB to expect for a model size, ranks and link rate"),
}

# name -> the extra of pyproject.toml whose packages the sub-command imports (by import name; the
# same as the distribution names there, which tests/test_packaging.py checks)
EXTRAS = {"pretrain": "example", "compare": "example"}
EXTRA_MODULES = {"example": ("transformers", "tokenizers", "matplotlib", "tqdm")}


def install_command(extra: str, missing: Sequence[str]) -> str:
    """A pip command that installs ``extra``'s packages into this environment, whichever way the
    package came (a checkout, a wheel): the extra's requirements as this installation's metadata
    states them; the bare names when it has none (running from a source tree)."""
    from importlib import metadata

    try:
        requires = metadata.requires("onebitlamb") or []
    except metadata.PackageNotFoundError:
        requires = []
    wanted = []
    for line in requires:
        requirement, _, marker = line.partition(";")
        if marker.replace(" ", "").replace("'", '"') == f'extra=="{extra}"':
            wanted.append(requirement.replace(" ", ""))
    return "pip install " + " ".join(f"'{r}'" for r in (wanted or missing))


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="onebitlamb", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        args = parser.parse_args(argv)  # prints help or a clear error
        parser.print_help()
        return 2
    name = argv[0]
    missing = missing_extra(name)
    if missing:  # before anything starts: an install without extras has the optimizers only
        print(f"onebitlamb {name}: error: needs the packages of the '{EXTRAS[name]}' extra (missing: "
              f"{', '.join(missing)}); install them with: {install_command(EXTRAS[name], missing)}",
              file=sys.stderr, flush=True)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    cmd_parser = argparse.ArgumentParser(prog=f"onebitlamb {name}", description=COMMANDS[name][1])
    module.add_arguments(cmd_parser)
    code = int(module.run(cmd_parser.parse_args(argv[1:])) or 0)
    _leave_process_group(code)
    return code


def missing_extra(command: str) -> List[str]:
    """The packages of ``command``'s extra that cannot be imported (looked up, not imported)."""
    extra = EXTRAS.get(command)
    return [m for m in EXTRA_MODULES.get(extra, ()) if importlib.util.find_spec(m) is None]


def _leave_process_group(code: int) -> None:
    """A worker started by torchrun: wait for every rank, tear the group down, and exit at once.

    The results are written by then. What is skipped is the interpreter's own teardown, where a
    gloo worker can abort ("terminate called without an active exception") after a finished run
    and so fail the launch although nothing was lost (pytorch/pytorch#190489). Returns when no
    group is up (the local launcher's workers leave the same way on their own, ``comm/launch.py``)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
