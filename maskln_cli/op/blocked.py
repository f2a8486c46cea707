"""The op's raw-op kernels: the forward and backward passes over blocks of rows, in place.

For each valid row x of C channels (Ba et al., 2016), with a two-pass variance::

    mean  = sum(x) / C
    xc    = x - mean
    shift = sum(xc) / C                              # mean's rounding error, ~0
    rstd  = 1 / sqrt(sum(xc * xc) / C - shift**2 + eps)
    xhat  = (xc - shift) * rstd
    y     = xhat * scale + bias

and y = +0.0 on invalid rows. The backward pass, with wdy = scale * dy::

    dbias  = sum over valid rows of dy
    dscale = sum over valid rows of dy * xhat
    dx     = rstd * (wdy - xhat * c1 - c2),   c1 = mean_C(xhat * wdy),  c2 = mean_C(wdy)

and dx = +0.0 on invalid rows. RMSNorm (``norm=RMS``; bias, mean and dbias None) is the same
without centering, with the gain ``g = scale + offset``::

    rstd = 1 / sqrt(sum(x * x) / C + eps),   xhat = x * rstd,   y = xhat * g
    dx   = rstd * (wg - xhat * c1),   wg = dy * g,   c1 = mean_C(xhat * wg)

An invalid row is never mixed with another: its statistics are
its own and are set to 0 before use; NaN or inf in it, flagged by its non-finite mean, are
zeroed before any other arithmetic; and every sum across rows (dscale, dbias) reads valid rows
only. So whatever invalid rows hold never reaches an output or a gradient.

``shift`` is the corrected two-pass algorithm (Chan, Golub & LeVeque, 1983): on float32 rows
with a large common offset it keeps the error near float32's resolution, where a plain two-pass
(torch's own layer_norm included) loses several digits to the rounded mean. Rows whose squares
overflow are redone scaled by a power of two (see :mod:`maskln_cli.op.functional`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from maskln_cli.op.functional import gradients, ldexp_exact, normalized_rows, row_means
from maskln_cli.op.norms import LAYER, RMS, Norm
from maskln_cli.op.threads import map_blocks

BLOCK_BYTES = 8 << 20
"""Rows are processed in blocks of at most this many bytes of x (an eighth of x, and at least
MIN_BLOCK_BYTES), and at most MAX_BLOCK_ROWS rows.

The blocks run on worker threads, each with torch on one thread (:mod:`maskln_cli.op.threads`),
not one after the other with each op forked over torch's threads: every op on a block was an
OpenMP parallel region, which on a busy machine waits for all threads to be scheduled.
Measured forward / the torch one-liner, 2 threads, loadavg 3 to 7 (interleaved medians, 8
cases of 3 to 64 MiB): ops forked over torch's threads 0.8 to 11.9 times, blocks on workers
0.4 to 1.1 times. On a quiet machine each block costs about 25 torch calls of 5 us, and more
on workers, which hand Python's lock to each other around every call: 3 MiB in 13 blocks of
256 KiB took 8.1 ms on the workers against 2.0 ms as one block in one thread. Hence blocks of
several MiB, and an x under two blocks runs as one block in the calling thread."""
BACKWARD_BLOCK_BYTES = 4 << 20
"""The backward's largest blocks: it makes twice the forward's passes over three block-sized
arrays (x, dy and a workspace of two blocks), and 16 MiB blocks cost it 19-27% more CPU time
on one thread than 4 MiB ones (cache misses). Blocking never changes the bits of y or dx;
dscale and dbias are sums of the blocks' sums, so theirs depend on the block size, which
depends on x's shape and dtype alone (never on the thread count or timing)."""
MIN_BLOCK_BYTES = 4 << 20
"""Smaller blocks cost more in calls than they gain in parallel (see BLOCK_BYTES)."""
MAX_BLOCK_ROWS = 32768
"""Each row has a few float64 statistics: with two blocks in flight, 65,536-row blocks of x in
rows of 16 (32 MiB) took figure 3's peak extra memory to 1.26 times the output, over its 1.25
target; 32,768-row blocks, 1.12."""


