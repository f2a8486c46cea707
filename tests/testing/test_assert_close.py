"""maskln_cli.testing.assert_close and verify: a kernel's tensors in memory judged as `maskln
verify` judges files (the kernels are tests/kernels.py's, correct and wrong)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from maskln_cli import testing
from maskln_cli.testing.judging import VerifyFailed
from maskln_cli.testing.text import failure_message, report_text
from maskln_cli.verify.job import VerifyOptions, verify_file
from tests import kernels
from tests.clitools import invoke, write

GRADIENTS = ("grad_x", "grad_scale", "grad_bias")


def judged(inputs: dict[str, torch.Tensor], result: dict[str, torch.Tensor], **options):
    """verify's report on ``result`` for ``inputs`` (tests/kernels.py's dicts)."""
    grads = {name: result.get(name) for name in GRADIENTS}
    return testing.verify(
        result.get("out"), inputs["x"], inputs["valid"], inputs["scale"], inputs["bias"],
        kernels.EPS, grad_out=inputs.get("grad_out"), **grads, **options,
    )  # fmt: skip


def assert_judged_close(inputs, result, **options) -> None:
    grads = {name: result.get(name) for name in GRADIENTS}
    testing.assert_close(
        result.get("out"), inputs["x"], inputs["valid"], inputs["scale"], inputs["bias"],
        kernels.EPS, grad_out=inputs.get("grad_out"), **grads, **options,
    )  # fmt: skip


def float64_truth(inputs):
    """out and the gradients in float64, by maskln's op under autograd."""
    leaves = [inputs[k].double().requires_grad_() for k in ("x", "scale", "bias")]
    out = kernels.masked_layer_normalization(
        leaves[0], inputs["valid"], leaves[1], leaves[2], kernels.EPS
    )
    grads = torch.autograd.grad(out, leaves, inputs["grad_out"].double())
    return {"out": out.detach(), **dict(zip(GRADIENTS, grads, strict=True))}


@pytest.mark.parametrize(
    ("dtype", "offset"), [("float16", 0.0), ("bfloat16", 100.0), ("float32", 1e4)]
)
def test_a_correct_kernel_passes_where_a_fixed_tolerance_fails(dtype, offset):
    """PyTorch's own F.layer_norm, result and gradients: torch.testing.assert_close against the
    float64 truth fails it (float16 gradients, float32 rows at an offset), the budget does
    not."""
    inputs = kernels.offset_batch(offset, dtype=dtype, shape=(4, 64, 64))
    result = kernels.zero_padding(kernels.run(kernels.torch_layer_norm, inputs), inputs["valid"])
    truth = float64_truth(inputs)
    refused = []
    for name, value in result.items():
        try:
            torch.testing.assert_close(value, truth[name].to(value.dtype))
        except AssertionError:
            refused.append(name)
    assert refused, "the fixed tolerance was expected to refuse a correct kernel here"
    assert_judged_close(inputs, result)  # raises on failure
    report = judged(inputs, result)
    assert [t.name for t in report.tensors] == ["out", *GRADIENTS]
    assert all(t.passed and t.budget_ratio <= 1 for t in report.tensors)


@pytest.mark.parametrize(
    ("kernel", "offset", "failing", "diagnosis"),
    [
        (kernels.one_pass, 1e3, ["out", "grad_x"], "one-pass variance"),
        (kernels.eps_outside, 0.0, ["out", "grad_x"], "eps added outside the square root"),
        (kernels.unbiased, 0.0, ["out", "grad_x"], "unbiased variance"),
        (kernels.padding_returns_bias, 0.0, ["out"], "invalid rows return bias"),
        (kernels.nan_leak, 0.0, ["grad_x", "grad_scale"], "NaN or inf from the padding"),
    ],
    ids=["one-pass", "eps outside", "unbiased", "padding", "NaN leak"],
)
def test_a_wrong_kernel_fails_with_the_tensor_named(kernel, offset, failing, diagnosis):
    inputs = kernels.offset_batch(offset, shape=(4, 64, 64))
    result = kernels.run(kernel, inputs)
    with pytest.raises(AssertionError) as raised:
        assert_judged_close(inputs, result)
    message = str(raised.value)
    report = raised.value.report
    failed = [t for t in report.tensors if not t.passed]
    assert set(failing) <= {t.name for t in failed} and failed[0].name == failing[0]
    first_line = message.splitlines()[0]
    assert first_line.startswith(f"FAIL: {len(failed)} of 4 tensors: {failing[0]}")
    assert diagnosis in first_line  # the verdict line says the one explanation
    for name in failing:
        assert f"\nFAIL {name} " in message
    assert diagnosis in failed[0].diagnosis[0]["description"]
    assert diagnosis in message.split(f"\nFAIL {failing[0]} ")[1]  # its block says it too


