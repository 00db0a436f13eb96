"""The documentation stays a user guide: its sizes, one section per benchmark, commands that exist,
and no lab results in the package's code (they belong to the docs)."""
import ast
import os
import re

from onebitlamb.cli import COMMANDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def test_benchmarks_md_has_one_section_per_benchmark():
    headings = re.findall(r"^## (.+)$", _read("BENCHMARKS.md"), flags=re.MULTILINE)
    assert headings and len(headings) == len(set(headings)), headings


def test_every_command_the_readme_names_exists():
    readme = _read("README.md")
    modules = set(re.findall(r"python -m ([\w.]+)", readme))
    assert modules, "the README names no command"
    for module in modules:
        if module == "onebitlamb":
            continue
        path = os.path.join(ROOT, *module.split(".")) + ".py"
        assert os.path.exists(path), module
    for command in set(re.findall(r"onebitlamb (\w+) +--", readme)):
        assert command in COMMANDS, command


def test_the_readmes_install_route_names_real_extras_quoted_and_no_package_index():
    """Nothing named onebitlamb is on an index: the README installs from a checkout or a wheel, each
    extra one of pyproject's, quoted (zsh expands unquoted brackets)."""
    import pytest
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = set(tomllib.load(f)["project"]["optional-dependencies"])
    readme = _read("README.md")
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"'(?:\.|dist/onebitlamb-[\w.-]+\.whl)\[(\w+)\]'", install)
    assert set(named) == {"example", "frameworks", "gpu", "tensorboard"} and set(named) <= extras, named
    assert not re.search(r"pip install (?!')[^\n]*\[", install), "an unquoted extra"
    everywhere = readme + "".join(_read(os.path.join("docs", p)) for p in os.listdir(os.path.join(ROOT, "docs"))
                                  if p.endswith(".md"))
    assert "pip install onebitlamb" not in everywhere and "pip install 'onebitlamb[" not in everywhere


# "issue" or "issues", any case, then a number: after a space, a "#" or an underscore (in a test's name)
TRACKER_ENTRY = re.compile(r"(?i)(?<![a-z])issues?[ _#-]*\d+")


def _python_files(folder: str) -> list:
    return [os.path.join(d, f)[len(ROOT) + 1:] for d, _, fs in os.walk(os.path.join(ROOT, folder))
            for f in fs if f.endswith(".py")]


def _tracker_entries(paths) -> list:
    return [f"{path}:{n}: {line.strip()}" for path in paths for n, line in enumerate(_read(path).splitlines(), 1)
            if TRACKER_ENTRY.search(line)]


def test_user_pages_and_messages_name_no_tracker_entry():
    """Users cannot see the project's tracker: the README, the docs (but the lab notes) and the
    package's code and messages never cite an issue by number."""
    pages = ["README.md"] + [os.path.join("docs", p) for p in os.listdir(os.path.join(ROOT, "docs")) if p.endswith(".md")]
    cited = _tracker_entries(pages + _python_files("onebitlamb"))
    assert not cited, "\n".join(cited)


def test_benchmark_results_and_tests_name_no_tracker_entry():
    """Nor do BENCHMARKS.md, the benchmark scripts whose text writes it, and the tests: their names,
    strings, messages and comments say what is checked, not which tracker entry asked for it."""
    cited = _tracker_entries(["BENCHMARKS.md", *_python_files("benchmarks"), *_python_files("tests")])
    assert not cited, "\n".join(cited)