def row_blocks(rows: int, block_rows: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` covering ``range(rows)``; no block has a single row unless rows == 1.

    torch splits a reduction over threads when it has a single output, and so rounds a lone
    row differently; with two rows or more per block, every row's result is the same whatever
    the blocking, and chunked results are identical to one whole call.

    Example:
        >>> list(row_blocks(7, 3))
        [(0, 3), (3, 7)]
    """
    block_rows = max(2, block_rows)
    start = 0
    while start < rows:
        stop = min(rows, start + block_rows)
        if rows - stop == 1:
            stop = rows
        yield start, stop
        start = stop


def forward_keeping_xhat(
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    xhat: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]:
    """LayerNorm's :func:`forward` keeping the normalized rows in ``xhat`` (a buffer like x),
    for :func:`backward_in_place` to take instead of making them again (the same bits): returns
    ``(y, mean, rstd, kept)``, ``kept`` False when ``xhat`` does not hold them (a lone row, a
    layout that cannot be viewed as rows, a row redone scaled). Its invalid rows hold anything.

    Example:
        >>> x, valid = torch.tensor([[1.0, 3.0], [2.0, 2.0]]), torch.tensor([True, True])
        >>> xhat = torch.empty_like(x)
        >>> y, mean, rstd, kept = forward_keeping_xhat(x, valid, torch.ones(2), torch.zeros(2),
        ...                                            3.0, xhat)
        >>> kept, torch.equal(y, forward(x, valid, torch.ones(2), torch.zeros(2), 3.0)[0])
        (True, True)
    """
    return _forward(x, valid, scale, bias, eps, xhat=xhat)


def forward(
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    keep_statistics: bool = True,
    norm: Norm = LAYER,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The forward pass without autograd: returns ``(y, mean, rstd)``.

    ``mean`` and ``rstd`` have shape ``[..., 1]`` and are 0 on invalid rows; with
    ``keep_statistics=False`` they are not kept (None), which saves their memory when no
    backward pass will follow; RMSNorm's mean is None. The work happens in place in the output,
    a block of rows at a time, so the only full-size allocation is ``y``. Inputs must already be
    checked (see :func:`check_inputs`).

    Example:
        >>> y, mean, rstd = forward(torch.tensor([[1.0, 3.0]]), torch.tensor([True]),
        ...                         torch.ones(2), torch.zeros(2), 3.0)
        >>> y, mean, rstd
        (tensor([[-0.5000,  0.5000]]), tensor([[2.]]), tensor([[0.5000]]))
    """
    y, mean, rstd, _ = _forward(x, valid, scale, bias, eps, keep_statistics, norm, offset)
    return y, mean, rstd


def _forward(
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    keep_statistics: bool = True,
    norm: Norm = LAYER,
    offset: float = 0.0,
    xhat: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]:
    """:func:`forward`, and with ``xhat`` :func:`forward_keeping_xhat`."""
    with torch.no_grad():
        if x.numel() and x.numel() == x.shape[-1]:  # one row: computed as two, see below
            y_pair, *statistics = forward(
                *_as_pair(x), valid.reshape(1).expand(2), scale, bias, eps, keep_statistics,
                norm, offset,
            )  # fmt: skip
            y = torch.empty_like(x).copy_(y_pair[0].view(x.shape))
            shape = (*x.shape[:-1], 1)
            mean, rstd = (None if s is None else s[:1].view(shape) for s in statistics)
            return y, mean, rstd, False
        y = torch.empty_like(x, memory_format=torch.preserve_format)
        mean = rstd = None
        if keep_statistics:
            rstd = x.new_zeros((*x.shape[:-1], 1))
            mean = torch.zeros_like(rstd) if norm.centered else None
        if y.numel() == 0:
            return y, mean, rstd, False
        x_rows, y_rows = _rows(x), _rows(y)
        xhat_rows = None if xhat is None or not norm.centered else _rows(xhat)
        if x_rows is None or y_rows is None:  # a layout that cannot be viewed as rows
            y_contiguous, mean, rstd = forward(
                x.contiguous(), valid, scale, bias, eps, keep_statistics, norm, offset
            )
            return y.copy_(y_contiguous), mean, rstd, False
        valid_rows = valid.reshape(-1)
        blocks = list(row_blocks(len(x_rows), _block_rows(x, _block_bytes(x, BLOCK_BYTES))))
        invalid_by_block = _invalid_rows_by_block(valid_rows, blocks)
        gain = None if norm.centered else scale + offset

        def block(index: int) -> bool:
            """Whether the block's rows are all normalized in xhat_rows (if given)."""
            start, stop = blocks[index]
            if rstd is None:  # statistics needed only inside the block
                mean_rows, rstd_rows = x.new_empty(stop - start, 1), x.new_empty(stop - start, 1)
            else:
                rstd_rows = rstd.view(-1, 1)[start:stop]
                mean_rows = None if mean is None else mean.view(-1, 1)[start:stop]
            rows = (y_rows[start:stop], x_rows[start:stop], valid_rows[start:stop])
            if gain is not None:
                _forward_rows_rms(
                    *rows, scale, gain, eps, offset, rstd_rows, invalid_by_block[index],
                    keep_statistics,
                )  # fmt: skip
                return False
            return _forward_rows(
                *rows, scale, bias, eps, mean_rows, rstd_rows, invalid_by_block[index],
                keep_statistics, None if xhat_rows is None else xhat_rows[start:stop],
            )  # fmt: skip

        kept = all(map_blocks(block, range(len(blocks))))
        return y, mean, rstd, kept and xhat_rows is not None


def _invalid_rows_by_block(
    valid_rows: torch.Tensor, blocks: list[tuple[int, int]]
) -> list[torch.Tensor | None]:
    """For each block, the indices (within it) of its invalid rows, or None if it has none:
    found once for the whole tensor, where each block finding its own would cost a handful of
    small calls and a synchronization apiece.

    Example:
        >>> _invalid_rows_by_block(torch.tensor([True, False, True, True, False]), [(0, 2), (2, 5)])
        [tensor([1]), tensor([2])]
    """
    invalid = (~valid_rows).nonzero().squeeze(1)
    if invalid.numel() == 0:
        return [None] * len(blocks)
    if len(blocks) == 1:
        return [invalid - blocks[0][0]]
    starts = torch.tensor([start for start, _ in blocks] + [blocks[-1][1]], device=invalid.device)
    bounds = torch.searchsorted(invalid, starts).tolist()
    return [
        invalid[lo:hi] - start if hi > lo else None
        for (start, _), lo, hi in zip(blocks, bounds[:-1], bounds[1:], strict=True)
    ]


def _as_pair(*rows: torch.Tensor) -> list[torch.Tensor]:
    """Tensors of a single row (x, dy [..., C]; mean, rstd [..., 1]) as two identical rows.

    torch splits the reduction of a lone row over threads, and so rounds it differently from
    the same row among others; computed as two rows, a row's bits never depend on its company.
    """
    return [t.reshape(1, -1).expand(2, -1) for t in rows]


def _forward_rows(
    y: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    invalid: torch.Tensor | None,
    keep_statistics: bool = True,
    xhat: torch.Tensor | None = None,
) -> bool:
    """A block of rows [R, C] of the forward pass, in place in y; fills mean and rstd [R, 1].
    ``invalid`` holds the indices of the block's invalid rows (None: there are none).
    ``xhat`` (or None): where the normalized rows are made and kept (else in y); returns
    whether every row of it was (none redone scaled).

    Every op here streams over contiguous rows with at most one per-row factor, which torch
    vectorizes; a broadcast mask (where, masked_fill) would not be. No op mixes rows, so an
    invalid row's contents, NaN and inf included, reach nothing but its own row, which is then
    set to +0.0 (and its statistics to 0) by index: that costs only its own rows.
    """
    channels = x.shape[-1]
    torch.mean(x, dim=-1, keepdim=True, out=mean)
    xc = torch.sub(x, mean, out=y if xhat is None else xhat)
    # Corrected two-pass (Chan, Golub & LeVeque): xc is exact, but mean was rounded; the mean
    # of xc is that rounding error, and removing it keeps offset data accurate.
    shift = xc.mean(dim=-1, keepdim=True)
    sum_of_squares = _row_sums_of_squares(xc)
    rstd.copy_(_rstd(sum_of_squares, shift, channels, eps))
    xhat = _normalize(xc, shift, rstd)
    torch.addcmul(bias, xhat, scale, out=y)
    if invalid is not None:
        for tensor in (y, mean, rstd) if keep_statistics else (y,):
            tensor.index_fill_(0, invalid, 0.0)
    # Non-finite statistics: an invalid row holding NaN or inf (zeroed above), or a valid row
    # whose arithmetic overflowed (float32 |x| from about 1e19, float64 from about 1e154) or
    # that holds NaN or inf; and float64 rows whose squares underflowed (rstd above
    # _LARGEST_EXACT_RSTD): those are redone, scaled, in float64.
    underflowed = rstd > _LARGEST_EXACT_RSTD if x.dtype == torch.float64 else None
    finite = bool(sum_of_squares.add(shift).isfinite().all())
    if not finite or (underflowed is not None and underflowed.any()):
        rescued = valid & ~(sum_of_squares.isfinite() & shift.isfinite()).squeeze(1)
        if underflowed is not None:
            rescued |= underflowed.squeeze(1)
        if rescued.any():
            rows = rescued.nonzero().squeeze(1)
            _forward_rows_rescued(y, x, rows, scale, bias, eps, mean, rstd)
            return False
    return True


def _forward_rows_rms(
    y: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    gain: torch.Tensor,
    eps: float,
    offset: float,
    rstd: torch.Tensor,
    invalid: torch.Tensor | None,
    keep_statistics: bool = True,
) -> None:
    """RMSNorm's block of rows [R, C], as :func:`_forward_rows` (``gain`` is scale + offset):
    the sum of squares of x itself, then xhat = x * rstd and y = xhat * gain in place in y."""
    sum_of_squares = _row_sums_of_squares(x)
    rstd.copy_(sum_of_squares.div(x.shape[-1]).add_(eps).rsqrt_())
    torch.mul(x, rstd, out=y).mul_(gain)
    if invalid is not None:
        for tensor in (y, rstd) if keep_statistics else (y,):
            tensor.index_fill_(0, invalid, 0.0)
    # As _forward_rows': rows whose squares overflowed (float32 never: its squares are summed in
    # float64) or hold NaN or inf, and float64 rows whose squares underflowed, redone scaled.
    rescued = valid & ~sum_of_squares.isfinite().squeeze(1)
    if x.dtype == torch.float64:
        rescued |= (rstd > _LARGEST_EXACT_RSTD).squeeze(1)
    if rescued.any():
        rows = rescued.nonzero().squeeze(1)
        _forward_rows_rescued(y, x, rows, scale, None, eps, None, rstd, offset)


def _normalize(xc: torch.Tensor, shift: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """``xhat = (xc - shift) * rstd``, in place in xc.

    The mean's rounding error ``shift`` is removed from every row (skipped only when it is 0 in
    all of them): any test of whether it matters would be absolute, and rows of a tiny spread on
    a large offset are where it matters most. Skipping it when it moved xhat by less than an
    eighth of an ulp of 1 gave float32 rows of -1e-24 + 1e-30 at one channel a 7% error, and
    constant rows |y - bias| = 2.3e-9 instead of 0 (the native kernels never skip it).

    Two in-place passes, not one ``addcmul(-shift * rstd, xc, rstd)``: with two per-row
    operands torch's addcmul is not vectorized, and took twice the time of a plain in-place
    multiply on a 3 MiB block (1 or 2 threads, quiet machine).

    Example:
        >>> xc = torch.tensor([[1.0, -1.0], [3.0, -1.0]])
        >>> _normalize(xc, torch.tensor([[0.0], [1.0]]), torch.tensor([[1.0], [0.5]]))
        tensor([[ 1., -1.],
                [ 1., -1.]])
    """
    if shift.ne(0).any():
        xc.sub_(shift)
    return xc.mul_(rstd)


def _forward_rows_rescued(
    y: torch.Tensor,
    x: torch.Tensor,
    rows: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float = 0.0,
) -> None:
    """The given (valid) ``rows`` in float64, each scaled by a power of two so that nothing
    overflows (:func:`maskln_cli.op.functional.normalized_rows`), written into y, mean and rstd;
    RMSNorm's when bias is None (no mean). A row holding NaN or inf comes out NaN, as the
    formula says."""
    x64 = _two_rows_at_least(x.index_select(0, rows).double())
    every = torch.ones(len(x64), dtype=torch.bool, device=x.device)
    xhat, rs, exponent = normalized_rows(x64, every, eps, centered=bias is not None)
    count = len(rows)
    if bias is not None:
        out = xhat[:count] * scale.double() + bias.double()
    else:
        out = xhat[:count] * (offset + scale.double())
    y.index_copy_(0, rows, out.to(y.dtype))
    if mean is not None:
        mean.index_copy_(0, rows, row_means(x64)[:count].to(mean.dtype))
    rstd.index_copy_(0, rows, ldexp_exact(rs, -exponent)[:count].to(rstd.dtype))


def _two_rows_at_least(rows: torch.Tensor) -> torch.Tensor:
    """A lone row doubled: torch splits a single row's reduction over threads and so rounds it
    differently; with two rows or more, each row's bits are the same whatever its company."""
    return rows.repeat(2, 1) if len(rows) == 1 else rows


_RUN_LENGTH = 32
"""Sums of squares add the squared norms of runs of this many elements (see below)."""


def _row_sums_of_squares(rows: torch.Tensor) -> torch.Tensor:
    """``sum(rows**2)`` of each row of ``rows`` [R, C] (contiguous rows), ``[R, 1]`` float64.

    A float32 norm accumulates in vector lanes, where a lane holding a large value drops the
    small ones added after it: at C = 262,144, a running sum of squares (``vector_norm`` of the
    whole row) lost up to thousands of ulps on heavy-tailed rows. Here each run of 32 elements
    has its norm taken in the rows' dtype (a lane adds one or two squares), and the runs'
    squared norms are added in float64: within about an ulp, in one read of the rows, for
    about 1.8 times a plain norm's time (squaring into a buffer and summing runs of it was as
    accurate and 4 times slower).

    Example:
        >>> rows = torch.zeros(2, 300)
        >>> rows[:, ::32] = 3.0  # one 3 in each run of 32, and in the tail
        >>> _row_sums_of_squares(rows)
        tensor([[90.],
                [90.]], dtype=torch.float64)
    """
    rows_count, channels = rows.shape
    whole = channels - channels % _RUN_LENGTH
    if whole < 2 * _RUN_LENGTH:  # short rows: one norm is as accurate
        return torch.linalg.vector_norm(rows, dim=-1, keepdim=True).double().square_()
    runs = torch.linalg.vector_norm(rows[:, :whole].view(rows_count, -1, _RUN_LENGTH), dim=-1)
    total = runs.double().square_().sum(dim=-1, keepdim=True)
    if whole < channels:
        tail = torch.linalg.vector_norm(rows[:, whole:], dim=-1, keepdim=True)
        total += tail.double().square_()
    return total


def _rstd(
    sum_of_squares: torch.Tensor, shift: torch.Tensor, channels: int, eps: float
) -> torch.Tensor:
    """1 / sqrt(sum(xc^2) / C - shift^2 + eps) per row, computed in float64.

    The row statistics are few, so float64 costs nothing here, and keeps the variance's last
    subtraction and eps exact.
    """
    var = sum_of_squares.div(channels).sub_(shift.double().square()).clamp_min_(0.0)
    return var.add_(eps).rsqrt_()


def _block_bytes(x: torch.Tensor, largest: int) -> int:
    """The block size for x: an eighth of x, within [MIN_BLOCK_BYTES, largest]."""
    return min(largest, max(MIN_BLOCK_BYTES, x.numel() * x.element_size() // 8))


def _block_rows(x: torch.Tensor, block_bytes: int) -> int:
    return min(MAX_BLOCK_ROWS, block_bytes // max(1, x.shape[-1] * x.element_size()))


def _rows(tensor: torch.Tensor) -> torch.Tensor | None:
    """``[..., C]`` viewed as ``[rows, C]`` (never a copy), or None when the strides forbid it."""
    try:
        return tensor.view(-1, tensor.shape[-1])
    except RuntimeError:
        return None


def backward_in_place(
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    eps: float,
    need_dx: bool = True,
    need_dscale: bool = True,
    need_dbias: bool = True,
    norm: Norm = LAYER,
    offset: float = 0.0,
    xhat: torch.Tensor | None = None,
    dx_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The gradients of :func:`maskln_cli.op.functional.gradients`, without autograd, from the
    forward's ``mean`` and ``rstd``: in place on block-sized buffers, a block of rows at a time.
    This is the first-order backward pass; dx is +0.0 on invalid rows. RMSNorm's (``norm``)
    takes no mean and gives no dbias. ``xhat``: LayerNorm's normalized rows as
    :func:`forward_keeping_xhat` kept them (written: its invalid rows set to 0), taken instead
    of being made again (the same bits), but where rows are redone scaled. ``dx_out``: where
    dx is made (contiguous, x's shape and dtype; the same bits), instead of a new tensor.

    Example:
        >>> x, valid = torch.tensor([[1.0, 3.0]]), torch.tensor([True])
        >>> y, mean, rstd = forward(x, valid, torch.ones(2), torch.zeros(2), 3.0)
        >>> backward_in_place(torch.tensor([[1.0, 0.0]]), x, valid, torch.ones(2), mean, rstd, 3.0)
        (tensor([[ 0.1875, -0.1875]]), tensor([-0.5000,  0.0000]), tensor([1., 0.]))
    """
    with torch.no_grad():
        channels = x.shape[-1]
        if x.numel() and x.numel() == channels:  # one row: computed as two (see _as_pair)
            valid_pair = valid.reshape(1).expand(2)
            mean_pair = None if mean is None else _as_pair(mean)[0]
            dx_pair, dscale_pair, dbias_pair = backward_in_place(
                *_as_pair(dy, x), valid_pair, scale, mean_pair, *_as_pair(rstd), eps,
                need_dx, need_dscale, need_dbias, norm, offset,
            )  # fmt: skip
            dx = None if dx_pair is None else dx_pair[0].reshape(x.shape).clone()
            if dx is not None and dx_out is not None:
                dx = dx_out.copy_(dx)
            # each gradient sum counted the row twice: halving is exact
            halves = (None if g is None else g / 2 for g in (dscale_pair, dbias_pair))
            return dx, *halves
        # dscale and dbias accumulate the blocks' sums in float64
        dscale = x.new_zeros(channels, dtype=torch.float64) if need_dscale else None
        dbias = x.new_zeros(channels, dtype=torch.float64) if need_dbias and norm.centered else None
        if x.numel() == 0:
            dx = (torch.zeros_like(x) if dx_out is None else dx_out.zero_()) if need_dx else None
            return dx, *(None if g is None else g.to(x.dtype) for g in (dscale, dbias))
        x_rows = _rows(x)
        x_rows = x.contiguous().view(-1, channels) if x_rows is None else x_rows
        dy_rows = _rows(dy)
        dy_rows = dy.contiguous().view(-1, channels) if dy_rows is None else dy_rows
        valid_rows = valid.reshape(-1)
        weight = valid_rows.to(x.dtype)
        mean_rows = None if mean is None else mean.reshape(-1, 1)
        rstd_rows = rstd.reshape(-1, 1)
        gain = None if norm.centered else scale + offset
        blocks = list(
            row_blocks(len(x_rows), _block_rows(x, _block_bytes(x, BACKWARD_BLOCK_BYTES)))
        )
        invalid_by_block = _invalid_rows_by_block(valid_rows, blocks)
        dx = None
        if need_dx:
            dx = torch.empty_like(x_rows) if dx_out is None else dx_out.view(-1, channels)
        # Valid rows whose rstd is too small to be exact (|x| near the dtype's limit) are redone
        # scaled in their block; found once here, as the invalid rows are.
        too_small = rstd_rows.squeeze(1) < _SMALLEST_EXACT_RSTD[x.dtype]
        small_rows = bool((too_small & valid_rows).any())
        kept = None
        if xhat is not None and not small_rows and norm.centered:
            kept = _rows(xhat)

        def block(index: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            """The block's dx, and its own sums for dscale and dbias (added up in order below,
            so that they never depend on which thread finished first)."""
            start, stop = blocks[index]
            rows = slice(start, stop)
            # xhat and a scratch buffer, and dy * scale (in dx itself when dx is needed)
            workspace = x_rows.new_empty(2 if need_dx else 3, stop - start, channels)
            block_dx = dx[rows] if dx is not None else workspace[2]
            sums = [None if g is None else torch.zeros_like(g) for g in (dscale, dbias)]
            small = too_small[rows] if small_rows else None
            if gain is not None:
                _backward_rows_rms(
                    dy_rows[rows], x_rows[rows], valid_rows[rows], scale, gain, rstd_rows[rows],
                    eps, offset, block_dx, workspace[:2], sums[0], need_dx,
                    invalid_by_block[index], small,
                )  # fmt: skip
                return sums[0], None
            _backward_rows(
                dy_rows[rows], x_rows[rows], valid_rows[rows], weight[rows], scale,
                mean_rows[rows], rstd_rows[rows], eps, block_dx, workspace[:2], *sums, need_dx,
                invalid_by_block[index], small, None if kept is None else kept[rows],
            )  # fmt: skip
            return sums[0], sums[1]

        for block_dscale, block_dbias in map_blocks(block, range(len(blocks))):
            if dscale is not None and block_dscale is not None:
                dscale += block_dscale
            if dbias is not None and block_dbias is not None:
                dbias += block_dbias
        sums = (None if g is None else g.to(x.dtype) for g in (dscale, dbias))
        return (dx.view(x.shape) if dx is not None else None), *sums


def _backward_rows(
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    dx: torch.Tensor,
    workspace: torch.Tensor,
    dscale: torch.Tensor | None,
    dbias: torch.Tensor | None,
    need_dx: bool,
    invalid: torch.Tensor | None,
    too_small: torch.Tensor | None,
    kept: torch.Tensor | None = None,
) -> None:
    """A block of rows [R, C] of :func:`backward_in_place`: writes dx (used as workspace when
    not needed) and adds to dscale and dbias; ``workspace`` is [2, R, C]. ``invalid`` holds
    the indices of the block's invalid rows, ``too_small`` flags rows whose rstd is too small
    to be exact (None: there are none). ``kept``: the rows' xhat as the forward made them
    (its invalid rows set to 0 here), when there are no such rows.

    Only row reductions and sums over rows, no matrix products: a row's result must not depend
    on how many rows share its block (BLAS kernels treat row counts differently), and BLAS sums
    over rows are less accurate than torch.sum's.
    """
    xhat_buffer, scratch = workspace
    # wdy = dy * scale and c2 = mean_C(wdy); a non-finite c2 flags an invalid row whose dy
    # holds NaN or inf, zeroed before the sums over rows mix it with anything else.
    wdy = torch.mul(dy, scale, out=dx)
    c2 = wdy.mean(dim=-1, keepdim=True)
    if not c2.isfinite().all():
        poisoned = ~(valid | c2.isfinite().squeeze(1))
        if poisoned.any():
            dy = dy.clone().index_fill_(0, poisoned.nonzero().squeeze(1), 0.0)
            wdy = torch.mul(dy, scale, out=dx)
            c2 = wdy.mean(dim=-1, keepdim=True)
    if dbias is not None:  # outputs of invalid rows are constants: their dy counts for nothing
        # torch.sum's cascade, not a matrix-vector product: BLAS adds a column's thousands of
        # rows one by one in float32, and grad_bias lost digits that way.
        masked = dy if invalid is None else torch.mul(dy, weight.unsqueeze(1), out=scratch)
        dbias += masked.sum(dim=0)
    if dscale is None and not need_dx:
        return
    if kept is not None and too_small is None:
        # The forward's: its valid rows the bits made below (the forward found their
        # statistics finite, so x - mean is, and so its mean), its invalid rows anything.
        if invalid is not None:
            kept.index_fill_(0, invalid, 0.0)
        _backward_sums(dy, kept, wdy, scratch, rstd, c2, dscale, need_dx, invalid)
        return
    # xhat, recomputed as in the forward pass (mean and rstd are 0 on invalid rows).
    xc = torch.sub(x, mean, out=xhat_buffer)
    shift = xc.mean(dim=-1, keepdim=True)
    rescued = None
    if too_small is not None or not shift.isfinite().all():
        # Non-finite: an invalid row holding NaN or inf (zeroed), or a valid row whose x - mean
        # overflowed or that holds NaN or inf. Those valid rows, and those whose rstd is too
        # small to be exact, are zeroed here and redone, scaled, below.
        unusable = ~shift.isfinite().squeeze(1)
        rescued = valid & (unusable if too_small is None else unusable | too_small)
        zeroed = (unusable | rescued).nonzero().squeeze(1)
        xc.index_fill_(0, zeroed, 0.0)
        shift.index_fill_(0, zeroed, 0.0)
    xhat = _normalize(xc, shift, rstd)  # 0 on rescued rows
    if invalid is not None:  # (xc - shift) * 0 is NaN where xc - shift overflowed
        xhat.index_fill_(0, invalid, 0.0)
    _backward_sums(dy, xhat, wdy, scratch, rstd, c2, dscale, need_dx, invalid)
    if rescued is not None and rescued.any():
        _backward_rows_rescued(dy, x, rescued.nonzero().squeeze(1), scale, eps, dx, dscale, need_dx)


def _backward_sums(
    dy: torch.Tensor,
    xhat: torch.Tensor,
    wdy: torch.Tensor,
    scratch: torch.Tensor,
    rstd: torch.Tensor,
    c2: torch.Tensor,
    dscale: torch.Tensor | None,
    need_dx: bool,
    invalid: torch.Tensor | None,
) -> None:
    """:func:`_backward_rows` from xhat (0 on invalid rows) on: dscale's share, and dx in
    place in wdy."""
    if dscale is not None:
        dscale += torch.mul(xhat, dy, out=scratch).sum(dim=0)
    if need_dx:
        c1 = torch.mul(xhat, wdy, out=scratch).mean(dim=-1, keepdim=True)
        # dx = rstd * (wdy - xhat * c1 - c2), then +0.0 on invalid rows whatever scale holds.
        # (Not wdy * rstd - c2 * rstd - ...: that rounds before the cancellation wdy - c2, and
        # a single channel's dx, exactly 0, came out as an ulp of wdy * rstd.)
        wdy.addcmul_(xhat, c1, value=-1.0).sub_(c2).mul_(rstd)
        if invalid is not None:
            wdy.index_fill_(0, invalid, 0.0)


def _backward_rows_rms(
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    gain: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    offset: float,
    dx: torch.Tensor,
    workspace: torch.Tensor,
    dscale: torch.Tensor | None,
    need_dx: bool,
    invalid: torch.Tensor | None,
    too_small: torch.Tensor | None,
) -> None:
    """RMSNorm's block of rows [R, C], as :func:`_backward_rows` (``gain`` is scale + offset;
    no dbias, no c2)."""
    xhat_buffer, scratch = workspace
    if invalid is not None and not dy.index_select(0, invalid).isfinite().all():
        # NaN or inf in an invalid row's dy: zeroed before the sums over rows read it
        dy = dy.clone().index_fill_(0, invalid, 0.0)
    wg = torch.mul(dy, gain, out=dx)
    xhat = torch.mul(x, rstd, out=xhat_buffer)
    rescued = None
    if too_small is not None:  # redone, scaled, below; 0 until then
        rescued = valid & too_small
        xhat.index_fill_(0, rescued.nonzero().squeeze(1), 0.0)
    if invalid is not None:  # NaN or inf times their rstd of 0
        xhat.index_fill_(0, invalid, 0.0)
    if dscale is not None:
        dscale += torch.mul(xhat, dy, out=scratch).sum(dim=0)
    if need_dx:
        c1 = torch.mul(xhat, wg, out=scratch).mean(dim=-1, keepdim=True)
        wg.addcmul_(xhat, c1, value=-1.0).mul_(rstd)  # dx = rstd * (wg - xhat * c1)
        if invalid is not None:
            wg.index_fill_(0, invalid, 0.0)
    if rescued is not None and rescued.any():
        _backward_rows_rescued(
            dy, x, rescued.nonzero().squeeze(1), scale, eps, dx, dscale, need_dx,
            norm=RMS, offset=offset,
        )  # fmt: skip


_LARGEST_EXACT_RSTD = 1e146
"""Above this, var + eps is below float64's smallest normal number over its epsilon (about
1e-292): the squares of the deviations were subnormal, or nearly, and lost precision."""
_SMALLEST_EXACT_RSTD = {
    dtype: torch.finfo(dtype).tiny / torch.finfo(dtype).eps
    for dtype in (torch.float32, torch.float64)
}
"""Below this an rstd is a subnormal number, or close to one, and has lost precision."""


def _backward_rows_rescued(
    dy: torch.Tensor,
    x: torch.Tensor,
    rows: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    dx: torch.Tensor,
    dscale: torch.Tensor | None,
    need_dx: bool,
    norm: Norm = LAYER,
    offset: float = 0.0,
) -> None:
    """dx and dscale of the given (valid) ``rows`` in float64, from statistics recomputed from
    x with each row scaled by a power of two. Their xhat was zeroed in the block, so dscale
    lacks them so far."""
    count = len(rows)
    x64 = _two_rows_at_least(x.index_select(0, rows).double())
    dy64 = _two_rows_at_least(dy.index_select(0, rows).double())
    every = torch.ones(len(x64), dtype=torch.bool, device=x.device)
    needs = (need_dx, False, False)
    dx64, _, _ = gradients(dy64, x64, every, scale.double(), eps, needs, norm, offset)
    if dx64 is not None:
        dx.index_copy_(0, rows, dx64[:count].to(dx.dtype))
    if dscale is not None:  # per row, then summed: the same whatever the company
        xhat, _, _ = normalized_rows(x64, every, eps, norm.centered)
        dscale += (dy64 * xhat)[:count].sum(dim=0)
