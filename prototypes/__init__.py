"""Prototypes not yet wired into maskln_cli: each folder says what it tries and how it is run.

Nothing in maskln_cli imports this package, and it imports nothing of maskln_cli's internals.
"""
