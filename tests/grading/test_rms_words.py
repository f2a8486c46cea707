"""The RMSNorm exercise's report speaks of its own inputs (issue 39): it has no bias, so no label,
message or cause of an ``--op rms`` grade mentions one, in its text or its JSON, whichever
clause a submission fails (the class's wrong submissions, and a few more here failing the
padding, positive-zero and purity clauses)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from maskln_cli.grading import grade
from tests.grading.test_rms_exercise import EXPECTED, WRONG, solution


def unmasked(x, valid, scale, eps=1e-6):
    """Every row normalized, the padding's too (NaN or values where +0.0 belongs)."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * scale


def multiplied(x, valid, scale, eps=1e-6):
    """The padding zeroed by multiplying by the mask: -0.0 where a value is negative."""
    keep = valid[..., None].to(x.dtype)
    x = torch.where(valid[..., None], x, 0.0)
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * scale * keep


def detached(x, valid, scale, eps=1e-6):
    """Right values, no graph: the output does not require grad."""
    x = torch.where(valid[..., None], x, 0.0)
    out = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * scale
    return torch.where(valid[..., None], out, 0.0).detach()


MORE = {"unmasked": unmasked, "multiplied": multiplied, "detached": detached}


def bias_words(report) -> list[str]:
    """Every mention of bias in the report's text and JSON, with its context."""
    text = report.text() + "\n" + json.dumps(report.to_dict())
    return sorted({m.group(0) for m in re.finditer(r"[^\n\"]{0,60}bias[^\n\"]{0,30}", text, re.I)})


@pytest.mark.parametrize("name", [*WRONG, *MORE])
def test_an_rms_grade_never_mentions_bias(name):
    function = MORE[name] if name in MORE else solution(name)
    report = grade(function, op="rms", strict=True)
    assert not report.passed  # every one of them is wrong somewhere: its words are shown
    assert bias_words(report) == []


def test_the_words_are_layer_norms_where_there_is_a_bias():
    """The same wrong padding graded as LayerNorm still says bias (a bias is then there)."""

    def layer_multiplied(x, valid, scale, bias, eps=1e-5):
        keep = valid[..., None].to(x.dtype)
        x = torch.where(valid[..., None], x, 0.0)
        xhat = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, False, True) + eps)
        return (xhat * scale + bias) * keep

    report = grade(layer_multiplied, strict=True)
    assert any("bias * 0 is -0.0" in words for words in bias_words(report))
    assert EXPECTED  # the class's manifest is what WRONG was read from
