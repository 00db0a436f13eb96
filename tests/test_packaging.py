"""What a user gets from `pip install`: the built wheel holds the package alone (with its license),
its dependency ranges admit the pinned versions the suite runs with, and the bare install's
`onebitlamb` command names the extra it lacks. Offline: nothing is downloaded."""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from onebitlamb import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what is not the package: never copied into the build (a build writes build/ and *.egg-info there)
NOT_SOURCE = (".git", ".venv", "runs", "out", "build", "dist", "__pycache__", ".pytest_cache", "*.egg-info")


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _pins() -> dict:
    pins = {}
    with open(os.path.join(ROOT, "requirements-dev.txt")) as f:
        for line in f:
            name, _, version = line.strip().partition("==")
            if version:
                pins[_normal(name)] = version
    return pins


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(project: dict) -> list:
    return project["dependencies"] + [r for reqs in project["optional-dependencies"].values() for r in reqs]


def test_every_dependency_has_a_tested_upper_bound():
    """Each range has an upper bound, the minor release after the version requirements-dev.txt pins
    (the one the suite runs with), and admits that version: a bound below the tested release, above
    the next minor one, or none at all, fails here."""
    from packaging.requirements import Requirement

    project, pins = _pyproject()["project"], _pins()
    for text in _requirements(project):
        req = Requirement(text)
        assert any(s.operator in ("<", "<=") for s in req.specifier), f"{text}: no upper bound"
        pinned = pins.get(_normal(req.name))
        assert pinned is not None, f"{req.name} is not pinned in requirements-dev.txt, so its range is untested"
        assert req.specifier.contains(pinned), f"{text} excludes the tested {req.name}=={pinned}"
        # no further than the next minor release: a newer one is untested (triton's admitted 3.9)
        major, minor = pinned.split(".")[:2]
        bounds = [s.version for s in req.specifier if s.operator == "<"]
        assert bounds == [f"{major}.{int(minor) + 1}"], f"{text}: the tested release is {pinned}"


def test_the_command_checks_the_packages_its_extra_installs():
    from packaging.requirements import Requirement

    extras = _pyproject()["project"]["optional-dependencies"]
    for extra, modules in cli.EXTRA_MODULES.items():
        assert sorted(modules) == sorted(Requirement(r).name for r in extras[extra])
    assert set(cli.EXTRAS) <= set(cli.COMMANDS)


def _site_packages_without(tmp_path, left_out):
    """This environment's packages as links in a folder, minus ``left_out`` and the editable
    onebitlamb (its .pth and finder), for PYTHONPATH: torch and numpy without re-installing them."""
    farm = tmp_path / "site"
    farm.mkdir(parents=True)
    site = sysconfig.get_paths()["purelib"]
    for name in os.listdir(site):
        top = _normal(re.split(r"[-.]", name, 1)[0]) if not name.startswith("__") else name
        if (name.endswith(".pth") or name.startswith("__editable__") or top in left_out
                or top in ("onebitlamb", "mpl-toolkits", "pylab")):
            continue
        os.symlink(os.path.join(site, name), farm / name)
    return farm


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel, built once from a copy of the source tree (a build writes build/ and *.egg-info
    where it runs)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*NOT_SOURCE), symlinks=True)
    dist = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "--quiet", "-w", str(dist), str(src)], check=True, capture_output=True, timeout=90)
    (built,) = dist.glob("onebitlamb-*.whl")
    return built