def test_a_wrong_grad_scale_alone_is_caught():
    """A backward whose loop over the batch stops one sequence short in grad_scale's sum (an
    off-by-one): out, grad_x and grad_bias right, grad_scale short of 43 of 179 rows."""
    inputs = kernels.offset_batch(0.0, shape=(4, 64, 64))
    result = kernels.zero_padding(kernels.run(kernels.two_pass, inputs), inputs["valid"])
    x, valid = inputs["x"].reshape(-1, 64), inputs["valid"].reshape(-1)
    xhat = kernels.two_pass(x, valid, torch.ones(64), torch.zeros(64))  # 0 on the padding
    dy = inputs["grad_out"].reshape(-1, 64)
    short = (dy * xhat)[: 3 * 64].sum(0)  # the last sequence left out
    assert (short - result["grad_scale"]).abs().max() > 1e-2  # the mistake is not rounding
    assert_judged_close(inputs, result)  # the right kernel passes
    with pytest.raises(AssertionError) as raised:
        assert_judged_close(inputs, dict(result, grad_scale=short))
    assert raised.value.args[0].startswith("FAIL: 1 of 4 tensors: grad_scale: ")
    assert [t.passed for t in raised.value.report.tensors] == [True, True, False, True]


def _figures(document: dict) -> str:
    """A report's JSON without what names the inputs (paths, or the in-memory names); as
    text, where NaN is NaN."""
    document = dict(document)
    for key in ("actual", "expected", "eps_source"):
        document.pop(key)
    return json.dumps(document, sort_keys=True)


def negative_zero_padding(x, valid, scale, bias):
    """A right kernel whose padding is -0.0: it fails the contract's +0.0 (--strict)."""
    out = kernels.two_pass(x, valid, scale, bias)
    return torch.where(valid[..., None], out, -0.0)


@pytest.mark.parametrize(
    "kernel", [kernels.two_pass, kernels.unbiased, kernels.nan_leak, negative_zero_padding]
)
def test_files_and_memory_get_the_same_verdict_and_figures(tmp_path, kernel):
    """The same tensors, saved for `maskln verify --strict` and given to verify/assert_close:
    the same report, figure for figure, and the same text but for the lines naming the inputs;
    and with strict=False, `maskln verify`'s without --strict."""
    inputs = kernels.offset_batch(1e3, shape=(4, 32, 64))
    result = kernels.run(kernel, inputs)
    source = write(tmp_path / "in.safetensors", inputs, eps="1e-05")
    target = write(tmp_path / "result.safetensors", result)
    for strict in (True, False):
        from_files = verify_file(str(source), str(target), verify=VerifyOptions(strict=strict))
        in_memory = judged(inputs, result, strict=strict)
        assert from_files.passed == in_memory.passed
        assert _figures(in_memory.to_dict()) == _figures(from_files.to_dict())

    printed = invoke("verify", source, target, "--strict")
    in_memory = judged(inputs, result)
    assert kernel is not negative_zero_padding or not in_memory.passed  # -0.0 fails
    assert printed.exit_code == (0 if in_memory.passed else 1), printed.stderr
    text = report_text(in_memory)
    names = [(str(target), "the kernel's tensors"), (str(source), "the inputs given"),
             ("from metadata 'eps'", "from the eps argument")]  # fmt: skip
    expected = printed.stdout.rstrip("\n")
    for path, name in names:
        expected = expected.replace(path, name)
    assert text == expected
    if not in_memory.passed:
        with pytest.raises(AssertionError) as raised:
            assert_judged_close(inputs, result)
        assert str(raised.value) == failure_message(in_memory)
        verdict, _, body = str(raised.value).partition("\n\n")
        assert f"{body}\n\n{verdict}" == text  # the report, its verdict line first


