"""The op: masked layer normalization on tensors, and nothing else.

This package knows torch and the arithmetic: the public function and its argument checks
(:mod:`.api`, :mod:`.checks`), the raw-op blocked kernels (:mod:`.blocked`), the autograd and
torch.library registration (:mod:`.autograd`), the purely functional composite that torch.func
transforms see through (:mod:`.functional`), the plain float64 reference (:mod:`.reference`),
the worker threads the kernels run on (:mod:`.threads`), the ``nn.Module`` (:mod:`.module`),
and the catalogue of known wrong formulas that verify and grade both diagnose with
(:mod:`.mistakes`).

It must not import anything else of maskln_cli (no files, comparison, screen or command line):
tensors in, tensors out.
"""

from maskln_cli.op.api import masked_layer_normalization
from maskln_cli.op.module import MaskedLayerNorm

__all__ = ["MaskedLayerNorm", "masked_layer_normalization"]
