"""Comparison: two tensors, or two files, element by element into plain-data figures.

This package knows tolerances and how to compare in bounded memory: chunks and blocks of rows
(:mod:`.comparison`), exact integers (:mod:`.integers`), valid rows only (:mod:`.rows`), files
key by key (:mod:`.files`), and the figures as plain data (:mod:`.data`).

It may import the files package, the op's threads and the error types; never verify, grading,
jobs or the command line, and it never renders.
"""
