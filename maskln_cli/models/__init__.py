"""Models: maskln on a whole torch model, every layer norm of it at once.

This package knows ``torch.nn`` modules and their hooks: the kinds of norm it finds in a model
(``nn.LayerNorm``, ``nn.RMSNorm``, the RMSNorms of LLaMA-family models, maskln's own: the
table of :mod:`.kinds`), recording each call of every one of them in a model run into a dump
file of its own (:mod:`.capture`, the files in :mod:`.dumps`), swapping a model's norms for
``MaskedLayerNorm`` and ``MaskedRMSNorm`` fed the batch's mask (:mod:`.swap`), which norms a
call takes (:mod:`.select`) and how a model's ``[batch, seq]`` mask meets a layer norm's rows
(:mod:`.masks`).

It may import the op (the module, the mask rule) and files (dumps are written atomically
with :mod:`maskln_cli.files.output`), and the error and version modules; never comparison,
verify, grading, jobs or the command line. Only the facade (``maskln_cli.capture``,
``maskln_cli.swap_layer_norms``) and the layers above use it: a model's dumps are data that
``maskln verify`` reads as files, not through this package.
"""

from maskln_cli.models.capture import Capture, capture
from maskln_cli.models.swap import SwappedLayerNorm, SwappedRMSNorm, swap_layer_norms

__all__ = ["Capture", "SwappedLayerNorm", "SwappedRMSNorm", "capture", "swap_layer_norms"]