def test_any_strides_and_devices_give_the_same_report():
    inputs = kernels.offset_batch(1e2, shape=(2, 16, 32))
    result = kernels.run(kernels.unbiased, inputs)  # a failing kernel: the most figures
    contiguous = _figures(judged(inputs, result).to_dict())

    def strided(t: torch.Tensor) -> torch.Tensor:  # the same values, the channels outermost
        return t.movedim(-1, 0).contiguous().movedim(0, -1) if t.dim() > 1 else t[::1]

    def every_other(t: torch.Tensor) -> torch.Tensor:
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]

    for layout in (strided, every_other):
        moved = {k: layout(v) if v.dtype != torch.bool else v for k, v in inputs.items()}
        again = {k: layout(v) for k, v in result.items()}
        assert not moved["x"].is_contiguous() and not again["grad_x"].is_contiguous()
        assert _figures(judged(moved, again).to_dict()) == contiguous
    requiring = {k: v.requires_grad_() for k, v in result.items()}
    assert _figures(judged(inputs, requiring).to_dict()) == contiguous
    if torch.cuda.is_available():
        on_gpu = {k: v.cuda() for k, v in inputs.items()}
        again = {k: v.cuda() for k, v in result.items()}
        assert _figures(judged(on_gpu, again).to_dict()) == contiguous


def test_the_message_is_the_plain_text_report():
    inputs = kernels.offset_batch(0.0, shape=(2, 16, 32))
    result = kernels.run(kernels.with_eps(1e-3), inputs)
    with pytest.raises(VerifyFailed) as raised:
        assert_judged_close(inputs, result)
    message = str(raised.value)
    assert isinstance(raised.value, AssertionError)
    assert "\x1b[" not in message and "[bold" not in message  # no colour, no markup
    assert not any(line != line.rstrip() for line in message.split("\n"))
    for line in ("result     the kernel's tensors (actual)", "FAIL out ", "worst rows of out"):
        assert line in message
    assert re.search(r"^  row +channel +actual +expected +abs diff +budget$", message, re.M)
    # the report as data beside it: JSON-ready, as `maskln verify --json` prints it
    assert json.loads(json.dumps(raised.value.report.to_dict()))["passed"] is False


def test_factor_is_verify_s():
    inputs = kernels.offset_batch(0.0, shape=(2, 16, 32))
    result = kernels.run(kernels.with_eps(2e-5), inputs)
    needed = judged(inputs, result).tensors[0].factor_needed
    assert needed is not None and 3 < needed < 1e6
    assert not judged(inputs, result, factor=needed * 0.9).tensors[0].passed
    report = judged(inputs, result, factor=needed * 1.1)
    assert report.tensors[0].budget_ratio <= 1 and report.context["factor"] == needed * 1.1


X = torch.zeros(2, 3, 4)
VALID = torch.ones(2, 3, dtype=torch.bool)
ONES, ZEROS = torch.ones(4), torch.zeros(4)


