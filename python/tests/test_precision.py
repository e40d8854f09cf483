"""float32 inputs are computed as float16, and the caller chooses whether
that may happen (``f32_inputs``): said once at INFO by default, a
``TypeError`` with ``f32_inputs="error"``; a float32 value past float16's
range is refused with how to scale it, and the scaling it names gives the
same loss."""

import logging

import pytest
import torch

import headkl._precision
import headkl.torch as ht
from test_head_refresh import full_vocab_problem
from test_loss import close, problem


def said_f32(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "headkl" and "computed as float16" in r.getMessage()]


@pytest.fixture
def fresh(caplog, monkeypatch):
    """The once-only INFO line not said yet in this process."""
    caplog.set_level(logging.INFO, logger="headkl")
    monkeypatch.setattr(headkl._precision, "_said_f32", False)
    return caplog


def test_float16_inputs_say_nothing(fresh):
    weight, hidden, ids, values, _, _ = problem(1)
    loss_fn = ht.HeadKLLoss(weight.half(), f32_inputs="error", backend="reference")
    loss_fn(hidden.half(), ids, values)
    loss_fn(hidden.bfloat16(), ids, values)
    assert said_f32(fresh) == []


def test_float32_is_computed_as_float16_and_said_once(fresh):
    weight, hidden, ids, values, _, _ = problem(1)
    loss_fn = ht.HeadKLLoss(weight.half(), backend="reference")
    assert said_f32(fresh) == []
    want = loss_fn(hidden.half(), ids, values)
    # f16-exact values: float32 gives the same loss, said once at INFO with its cost.
    assert torch.equal(loss_fn(hidden, ids, values), want)
    assert torch.equal(ht.HeadKLLoss(weight, backend="reference")(hidden, ids, values), want)
    ht.topk(hidden, weight, 3, backend="reference")
    (said,) = said_f32(fresh)
    assert "3e-4" in said and "65504" in said and "f32_inputs='error'" in said, said
    assert [r.levelno for r in fresh.records if r.getMessage() == said] == [logging.INFO]


def test_f32_inputs_error_refuses_float32_saying_how_to_choose():
    weight, hidden, ids, values, _, _ = problem(1)
    def how(name):
        return (
            rf"^{name}: float32, and f32_inputs='error' refuses it: headkl computes float32 hidden rows and heads "
            rf"as float16 \(.*\); pass {name}\.half\(\) or {name}\.bfloat16\(\), or f32_inputs='f16'"
        )

    with pytest.raises(TypeError, match=how("weight")):
        ht.HeadKLLoss(weight, f32_inputs="error", backend="reference")
    loss_fn = ht.HeadKLLoss(weight.half(), f32_inputs="error", backend="reference")
    with pytest.raises(TypeError, match=how("hidden")):
        loss_fn(hidden, ids, values)
    with pytest.raises(TypeError, match="^hidden: float32"):
        ht.topk(hidden, weight.half(), 3, f32_inputs="error", backend="reference")
    with pytest.raises(TypeError, match="^weight: float32"):
        ht.gather(hidden.half(), weight, ids, f32_inputs="error", backend="reference")
    w, tw, h, th, _ = full_vocab_problem()
    with pytest.raises(TypeError, match="^teacher_weight: float32"):
        ht.FullVocabKLLoss(w.half(), tw, f32_inputs="error", backend="reference")
    full = ht.FullVocabKLLoss(w.half(), tw.half(), f32_inputs="error", backend="reference")
    with pytest.raises(TypeError, match="^teacher_hidden: float32"):
        full(h.half(), th)
    assert torch.isfinite(full(h.half(), th.bfloat16()))
    with pytest.raises(ValueError, match="^f32_inputs='f32': expected one of f16, error"):
        ht.HeadKLLoss(weight, f32_inputs="f32")
    assert "f32_inputs='error'" in repr(loss_fn)
    assert "f32_inputs" not in repr(ht.HeadKLLoss(weight, backend="reference"))  # the default is not shown
    assert "f32_inputs='error'" in repr(full) and "f32_inputs='error'" in repr(loss_fn.head)


def test_a_value_past_float16s_range_is_refused_with_how_to_scale():
    weight, hidden, ids, values, _, _ = problem(2)
    loss_fn = ht.HeadKLLoss(weight, backend="reference")
    big = hidden.clone()
    big[1, 2, 3] = 1e5
    scale = r"f32_inputs='f16'.*±65504.*hidden / 2\*\*s with logit_scale=2\*\*s"
    with pytest.raises(ValueError, match=r"^hidden\[9\]: the row's logits are not finite.*float32.*" + scale):
        loss_fn(big, ids, values)
    with pytest.raises(ValueError, match=r"^hidden\[9\].*bfloat16, which headkl computes as float16"):
        loss_fn(big.bfloat16(), ids, values)
    with pytest.raises(ValueError, match=r"^hidden\[9\].*" + scale):
        ht.topk(big, weight, 3, backend="reference")
    head = weight.clone()
    head[17, 3] = -1e5
    refused = r"^weight\[17\]\[3\] = -100000 is outside f16's range.*f32_inputs='f16'.*weight / 2\*\*s and logit_scale"
    with pytest.raises(ValueError, match=refused):
        ht.HeadKLLoss(head, backend="reference")
    # A NaN is no range matter: no scaling hint.
    nan = hidden.clone()
    nan[1, 2, 3] = float("nan")
    with pytest.raises(ValueError) as info:
        loss_fn(nan, ids, values)
    assert "logit_scale" not in str(info.value)


def test_the_scaling_the_message_names_gives_the_same_loss():
    weight, hidden, ids, values, _, _ = problem(3)
    x = hidden.clone().requires_grad_()
    want = ht.HeadKLLoss(weight, backend="reference")(x, ids, values)
    want.backward()
    y = hidden.clone().requires_grad_()
    got = ht.HeadKLLoss(weight / 8, logit_scale=32.0, backend="reference")(y / 4, ids, values)
    got.backward()
    close(got.reshape(1), want.detach().double().reshape(1), "loss", rel=1e-6)
    close(y.grad, x.grad.double(), "hidden.grad", rel=1e-3)


def test_the_teachers_bad_row_is_named_as_the_teachers():
    w, tw, h, th, _ = full_vocab_problem()
    full = ht.FullVocabKLLoss(w, tw, backend="reference")
    bad = th.clone()
    bad[0, 4, 2] = 1e5
    with pytest.raises(ValueError, match=r"^teacher_hidden\[4\]: .*teacher_hidden is float32.*teacher_weight"):
        full(h, bad)
    bad[0, 4, 2] = float("inf")
    with pytest.raises(ValueError, match=r"^teacher_hidden\[4\]: the row's logits are not finite"):
        full(h, bad)
    student = h.clone()
    student[0, 4, 2] = float("nan")
    with pytest.raises(ValueError, match=r"^hidden\[4\]: the row's logits are not finite"):
        full(student, th)
