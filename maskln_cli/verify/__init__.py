"""Verify: is a kernel's output right? The error budget, the job, and what kind of wrong.

This package knows how far from the float64 truth a correct kernel may be (:mod:`.budget`) and
how to check a RESULT file against the recomputed reference chunk by chunk (:mod:`.job`),
naming the likely mistake with the op's catalogue (:mod:`maskln_cli.op.mistakes`). The job's
steps each have a module: the options (:mod:`.options`), what is checked and how
(:mod:`.plan`), the streaming pass (:mod:`.measure`, its blocks :mod:`.blockwork`) with each
element's allowance (:mod:`.allowance`), the systematic-error test (:mod:`.systematic`), and
the words and one explanation of a failure (:mod:`.explain`, its diagnosis :mod:`.diagnose`,
what RESULT itself shows :mod:`.findings`); a folder of dumps is :mod:`.folder`.

It may import the op, files, comparison and the error types; never grading, jobs or the command
line, and it never renders: the report is plain data.
"""
