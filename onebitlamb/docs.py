"""The user documentation, wherever the package is installed: ``python -m onebitlamb.docs``.

    python -m onebitlamb.docs                                          # the pages
    python -m onebitlamb.docs algorithm                                # one page
    python -m onebitlamb.docs algorithm "A freeze that comes too early"  # one section of it

The pages are the repository's ``docs/*.md``: the wheel ships them as package data
(``onebitlamb/_docs``, mapped from ``docs/`` in pyproject.toml), and a checkout reads ``docs/``
itself. A message that sends its reader to the documentation prints ``pointer(page, section)``,
this command, so that it can be followed with only the wheel installed (tests/test_packaging.py
checks every pointer in the package against the built wheel).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import List, Optional, Sequence

_HERE = Path(__file__).resolve().parent
# the wheel's copy first, then a checkout's docs/ (an editable install or PYTHONPATH)
FOLDERS = (_HERE / "_docs", _HERE.parent / "docs")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")


def folder() -> Path:
    """Where the pages are: FileNotFoundError if neither the wheel's copy nor a checkout's is."""
    for candidate in FOLDERS:
        if candidate.is_dir() and any(candidate.glob("*.md")):
            return candidate
    raise FileNotFoundError(f"the documentation is in none of {', '.join(map(str, FOLDERS))}")


def pages(where: Optional[Path] = None) -> List[str]:
    """The pages' names, without ``.md``."""
    return sorted(p.stem for p in (where or folder()).glob("*.md"))


def pointer(page: str, section: Optional[str] = None) -> str:
    """What a message prints to send its reader to ``page`` (``"algorithm"``) and, if given, the
    section whose heading is or begins with ``section``: a command that works wherever the package
    is installed."""
    return f"python -m onebitlamb.docs {page}" + (f' "{section}"' if section else "")


def _plain(heading: str) -> str:
    return heading.replace("`", "").strip().lower()


def _headings(lines: List[str]) -> List[tuple]:
    """``(line index, level, text)`` of each heading, outside fenced code (whose ``#`` are comments)."""
    found, fenced = [], False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            m = _HEADING.match(line)
            if m:
                found.append((i, len(m.group(1)), m.group(2)))
    return found


def read(page: str, section: Optional[str] = None, where: Optional[Path] = None) -> str:
    """The text of ``page`` (``algorithm``, ``algorithm.md`` or ``docs/algorithm.md``), or of its
    section whose heading is ``section`` or begins with it (case and backticks aside), up to the
    next heading of the same or a higher level. ValueError naming the page or section and what
    there is."""
    where = where or folder()
    name = Path(page).name
    name = name[:-3] if name.endswith(".md") else name
    path = where / f"{name}.md"
    if not path.is_file():
        raise ValueError(f"no page {page!r}; the pages: {', '.join(pages(where))}")
    text = path.read_text(encoding="utf-8")
    if not section:
        return text
    lines = text.splitlines(keepends=True)
    headings = _headings(lines)
    wanted = _plain(section)
    match = (next((h for h in headings if _plain(h[2]) == wanted), None)
             or next((h for h in headings if _plain(h[2]).startswith(wanted)), None))
    if match is None:
        raise ValueError(f"no section {section!r} in {name}; its sections: "
                         + "; ".join(h[2] for h in headings))
    start, level, _ = match
    end = next((i for i, lvl, _ in headings if i > start and lvl <= level), len(lines))
    return "".join(lines[start:end])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onebitlamb.docs", description=__doc__.splitlines()[0])
    parser.add_argument("page", nargs="?", help="a page (without it: the list of pages)")
    parser.add_argument("section", nargs="*", help="a section's heading, or its beginning (quoted or not)")
    args = parser.parse_args(argv)
    if args.page is None:
        where = folder()
        print(f"The pages ({where}):")
        for name in pages(where):
            first = (where / f"{name}.md").read_text(encoding="utf-8").splitlines()[0].lstrip("# ")
            print(f"  {name:14s} {first}")
        return 0
    try:
        sys.stdout.write(read(args.page, " ".join(args.section) or None))
    except ValueError as exc:
        print(f"python -m onebitlamb.docs: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