@pytest.mark.timeout(240)
def test_the_wheel_holds_the_package_and_its_bare_command_names_the_extra(tmp_path, wheel):
    """Install the wheel with no dependencies into a new environment that sees torch and numpy but
    not the example extra's packages, and run its `onebitlamb pretrain`: it stops at once with a
    `pip install` of the extra's packages that works wherever the wheel came from; given those
    packages, the same command trains. Its `python -m onebitlamb.docs` prints a section of the
    documentation, which the wheel carries."""
    import pip

    if tuple(int(x) for x in pip.__version__.split(".")[:2]) < (22, 3):
        pytest.skip(f"pip {pip.__version__} cannot install into another environment (--python: pip 22.3+)")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        outside = [n for n in names if n.split("/")[0] not in ("onebitlamb", dist_info)]
        assert not outside, f"the wheel holds more than the package: {outside}"
        assert f"{dist_info}/licenses/LICENSE" in names
        assert "Apache License" in z.read(f"{dist_info}/licenses/LICENSE").decode()
        metadata = z.read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert re.search(r"^Requires-Dist: torch<2\.\d+,>=2\.3$|^Requires-Dist: torch>=2\.3,<2\.\d+$", metadata, re.M)

    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=60)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "--quiet", str(wheel)], check=True, capture_output=True, timeout=60)
    from packaging.requirements import Requirement

    example = {_normal(Requirement(r).name) for r in _pyproject()["project"]["optional-dependencies"]["example"]}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(_site_packages_without(tmp_path, example))
    # one interpreter for both (each start imports torch): it prints where onebitlamb came from, then
    # fails on the extra's package
    where = subprocess.run([str(python), "-c", "import onebitlamb; print(onebitlamb.__file__); import tokenizers"],
                           env=env, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert "No module named 'tokenizers'" in where.stderr, where  # the new environment lacks the extra...
    assert where.stdout.startswith(str(env_dir)), where  # ...and runs the installed wheel, not this tree
    # the documentation a message points at, from the wheel alone (no checkout beside it)
    shown = subprocess.run([str(python), "-m", "onebitlamb.docs", "algorithm", "A freeze that comes too early"],
                           env=env, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert shown.returncode == 0 and shown.stdout.startswith("### A freeze that comes too early"), shown

    run = subprocess.run([str(env_dir / "bin" / "onebitlamb"), "pretrain", "--preset", "tiny", "--out",
                          str(tmp_path / "run")], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert run.returncode == 2, run
    # the hint installs the extra's packages, as the wheel's metadata states them: a command that works
    # wherever the wheel came from (nothing named onebitlamb is on a package index)
    hint = run.stderr.split("install them with: ", 1)[1].strip()
    assert hint.startswith("pip install '") and "onebitlamb" not in hint, hint
    named = {_normal(r.name): r.specifier for r in map(Requirement, re.findall(r"'([^']+)'", hint))}
    wanted = {_normal(r.name): r.specifier for r in map(Requirement, _pyproject()["project"]["optional-dependencies"]["example"])}
    assert named == wanted, hint
    assert "preparing corpus" not in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "run").exists()  # nothing started

    # with the extra's packages there (what the hint's pip install puts there), the installed
    # wheel's command runs the main job: a short tiny run on a small corpus
    import email

    env["PYTHONPATH"] = str(_site_packages_without(tmp_path / "with-extra", set()))
    run = subprocess.run([str(env_dir / "bin" / "onebitlamb"), "pretrain", "--preset", "tiny", "--workers", "1",
                          "--steps", "2", "--eval-every", "2", "--ckpt-every", "2", "--no-progress",
                          "--corpus", os.path.dirname(email.__file__), "--out", str(tmp_path / "run")],
                         env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.json").exists()


def test_the_package_list_names_every_package_of_the_source_tree():
    """pyproject lists the packages (the documentation is one, mapped from docs/): a new package
    left off the list would be missing from the wheel."""
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {os.path.relpath(d, ROOT).replace(os.sep, ".")
             for d, _, fs in os.walk(os.path.join(ROOT, "onebitlamb")) if "__init__.py" in fs}
    assert listed == found | {"onebitlamb._docs"}
    assert _pyproject()["tool"]["setuptools"]["package-dir"] == {"onebitlamb._docs": "docs"}


DOCS_PAGE = re.compile(r"docs/([\w-]+)\.md")
# a file name a reader of the wheel cannot follow: a page of docs/ named as a path, or a root file
UNFOLLOWABLE = re.compile(r"docs/[\w-]+\.md|BENCHMARKS\.md|README\.md")


def _documentation_nodes(tree) -> set:
    """The ids of the nodes of docstrings, of strings assigned to ``*_DOC`` names and to
    ``__doc__``: documentation, read in the source or through help(), not printed by a message."""
    import ast

    roots = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, (ast.Constant, ast.JoinedStr)):
                roots.append(first.value)
        elif isinstance(node, ast.Assign):
            names = [t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else ""
                     for t in node.targets]
            if any(n.endswith("_DOC") or n == "__doc__" for n in names):
                roots.append(node.value)
    return {id(n) for root in roots for n in ast.walk(root)}


@pytest.mark.timeout(240)
def test_every_docs_pointer_in_the_package_resolves_in_the_wheel(tmp_path, wheel):
    """The wheel carries docs/*.md; every ``pointer(page, section)`` a message prints names a page
    and a section the wheel's copy has; no message names a file the wheel lacks (a path under
    docs/, BENCHMARKS.md, the README); and every docs/ page the docstrings name is in the wheel."""
    import ast

    from onebitlamb import docs

    with zipfile.ZipFile(wheel) as z:
        shipped = sorted(n for n in z.namelist() if n.startswith("onebitlamb/_docs/"))
        z.extractall(tmp_path, shipped)
    where = tmp_path / "onebitlamb" / "_docs"
    assert docs.pages(where) == sorted(p[:-3] for p in os.listdir(os.path.join(ROOT, "docs")) if p.endswith(".md"))
    pointers, unfollowable, unshipped = 0, [], []
    for folder, _, files in os.walk(os.path.join(ROOT, "onebitlamb")):
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            where_in = os.path.relpath(path, ROOT)
            with open(path) as f:
                tree = ast.parse(f.read())
            documentation = _documentation_nodes(tree)
            for node in ast.walk(tree):
                func = getattr(node, "func", None)
                if isinstance(node, ast.Call) and getattr(func, "id", getattr(func, "attr", None)) == "pointer":
                    args = [a.value for a in node.args]
                    assert all(isinstance(a, str) for a in args), f"{where_in}:{node.lineno}: pointer's arguments"
                    docs.read(*args, where=where)  # ValueError naming the page or section if it is missing
                    pointers += 1
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if id(node) in documentation:
                        unshipped += [f"{where_in}:{node.lineno}: docs/{page}.md" for page in
                                      DOCS_PAGE.findall(node.value) if not (where / f"{page}.md").exists()]
                    elif UNFOLLOWABLE.search(node.value):
                        unfollowable.append(f"{where_in}:{node.lineno}: {node.value!r}")
    assert not unfollowable, "messages naming a file the wheel lacks (use onebitlamb.docs.pointer):\n" + \
        "\n".join(unfollowable)
    assert not unshipped, unshipped
    assert pointers >= 7