@pytest.mark.parametrize(
    ("arguments", "options", "error", "words"),
    [
        ((X, X.numpy(), VALID, ONES, ZEROS), {}, TypeError, "x must be a torch.Tensor"),
        ((X, X.long(), VALID, ONES, ZEROS), {}, TypeError, "x must be a float32"),
        ((X, X, VALID[0], ONES, ZEROS), {}, ValueError, "valid must have x's leading shape"),
        ((X, X, VALID.float() * 2, ONES, ZEROS), {}, ValueError, "valid must hold only 0 and 1"),
        ((X, X, VALID, torch.ones(5), ZEROS), {}, ValueError, "scale must have shape [4]"),
        ((X, X, VALID, ONES, ZEROS.long()), {}, TypeError, "bias must be a floating tensor"),
        ((X, X, VALID, ONES, ZEROS, -1.0), {}, ValueError, "eps must be a finite positive"),
        ((X, X, VALID, ONES, ZEROS, "1e-5"), {}, TypeError, "eps must be a finite positive"),
        ((X, X, VALID, ONES, ZEROS, 1e-50), {}, ValueError, "eps 1e-50 rounds to 0"),
        ((X, X, VALID, ONES, ZEROS), {"factor": 0.5}, ValueError, "factor must be a finite"),
        ((X, X, VALID, ONES, ZEROS), {"grad_x": X}, ValueError, "grad_x given without grad_out"),
        ((X, X, VALID, ONES, ZEROS), {"grad_out": X[0]}, ValueError, "grad_out must have x's"),
        ((None, X, VALID, ONES, ZEROS), {}, ValueError, "nothing to judge"),
        ((X, X, VALID, ONES, ZEROS), {"grad_out": X, "grad_bias": 0}, TypeError, "grad_bias must"),
        ((X.to_sparse(), X, VALID, ONES, ZEROS), {}, TypeError, "out must be a dense"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(arguments, options, error, words):
    for function in (testing.assert_close, testing.verify):
        with pytest.raises(error) as raised:
            function(*arguments, **options)
        assert words in str(raised.value)


def test_a_wrong_result_shape_or_dtype_is_a_failure_not_an_error():
    """The result is the kernel's: a shape or dtype that is wrong fails, as in verify."""
    x = torch.randn(2, 3, 4)
    with pytest.raises(AssertionError, match=r"FAIL: 1 of 1 tensors: out: shape"):
        testing.assert_close(x[0], x, None, None, None)
    with pytest.raises(AssertionError, match="not a floating-point result"):
        testing.assert_close(x.long(), x, None, None, None)


# --- the padding: exactly +0.0 ---------------------------------------------------------------


def negative_zeros(tensor: torch.Tensor, valid: torch.Tensor, everywhere: bool) -> torch.Tensor:
    """``tensor`` with -0.0 at every element of its padding, or at one element of one padded
    row (its last channel, of the last padded row)."""
    changed = tensor.clone()
    if everywhere:
        changed[~valid] = -0.0
    else:
        row = tuple(int(i) for i in (~valid).nonzero()[-1])
        changed[row][-1] = -0.0
    return changed


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_negative_zero_in_the_padding_fails_unless_strict_is_false(dtype):
    """The contract: invalid rows of out and grad_x exactly +0.0. -0.0 in every padding
    element, or in one, fails by default (as `maskln verify --strict`), naming the tensor and
    the count; strict=False judges as `maskln verify` does by default (reported, not failed)."""
    inputs = kernels.offset_batch(0.0, dtype=dtype, shape=(2, 8, 16))
    right = kernels.zero_padding(kernels.run(kernels.maskln, inputs), inputs["valid"])
    assert_judged_close(inputs, right)  # +0.0 everywhere: passes
    valid = inputs["valid"]
    for name in ("out", "grad_x"):
        for everywhere in (True, False):
            wrong = dict(right, **{name: negative_zeros(right[name], valid, everywhere)})
            count = int((~valid).sum()) * 16 if everywhere else 1
            with pytest.raises(VerifyFailed) as raised:
                assert_judged_close(inputs, wrong)
            failed = [t for t in raised.value.report.tensors if not t.passed]
            assert [t.name for t in failed] == [name], (name, everywhere)
            assert failed[0].negative_zeros == count
            verdict = str(raised.value).split("\n", 1)[0]
            assert verdict.startswith(f"FAIL: 1 of 4 tensors: {name}: -0.0 at {count:,} padded")
            lenient = judged(inputs, wrong, strict=False)
            assert lenient.passed and lenient.context["strict"] is False
            assert {t.name: t.negative_zeros for t in lenient.tensors}[name] == count


def test_strict_must_be_a_bool():
    with pytest.raises(TypeError, match="strict must be True or False, got str"):
        testing.assert_close(X, X, VALID, ONES, ZEROS, strict="no")


# --- plain tensors only -----------------------------------------------------------------------


class ShowsTheTruth(torch.Tensor):
    """A subclass whose __torch_function__ hands back ``shown`` from every operation that reads
    its data (detach, to, contiguous, clone...): its memory holds something else."""

    shown: torch.Tensor

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
        liar = next((a for a in args if isinstance(a, ShowsTheTruth)), None)
        if liar is not None and isinstance(result, torch.Tensor) and result.shape == liar.shape:
            return liar.shown.clone()
        return result


class DetachesToTheTruth(torch.Tensor):
    """A subclass that overrides methods in Python: detach and to hand back ``shown``."""

    shown: torch.Tensor

    def detach(self):
        return self.shown.clone()

    def to(self, *args, **kwargs):
        return self.shown.clone()


class Wrapper(torch.Tensor):
    """A wrapper subclass (__torch_dispatch__, no storage of its own) whose every operation
    runs on ``shown``."""

    @staticmethod
    def __new__(cls, shown):
        return torch.Tensor._make_wrapper_subclass(
            cls, shown.shape, dtype=shown.dtype, device=shown.device
        )

    def __init__(self, shown):
        self.shown = shown

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t.shown if isinstance(t, Wrapper) else t

        return func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})


class ParameterShowsTheTruth(torch.nn.Parameter):
    """A Parameter subclass with its own __torch_function__ (Parameter's own disables it)."""

    shown: torch.Tensor

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return ShowsTheTruth.__torch_function__.__func__(cls, func, types, args, kwargs)


def disguised(kind: str, data: torch.Tensor, shown: torch.Tensor) -> torch.Tensor:
    """``data`` in a subclass that shows ``shown`` to whoever reads it through torch."""
    if kind == "wrapper":
        return Wrapper(shown)
    if kind == "parameter":
        tensor = ParameterShowsTheTruth(data, requires_grad=False)
    else:
        cls = {"torch_function": ShowsTheTruth, "methods": DetachesToTheTruth}[kind]
        tensor = data.as_subclass(cls)
    tensor.shown = shown
    return tensor


SUBCLASSES = ["torch_function", "methods", "wrapper", "parameter"]


@pytest.mark.parametrize("kind", SUBCLASSES)
def test_a_tensor_subclass_is_refused_not_judged_by_what_it_shows(kind):
    """A wrong out (twice the truth) in a subclass that shows the truth to torch's operations
    passed; any Tensor subclass but nn.Parameter is refused by name, in every argument."""
    inputs = kernels.offset_batch(0.0, shape=(2, 8, 16))
    right = kernels.zero_padding(kernels.run(kernels.maskln, inputs), inputs["valid"])
    assert_judged_close(inputs, right)
    wrong = dict(right, out=disguised(kind, right["out"] * 2, right["out"]))
    for function in (assert_judged_close, judged):
        with pytest.raises(TypeError) as raised:
            function(inputs, wrong)
        assert str(raised.value).startswith("out must be a plain torch.Tensor")
        assert type(wrong["out"]).__name__ in str(raised.value)
    for name in ("x", "valid", "scale", "grad_out"):  # the inputs: judged as the kernel saw them?
        given = dict(inputs, **{name: disguised(kind, inputs[name], inputs[name])})
        with pytest.raises(TypeError, match=f"^{name} must be a plain torch.Tensor"):
            assert_judged_close(given, right)
    for name in GRADIENTS:
        given = dict(right, **{name: disguised(kind, right[name] * 2, right[name])})
        with pytest.raises(TypeError, match=f"^{name} must be a plain torch.Tensor"):
            assert_judged_close(inputs, given)


def test_parameters_and_plain_tensors_are_judged():
    """nn.Parameter (scale and bias as a module holds them; an out that is one) is plain."""
    inputs = kernels.offset_batch(0.0, shape=(2, 8, 16))
    right = kernels.zero_padding(kernels.run(kernels.maskln, inputs), inputs["valid"])
    held = dict(
        inputs, scale=torch.nn.Parameter(inputs["scale"]), bias=torch.nn.Buffer(inputs["bias"])
    )
    assert_judged_close(held, dict(right, out=torch.nn.Parameter(right["out"])))
    with pytest.raises(VerifyFailed):
        assert_judged_close(held, dict(right, out=torch.nn.Parameter(right["out"] * 2)))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
@pytest.mark.parametrize("name", ["out", "x", "valid", "scale", "grad_out", "grad_x"])
def test_a_nested_tensor_is_a_type_error_naming_the_argument(layout, name):
    """A nested tensor's sizes cannot be read (`Internal error: NestedTensorImpl doesn't support
    sizes`): refused by name."""
    inputs = kernels.offset_batch(0.0, shape=(2, 8, 16))
    right = kernels.zero_padding(kernels.run(kernels.maskln, inputs), inputs["valid"])
    given = right if name in ("out", "grad_x") else inputs
    rows = given[name].unbind(0) if given[name].dim() > 1 else [given[name]] * 2
    nested = dict(given, **{name: torch.nested.nested_tensor(list(rows), layout=layout)})
    arguments = (inputs, nested) if given is right else (nested, right)
    with pytest.raises(TypeError, match=f"^{name} must be a dense tensor, got a nested tensor"):
        assert_judged_close(*arguments)


def test_the_report_says_when_no_row_is_valid(tmp_path):
    """With every row invalid, out and grad_x are 0 whatever a kernel computes there: a PASS
    says that nothing but the padding was checked, in memory and in files alike."""
    inputs = kernels.offset_batch(0.0, shape=(2, 8, 16))
    inputs["valid"] = torch.zeros_like(inputs["valid"])
    result = kernels.zero_padding(kernels.run(kernels.maskln, inputs), inputs["valid"])
    assert_judged_close(inputs, result)  # zeros are right: it passes
    said = "no row is valid: only the padding was checked, no normalized value"
    report = judged(inputs, result)
    assert report.passed and said in report.context["not_checked"]
    assert said in report_text(report).rsplit("\n", 1)[1]  # the verdict line
    source = write(tmp_path / "in.safetensors", inputs, eps="1e-05")
    target = write(tmp_path / "result.safetensors", result)
    assert said in verify_file(str(source), str(target)).context["not_checked"]
    some = dict(inputs, valid=inputs["valid"].clone())
    some["valid"][0, 0] = True  # one valid row: no such words
    assert said not in str(judged(some, kernels.run(kernels.maskln, some)).context)


def test_a_pass_that_could_not_check_everything_warns(recwarn):
    """A passing assert_close returns None; what it could not check (no valid row, C = 1, NaN
    rows of x) reaches the test's run as a NotCheckedWarning naming it, as verify's PASS line
    says it; a pass that checked everything warns nothing."""
    from maskln_cli.testing.judging import NotCheckedWarning

    inputs = kernels.offset_batch(0.0, shape=(2, 8, 16))
    inputs["valid"] = torch.zeros_like(inputs["valid"])
    result = kernels.zero_padding(kernels.run(kernels.maskln, inputs), inputs["valid"])
    with pytest.warns(NotCheckedWarning, match="no row is valid: only the padding was checked"):
        assert_judged_close(inputs, result)
    ones = kernels.offset_batch(0.0, shape=(2, 8, 1))  # C = 1: out is the bias alone
    with pytest.warns(NotCheckedWarning, match="C = 1: out is the bias alone"):
        assert_judged_close(ones, kernels.run(kernels.maskln, ones))
    recwarn.clear()
    full = kernels.offset_batch(0.0, shape=(2, 8, 16))
    assert_judged_close(full, kernels.run(kernels.maskln, full))
    assert not [w for w in recwarn if issubclass(w.category, NotCheckedWarning)]


def test_no_warning_per_draw_inside_a_hypothesis_test(recwarn):
    """Hypothesis draws no valid row and C = 1 on purpose: those draws do not warn."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from maskln_cli.testing.judging import NotCheckedWarning

    @settings(max_examples=2, database=None, deadline=None)
    @given(st.sampled_from([1, 16]))
    def judge_a_draw(channels):
        inputs = kernels.offset_batch(0.0, shape=(2, 8, channels))
        inputs["valid"] = torch.zeros_like(inputs["valid"])
        assert_judged_close(
            inputs, kernels.zero_padding(kernels.run(kernels.maskln, inputs), inputs["valid"])
        )

    judge_a_draw()
    assert not [w for w in recwarn if issubclass(w.category, NotCheckedWarning)]