def test_the_package_code_carries_no_lab_results():
    """Seed-by-seed findings (``demo seed 1238``, ``b1024 ...``) go to docs/, not to comments."""
    offenders = []
    for folder, _, files in os.walk(os.path.join(ROOT, "onebitlamb")):
        for name in files:
            if name.endswith((".py", ".c")):
                path = os.path.join(folder, name)
                with open(path) as f:
                    for number, line in enumerate(f, start=1):
                        if re.search(r"seeds? 1\d{3}|\bb(512|1024|4096) seed", line):
                            offenders.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_package_holds_no_benchmark_harness():
    """The installed package is what a user of the optimizer runs. The emulated hosts (network
    namespaces, tbf) live in benchmarks/, which is not installed: no package module drives ``ip
    netns`` or imports ``benchmarks`` (it would fail wherever the package is installed)."""
    offenders = []
    for folder, _, files in os.walk(os.path.join(ROOT, "onebitlamb")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                text = f.read()
            where = os.path.relpath(path, ROOT)
            if re.search(r"\bnetns\b", text):
                offenders.append(f"{where}: network namespaces")
            for node in ast.walk(ast.parse(text)):
                modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                           else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(m.split(".")[0] == "benchmarks" for m in modules):
                    offenders.append(f"{where}:{node.lineno}: imports {', '.join(modules)}")
    assert not offenders, "\n".join(offenders)


def test_the_package_reads_only_the_documented_environment_variables():
    """docs/contributing.md: no environment variable changes the numbers; the ones read are listed
    there with what they do."""
    documented = {"ONEBITLAMB_NATIVE", "ONEBITLAMB_CACHE", "CC", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                  "LOCAL_WORLD_SIZE", "MASTER_ADDR", "TRITON_INTERPRET", "OMP_WAIT_POLICY"}
    rules = _read("docs/contributing.md")
    assert all(f"`{name}`" in rules for name in documented)
    read = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "onebitlamb")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    text = f.read()
                read |= set(re.findall(r"""environ(?:\.get\(|\[)\s*["']([A-Z_]+)["']""", text))
                read |= set(re.findall(r"""getenv\(\s*["']([A-Z_]+)["']""", text))
                # a name held in a constant (hierarchy.LOCAL_WORLD_SIZE_ENV)
                read |= set(re.findall(r"""_ENV\s*=\s*["']([A-Z_]+)["']""", text))
    assert read and read <= documented, read - documented


def test_the_comm_modules_import_one_way():
    """The flat collective knows nothing of node groups; the hierarchy builds on it; only
    comm/groups.py, above both, tells the two kinds of group apart (no import cycle)."""
    imports = {}
    for name in ("collectives", "hierarchy", "groups", "stats", "launch", "costmodel"):
        text = _read(f"onebitlamb/comm/{name}.py")
        imports[name] = set(re.findall(r"onebitlamb\.comm(?:\.|\s+import\s+(?:\(|)\s*)(\w+)", text))
    assert not imports["collectives"] & {"hierarchy", "groups"}, imports["collectives"]
    assert "NodeGroups" not in _read("onebitlamb/comm/collectives.py")
    assert "groups" not in imports["hierarchy"] and "collectives" in imports["hierarchy"]
    assert {"collectives", "hierarchy"} <= imports["groups"]


def _anchors(path: str) -> set:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, each space
    a hyphen (so "Network: LAMB vs 1-bit LAMB / 1-bit Adam" gives "network-lamb-vs-1-bit-lamb--1-bit-adam")."""
    headings = re.findall(r"^#+ (.+)$", _read(path), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_readme_results_link_each_figure_and_leave_the_seeds_to_the_lab_notes():
    """The README's results say what a user gets with the defaults, each row linking the section
    that measured it (a link whose heading exists); seed-by-seed tables and machine-to-machine
    notes belong to docs/lab/."""
    section = _read("README.md").split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    tables: list = []
    for line, before in zip(section.splitlines(), [""] + section.splitlines()):
        if line.startswith("|") and not line.startswith("|---"):
            if not before.startswith("|"):
                tables.append([])
            tables[-1].append(line)
    assert tables, "the README has no results table"
    for table in tables:  # one number a cell, not a paragraph of seed statistics
        for row in table:
            for cell in row.strip("|").split("|"):
                words = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", cell).split()
                assert len(words) <= 25, f"a results cell of {len(words)} words: {cell.strip()}"
    # the first table (time to LAMB's loss) is one section's: the paragraph above links it
    assert "](BENCHMARKS.md#time-to-reach-lambs-loss-on-emulated-links)" in section.split("\n|", 1)[0]
    rows = [row for table in tables[1:] for row in table[1:]]
    assert rows, "the README has no table of the other measurements"
    for row in rows:
        links = re.findall(r"\]\(([^)#]+)#([^)]+)\)", row.rsplit("|", 2)[1])
        assert links, f"no link to the numbers: {row}"
        for path, anchor in links:
            assert path == "BENCHMARKS.md" or path.startswith("docs/"), path
            assert anchor in _anchors(path), f"{path} has no heading #{anchor}"
    assert not re.search(r"\b\d+ seeds\b|another machine|earlier run", section), "lab notes belong to docs/lab/"
