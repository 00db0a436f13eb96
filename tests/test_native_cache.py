"""The compiled loops' cache runs only what the package built: loading a shared library runs its
constructors, so a library planted at the expected name, changed after its build, or in a folder
others may write is never loaded."""
import os
import re
import shutil
import subprocess
import warnings

import pytest

from onebitlamb.compression import native

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc here to build the libraries")

# a library whose constructor leaves a marker: what a planted one could do instead
PLANTED_SOURCE = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("ran", f); fclose(f); }
}
"""


def _library():
    from onebitlamb._cbuild import CLibrary

    return CLibrary(native.LIBRARY.source, native.LIBRARY.declare)  # a fresh one: the module's stays loaded


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.delenv("ONEBITLAMB_NATIVE", raising=False)
    monkeypatch.delenv("CC", raising=False)
    folder = tmp_path / "cache"
    monkeypatch.setenv("ONEBITLAMB_CACHE", str(folder))
    return folder


def _expected_name(tmp_path, monkeypatch) -> str:
    """The name the package builds its library under, read off a build in a folder of its own."""
    monkeypatch.setenv("ONEBITLAMB_CACHE", str(tmp_path / "reference"))
    library = _library()
    assert library.load() is not None, library.unavailable_reason
    (built,) = (tmp_path / "reference").glob("onebitlamb_*.so")
    return built.name


def _load_recording(library):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        return library.load(), caught


def _plant(folder, name, marker) -> None:
    folder.mkdir(mode=0o700, exist_ok=True)
    source = folder.parent / "planted.c"
    source.write_text(PLANTED_SOURCE % marker)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / name), str(source)], check=True, timeout=60)


def test_a_library_planted_at_the_expected_name_is_never_loaded(tmp_path, monkeypatch, cache):
    name = _expected_name(tmp_path, monkeypatch)
    monkeypatch.setenv("ONEBITLAMB_CACHE", str(cache))
    marker = tmp_path / "constructor-ran"
    _plant(cache, name, marker)
    lib, caught = _load_recording(_library())
    assert not marker.exists(), "the planted library's constructor ran"
    assert any(re.search("not loading .*no record of its build", str(w.message)) for w in caught), caught
    assert lib is not None and hasattr(lib, "obl_sign_pack_update")  # built again, in its place
    assert (cache / (name + ".sha256")).exists()


def test_a_library_changed_after_its_build_is_built_again(cache):
    assert _library().load() is not None
    (built,) = cache.glob("onebitlamb_*.so")
    changed = built.with_name("changed")
    changed.write_bytes(built.read_bytes() + b"\0")
    os.replace(changed, built)  # a new file (the loaded one stays mapped); its record no longer matches
    lib, caught = _load_recording(_library())
    assert lib is not None
    assert any(re.search("not loading .*not the ones recorded", str(w.message)) for w in caught), caught
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebuilt library matches its record: loaded without a word
        assert _library().load() is not None


def test_a_cache_folder_others_may_write_is_not_used(tmp_path, monkeypatch, cache):
    name = _expected_name(tmp_path, monkeypatch)
    monkeypatch.setenv("ONEBITLAMB_CACHE", str(cache))
    marker = tmp_path / "constructor-ran"
    _plant(cache, name, marker)
    os.chmod(cache, 0o777)
    library = _library()
    lib, caught = _load_recording(library)
    assert not marker.exists(), "the library in a folder anyone may write was loaded"
    assert lib is None and "writable by others" in library.unavailable_reason
    assert any(re.search("writable by others .*chmod go-w", str(w.message)) for w in caught), caught
    assert not list(cache.glob("*.sha256"))
    # a new folder is private, and so is what is built in it
    monkeypatch.setenv("ONEBITLAMB_CACHE", str(tmp_path / "new"))
    assert _library().load() is not None
    assert os.stat(tmp_path / "new").st_mode & 0o777 == 0o700
    for built in (tmp_path / "new").iterdir():
        assert os.stat(built).st_mode & 0o077 == 0, built
