"""The functional losses, the head given per call as Liger-Kernel's
functional losses take it: ``head_kl_loss(input, weight, teacher_ids,
teacher_values)`` and ``full_vocab_kl_loss(input, weight, teacher_input,
teacher_weight, shift_labels)`` give the modules' loss and gradients (to
the rows, and to a head that requires grad)."""

import pytest
import torch

import headkl.functional as F
import headkl.torch as ht
from test_head_refresh import full_vocab_problem
from test_loss import problem


def grads(fn, hidden, weight):
    """``fn(x, w)``'s value and the gradients of ``x`` (hidden) and of ``w``
    (weight as a trainable leaf)."""
    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = fn(x, w)
    loss.sum().backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("kw", [{}, dict(temperature=2.0, tail="bucket", reduction="none"), dict(divergence="jsd")])
def test_head_kl_loss_is_the_modules(kw):
    weight, hidden, ids, values, labels, weights = problem(5)
    call = dict(weights=weights, labels=labels)

    def module(x, w):
        return ht.HeadKLLoss(w, backend="reference", weight_hard_loss=0.5, **kw)(x, ids, values, **call)

    def functional(x, w):
        return F.head_kl_loss(x, w, ids, values, backend="reference", weight_hard_loss=0.5, **call, **kw)

    for got, want, what in zip(grads(functional, hidden, weight), grads(module, hidden, weight), "loss dx dw".split()):
        assert want is not None and torch.equal(got, want), what
    # A frozen head: the rows' gradient alone.
    x = hidden.clone().requires_grad_()
    F.head_kl_loss(x, weight, ids, values, backend="reference", **kw).sum().backward()
    assert x.grad is not None and weight.grad is None


@pytest.mark.parametrize("divergence,beta", [("jsd", 0.5), ("jsd", 0.2), ("forward", 0.5)])
def test_full_vocab_kl_loss_is_the_modules_in_ligers_argument_order(divergence, beta):
    weight, teacher_weight, hidden, teacher_hidden, weights = full_vocab_problem()
    kw = {} if (divergence, beta) == ("jsd", 0.5) else dict(divergence=divergence, beta=beta)

    def module(x, w):
        loss_fn = ht.FullVocabKLLoss(w, teacher_weight, temperature=1.5, backend="reference", **kw)
        return loss_fn(x, teacher_hidden, weights=weights)

    def functional(x, w):
        # Liger's order: student_input, student_weight, teacher_input, teacher_weight.
        kw_call = dict(temperature=1.5, weights=weights, backend="reference", **kw)
        return F.full_vocab_kl_loss(x, w, teacher_hidden, teacher_weight, **kw_call)

    for got, want, what in zip(grads(functional, hidden, weight), grads(module, hidden, weight), "loss dx dw".split()):
        assert want is not None and torch.equal(got, want), what


def test_shift_labels_leave_out_the_ignored_tokens_as_ligers_do():
    weight, teacher_weight, hidden, teacher_hidden, _ = full_vocab_problem()
    labels = torch.randint(8, weight.shape[0], hidden.shape[:-1])  # none is 7 but the one set below
    labels[0, :3] = -100
    labels[2, 1] = 7
    got = F.full_vocab_kl_loss(hidden, weight, teacher_hidden, teacher_weight, labels, backend="reference")
    keep = (labels != -100).float()
    want = ht.FullVocabKLLoss(weight, teacher_weight, backend="reference")(hidden, teacher_hidden, weights=keep)
    assert torch.allclose(got, want, rtol=1e-6), (got, want)
    ignore7 = F.full_vocab_kl_loss(
        hidden, weight, teacher_hidden, teacher_weight, shift_labels=labels, ignore_index=7, backend="reference"
    )
    keep[2, 1] = 0.0
    want = ht.FullVocabKLLoss(weight, teacher_weight, backend="reference")(hidden, teacher_hidden, weights=keep)
    assert torch.allclose(ignore7, want, rtol=1e-6), (ignore7, want)
    with pytest.raises(ValueError, match="shift_labels"):
        F.full_vocab_kl_loss(hidden, weight, teacher_hidden, teacher_weight, labels, labels=labels)


def test_the_functional_losses_check_as_the_modules_do():
    weight, hidden, ids, values, _, _ = problem(6)
    with pytest.raises(ValueError, match="reduction"):
        F.head_kl_loss(hidden, weight, ids, values, reduction="avg")
    with pytest.raises(ValueError, match="teacher_values"):
        F.head_kl_loss(hidden, weight, ids, values[..., :-1], backend="reference")
    w, tw, h, th, _ = full_vocab_problem()
    with pytest.raises(ValueError, match="teacher_weight: requires grad"):
        F.full_vocab_kl_loss(h, w, th, tw.clone().requires_grad_(), backend="reference")


def test_a_second_derivative_raises_pytorchs_error():
    """As the modules' (test_head_refresh.py): differentiable once, a gradient penalty raises."""
    weight, teacher_weight, hidden, teacher_hidden, _ = full_vocab_problem()
    _, _, ids, values, _, _ = problem(13)
    for loss_of in (
        lambda x: F.head_kl_loss(x, weight, ids, values, backend="reference"),
        lambda x: F.full_vocab_kl_loss(x, weight, teacher_hidden, teacher_weight, backend="reference"),
    ):
        x = hidden.clone().requires_grad_()
        (g,) = torch.autograd.grad(loss_of(x), x, create_graph=True)
        with pytest.raises(RuntimeError, match="trying to differentiate twice"):
            g.pow(2).sum().backward()
