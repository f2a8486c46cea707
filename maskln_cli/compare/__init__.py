"""Comparison: two tensors, or two files, element by element into plain-data figures.

This package knows tolerances and how to compare in bounded memory: chunks of rows
(:mod:`.comparison`) add to running figures (:mod:`.figures`), in blocks measured on worker
threads (:mod:`.blocks`, their elements judged against allowances by :mod:`.judging`) or whole
in float64 (:mod:`.general`); exact integers (:mod:`.integers`), valid rows only
(:mod:`.rows`), files key by key (:mod:`.files`), and the figures as plain data (:mod:`.data`).

It may import the files package, the op's threads and the error types; never verify, grading,
jobs or the command line, and it never renders.
"""
