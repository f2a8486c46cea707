"""The runner of the documentation's examples compares what it should, and can fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.runner import (
    ExampleFailed,
    blocks_of,
    commands_of,
    matches,
    regenerated,
    run_page,
)

PAGE = """# A page

```python title="hello.py"
print("hello from a file")
```

```console
$ python hello.py
hello from a file
$ printf 'one\\ntwo\\nthree\\n' && \\
    echo four
one
...  (the middle)
four
```

```pycon
>>> 6 * 7
42
```
"""


def test_a_page_whose_examples_print_what_it_shows_passes(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    assert run_page(page, tmp_path / "run") == 3


@pytest.mark.parametrize(
    ("shown", "wrong"),
    [("hello from a file", "hello from a fil"), ("42", "41")],
)
def test_a_page_whose_output_differs_fails(tmp_path: Path, shown: str, wrong: str):
    page = tmp_path / "page.md"
    page.write_text(PAGE.replace(f"\n{shown}\n", f"\n{wrong}\n", 1))
    with pytest.raises(ExampleFailed):
        run_page(page, tmp_path / "run")


def test_update_rewrites_the_shown_output_and_keeps_the_elision(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(PAGE.replace("hello from a file\n$", "stale\n$").replace("one\n...", "1\n..."))
    run_page(page, tmp_path / "run", update=True)
    assert page.read_text() == PAGE


def test_commands_go_on_after_a_backslash():
    (block,) = blocks_of("```console\n$ a \\\n  b\nout\n$ c\n```\n")
    first, second = commands_of(block)
    assert (first.command, first.shown) == ("a \\\n  b", ["out"])
    assert (second.command, second.shown) == ("c", [])


def test_timings_are_normalized_and_nothing_else():
    assert matches(["  PASS  values   0.19 s"], ["  PASS  values   1.07 s"])
    assert matches(['"seconds": 0.265,'], ['"seconds": 0.3,'])
    assert not matches(["max abs 1.192e-07"], ["max abs 1.193e-07"])
    assert not matches(["a", "b"], ["a"])


def test_an_ellipsis_stands_for_any_lines_in_order():
    assert matches(["a", "...", "d"], ["a", "b", "c", "d"])
    assert matches(["a", "...", "d"], ["a", "d"])
    assert matches(["a", "...", "c", "...", "e"], ["a", "b", "c", "d", "e"])
    assert not matches(["a", "...", "d"], ["a", "b", "c"])
    assert not matches(["a", "...", "c", "...", "e"], ["a", "b", "d", "e"])


def test_regenerated_keeps_as_many_lines_around_the_ellipsis():
    shown = ["h1", "h2", "...  (the rest)", "t1"]
    assert regenerated(shown, ["H1", "H2", "x", "y", "T1"]) == ["H1", "H2", "...  (the rest)", "T1"]
    assert regenerated(shown, ["H1", "T1"]) == ["H1", "T1"]


PRINTING = """```python
print("version 2.13.0")
print("done")
```

```text
version ...
done
```
"""


def test_a_text_block_after_a_python_block_is_what_it_prints(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(PRINTING)
    assert run_page(page, tmp_path / "run") == 1
    page.write_text(PRINTING.replace("done\n```\n", "finished\n```\n"))
    with pytest.raises(ExampleFailed):
        run_page(page, tmp_path / "run")
    run_page(page, tmp_path / "run", update=True)
    assert page.read_text() == PRINTING  # "version ..." still matches: kept


def test_an_ellipsis_inside_a_line_stands_for_any_text():
    assert matches(["maskln_version   ..."], ["maskln_version   0.1.0"])
    assert not matches(["maskln_version   ..."], ["torch_version    2.13.0"])
    assert not matches(["a ... z"], ["a b", "z"])  # within one line only
