"""The shared results file: each benchmark rewrites its own section and nobody else's."""
from benchmarks.report import HEADER, table_row, write_section


def test_a_new_file_gets_the_header_and_the_section(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    write_section("kernels", "## Kernels\n\nfigures\n", path)
    assert path.read_text() == HEADER + "\n<!-- begin kernels -->\n## Kernels\n\nfigures\n<!-- end kernels -->\n"


def test_rewriting_one_section_leaves_the_others_as_they_were(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    write_section("a", "first a", path)
    write_section("b", "first b", path)
    write_section("a", "second a\nover two lines", path)
    text = path.read_text()
    assert "first a" not in text
    assert "<!-- begin a -->\nsecond a\nover two lines\n<!-- end a -->" in text
    assert "<!-- begin b -->\nfirst b\n<!-- end b -->" in text
    assert text.index("begin a") < text.index("begin b")  # in place, not moved to the end
    assert text.count("<!-- begin a -->") == 1


def test_a_section_whose_name_contains_another_is_its_own(tmp_path):
    # "freeze trade-off" and "freeze trade-off, median level" are both sections of BENCHMARKS.md
    path = tmp_path / "BENCHMARKS.md"
    write_section("freeze trade-off", "short", path)
    write_section("freeze trade-off, median level", "long", path)
    write_section("freeze trade-off", "short again", path)
    text = path.read_text()
    assert "<!-- begin freeze trade-off -->\nshort again\n<!-- end freeze trade-off -->" in text
    assert "<!-- begin freeze trade-off, median level -->\nlong\n" in text


def test_table_row_writes_any_cell_as_text():
    assert table_row(["preset", 1234, None, "4.598"]) == "| preset | 1234 | None | 4.598 |"
