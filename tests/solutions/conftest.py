"""The classes' folders hold students' files, graded by path (tests/grading): not test modules.
Collected for doctests they would clash by name (each class has its own ``_expected.py``)."""

collect_ignore_glob = ["class_round_*", "class_rms"]
