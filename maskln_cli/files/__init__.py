"""Files: safetensors in and out, checkpoints, masks, and the inputs of one op call.

This package knows the on-disk world: memory-mapped reading and stdin (:mod:`.tensorfile`),
atomic streaming writing (:mod:`.output`), transformers checkpoints, shards and config eps
(:mod:`.checkpoint`), key names (:mod:`.keynames`), memory and disk checks (:mod:`.resources`),
row masks (:mod:`.masks`), and a problem resolved from files, with its outputs computed chunk
by chunk (:mod:`.problem`).

It returns data and raises MasklnError naming the file, key or option; it never renders. It may
import the op (to check eps and compute a problem's chunks) and the error types; never
comparison, verify, grading, jobs or the command line.
"""
