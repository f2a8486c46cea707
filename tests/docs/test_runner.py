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
    assert not matches(["max abs 1.192e-07"], ["max abs 1.195e-07"])
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


# Lines an AVX2-only AMD EPYC printed (real) where the pages, made on an AVX-512 Xeon, show others.
MACHINE_PAIRS = [
    (
        "  error            max abs 5.769e-07 at [1, 77, 30], rel L2 6.47e-08",
        "  error            max abs 4.834e-07 at [1, 63, 23], rel L2 6.472e-08",
    ),
    (
        "  vs PyTorch       0.89x (max abs), 0.93x (rel L2) as far from float64",
        "  vs PyTorch       0.75x (max abs), 0.93x (rel L2) as far from float64",
    ),
    (
        "  worst element    0.0273 of what its budget allows",
        "  worst element    0.025 of what its budget allows",
    ),
    (
        "  error            max abs 1.1e-05 at [1], rel L2 1.135e-07",
        "  error            max abs 9.217e-06 at [19], rel L2 1.083e-07",
    ),
    ('      "rel_l2": 0.05183747905255284,', '      "rel_l2": 0.05183747541376177,'),
    ('        "mean": 0.040159892113420935,', '        "mean": 0.040159889138054725,'),
    (
        '          "distance": 2.2212210737393434e-08',
        '          "distance": 2.2794177767515578e-08',
    ),
]


@pytest.mark.parametrize(("shown", "real"), MACHINE_PAIRS)
def test_figures_that_vary_by_machine_match(shown, real):
    assert matches([shown], [real])


@pytest.mark.parametrize(
    ("shown", "real"),
    [
        # a rounding figure more than twice or less than half the page's, or of the other sign
        (
            "  error            max abs 5.769e-07 at [1, 77, 30]",
            "  error            max abs 1.2e-06 at [1, 77, 30]",
        ),
        (
            "  worst element    0.0273 of what its budget allows",
            "  worst element    0.013 of what its budget allows",
        ),
        ('      "max_abs_diff": 0.85,', '      "max_abs_diff": -0.85,'),
        # the text around the figures
        (
            "  error            max abs 5.769e-07 at [1, 77, 30]",
            "  error            max rel 5.769e-07 at [1, 77, 30]",
        ),
        ("PASS out           float32 [8, 128, 64]", "FAIL out           float32 [8, 128, 64]"),
        # counts, shapes and positions outside a rounding figure's row
        (
            "  mismatched       0 of 65,536 (0%), in 0 of 1,024 rows",
            "  mismatched       1 of 65,536 (0%), in 0 of 1,024 rows",
        ),
        ("PASS out           float32 [8, 128, 64]", "PASS out           float32 [8, 128, 65]"),
        ('          "index": [2, 2, 9],', '          "index": [2, 2, 8],'),
        # any other figure beyond one unit of its last digit, or 1e-5 of its value
        ("  x   min=-0.2332  max=0.2295  std=0.1096", "  x   min=-0.2332  max=0.2295  std=0.1098"),
        ('        "mean": 0.040159892113420935,', '        "mean": 0.0402,'),
        (
            "  always allowed   rtol 1.3e-06, atol 1e-05, 2 ulps",
            "  always allowed   rtol 1.3e-06, atol 1e-05, 3 ulps",
        ),
    ],
)
def test_a_figure_beyond_what_varies_by_machine_differs(shown, real):
    assert not matches([shown], [real])


def test_a_last_digit_of_any_figure_may_differ():
    assert matches(
        ["  x   min=-0.2332  max=0.2295  std=0.1096"], ["  x   min=-0.2333  max=0.2295  std=0.1096"]
    )
