"""headkl under ``torch.compile``: where the running torch has
``torch.library.custom_op`` (torch >= 2.4) the losses, the top-k and the
gather are ``headkl::`` custom ops that ``torch.library.opcheck`` passes,
that ``torch.compile(fullgraph=True)`` traces with no graph break, and
that give the bits the ``torch.autograd.Function`` gives; on an older
torch the Function runs, and ``CUSTOM_OPS_REASON`` says why."""

import logging
import os

import pytest
import torch

import headkl.torch as ht
from headkl.ops import custom
from test_loss import CASES, HS, K, V, case_problem, close, problem

HAS_CUSTOM_OP = hasattr(torch.library, "custom_op")
TURNED_OFF = os.environ.get("HEADKL_CUSTOM_OPS", "").strip() == "0"
needs_ops = pytest.mark.skipif(
    not ht.CUSTOM_OPS, reason=f"no torch.compile tests: headkl's custom ops are off ({ht.CUSTOM_OPS_REASON})"
)


HEADS = [pytest.param(False, id="frozen"), pytest.param(True, id="trainable")]


def where_on(values):
    """The parameters of a test that needs the ops: all of them where the
    ops are on, else the first alone (one skip, with why, per test)."""
    values = list(values)
    return values if ht.CUSTOM_OPS else values[:1]


def force_function(monkeypatch):
    """The plain path (the autograd Function) for the rest of the context,
    as an older torch runs it."""
    monkeypatch.setattr(custom, "CUSTOM_OPS_REASON", "forced by the test")
    monkeypatch.setattr(custom, "_said_why_not", True)


# --- Which path runs, and why ------------------------------------------------


def test_the_path_in_use_is_said():
    assert isinstance(ht.CUSTOM_OPS, bool) and ht.CUSTOM_OPS is custom.CUSTOM_OPS
    if not HAS_CUSTOM_OP:
        # torch 1.13 (CI's Debian build): the Function, and why.
        assert ht.CUSTOM_OPS is False
        assert ht.CUSTOM_OPS_REASON == f"torch {torch.__version__} has no torch.library.custom_op (torch >= 2.4 has it)"
    elif TURNED_OFF:
        assert ht.CUSTOM_OPS is False and ht.CUSTOM_OPS_REASON == "HEADKL_CUSTOM_OPS=0 is set"
    else:
        assert ht.CUSTOM_OPS is True and ht.CUSTOM_OPS_REASON is None
        for name in ("head_kl_loss", "head_kl_head_grad", "full_vocab_kl_loss", "full_vocab_kl_head_grad", "topk",
                     "gather"):  # fmt: skip
            assert hasattr(torch.ops.headkl, name), name


def test_the_fallback_says_why_once_at_debug(caplog, capsys, monkeypatch):
    if ht.CUSTOM_OPS:
        force_function(monkeypatch)
    monkeypatch.setattr(custom, "_said_why_not", False)
    caplog.set_level(logging.DEBUG, logger="headkl")
    weight, hidden, ids, values, _, _ = problem(3)
    loss_fn = ht.HeadKLLoss(weight, backend="reference")
    for _ in range(3):
        loss_fn(hidden.clone().requires_grad_(), ids, values).backward()
    said = [r for r in caplog.records if "no torch.library custom ops" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG, [r.getMessage() for r in said]
    assert custom.CUSTOM_OPS_REASON in said[0].getMessage()
    assert capsys.readouterr() == ("", "")


# --- The same bits and errors on both paths ----------------------------------


def run_case(case, trainable):
    """CASES[case] with a trainable or frozen head: the loss, hidden.grad
    and weight.grad (None for a frozen head) for an upstream gradient of 3,
    or per token an uneven one (negative, zero and positive)."""
    opts, (weight, hidden, ids, values), call = case_problem(case)
    w = weight.clone().requires_grad_(trainable)
    x = hidden.clone().requires_grad_()
    loss_fn = ht.HeadKLLoss(w, backend="reference", **opts)
    loss = loss_fn(x, ids, values, **call)
    # The op's autograd node on its path, the Function's on the other.
    op_path = custom._custom_op_for(loss_fn.head, loss_fn.options)
    assert ("GeneratedBackwardFor_headkl_head_kl_loss" in autograd_nodes(loss)) == op_path
    assert ("_HeadKLFunctionBackward" in autograd_nodes(loss)) != op_path
    upstream = torch.linspace(-1.0, 2.0, loss.numel()).reshape(loss.shape) if loss.dim() else 3.0
    (loss * upstream).sum().backward()
    return loss.detach(), x.grad, w.grad


def autograd_nodes(t, depth=3):
    """The names of the autograd nodes within ``depth`` of ``t``."""
    names, level = [], [t.grad_fn]
    for _ in range(depth):
        level = [n for n in level if n is not None]
        names += [type(n).__name__ for n in level]
        level = [m for n in level for m, _ in n.next_functions]
    return " ".join(names)


@needs_ops
@pytest.mark.parametrize("trainable", where_on(HEADS))
@pytest.mark.parametrize("case", where_on(sorted(CASES)))
def test_the_custom_op_gives_the_functions_bits(case, trainable, monkeypatch):
    got = run_case(case, trainable)
    with monkeypatch.context() as m:
        force_function(m)
        want = run_case(case, trainable)
    for g, w, what in zip(got, want, ("loss", "hidden.grad", "weight.grad")):
        assert (g is None) == (w is None) and (g is None or torch.equal(g, w)), what


@needs_ops
def test_the_custom_op_raises_the_functions_errors(monkeypatch):
    weight, hidden, ids, values, _, _ = problem(3)
    bad = ids.clone()
    bad[0, 1, 2] = V
    messages = []
    for plain in (False, True):
        with monkeypatch.context() as m:
            if plain:
                force_function(m)
            loss_fn = ht.HeadKLLoss(weight.clone().requires_grad_(), backend="reference")
            with pytest.raises(ValueError) as e:
                loss_fn(hidden, bad, values)
            messages.append(str(e.value))
            x = hidden.clone().requires_grad_()
            (g,) = torch.autograd.grad(loss_fn(x, ids, values), x, create_graph=True)
            with pytest.raises(RuntimeError, match="trying to differentiate twice"):
                g.pow(2).sum().backward()
    assert messages[0] == messages[1] and "out of range" in messages[0], messages


# --- torch.library.opcheck ---------------------------------------------------


def op_cases():
    """(op name, arguments) for each op: frozen and trainable heads, every
    reduction kind, labels and weights given."""
    weight, hidden, ids, values, labels, weights = problem(5, lead=(6,))
    cases, keep = [], []  # the heads stay alive with their handles
    for reduction in ("mean", "none"):
        for trainable in (False, True):
            loss_fn = ht.HeadKLLoss(weight.clone().requires_grad_(trainable), backend="reference",
                                    reduction=reduction, weight_hard_loss=0.5, filter_eps="auto")  # fmt: skip
            keep.append(loss_fn)
            head, opts = loss_fn.head, custom._option_args(loss_fn.options)
            w = head._weight if trainable else head._weight.detach()
            rows = (hidden.clone().requires_grad_(), ids, values, labels, weights, w, head._handle)
            total = 4.5 if reduction == "mean" else None
            cases.append((f"head_kl_loss-{reduction}-{trainable}", "head_kl_loss", (*rows, total, trainable, *opts)))
            if trainable and reduction == "none":
                unit = torch.randn(V, HS)
                grad = torch.linspace(-1.0, 2.0, 6)
                # The backward's op, called under no_grad: its rows need no gradient.
                plain = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in rows)
                cases.append(("head_kl_head_grad", "head_kl_head_grad", (*plain, unit, grad, *opts)))
    teacher_weight = weight[:, :24].contiguous()
    full = ht.FullVocabKLLoss(weight.clone().requires_grad_(), teacher_weight, backend="reference", reduction="none")
    opts = custom._option_args(full.options)
    rows = (hidden, hidden[:, :24].contiguous(), teacher_weight, None, weights, full.head._weight.detach(),
            full.head._handle)  # fmt: skip
    cases.append(("full_vocab_kl_head_grad", "full_vocab_kl_head_grad",
                  (*rows, torch.randn(V, HS), torch.linspace(-1.0, 2.0, 6), *opts)))  # fmt: skip
    rows = (hidden.clone().requires_grad_(), *rows[1:5], full.head._weight, full.head._handle)
    cases.append(("full_vocab_kl_loss", "full_vocab_kl_loss", (*rows, None, True, *opts)))
    head = ht.Head(weight, backend="reference")
    cases.append(("topk", "topk", (hidden, weight, head._handle, K, 1.5, 3.0, 1.0, True)))
    cases.append(("gather", "gather", (hidden, ids, weight, head._handle, 1.5, None, 1.0)))
    keep += [full, head]
    return [pytest.param(op, args, keep, id=name) for name, op, args in cases]


@needs_ops
@pytest.mark.parametrize("op,args,keep", where_on(op_cases()))
def test_opcheck(op, args, keep):
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    result = torch.library.opcheck(getattr(torch.ops.headkl, op).default, args, test_utils=utils)
    assert set(result.values()) == {"SUCCESS"}, result


# --- torch.compile(fullgraph=True) -------------------------------------------


class Student(torch.nn.Module):
    """A layer, then the head: frozen (``.detach()``) or trainable."""

    def __init__(self, weight, trainable, **opts):
        super().__init__()
        self.layer = torch.nn.Linear(HS, HS)
        self.lm_head = torch.nn.Linear(HS, weight.shape[0], bias=False)
        with torch.no_grad():
            self.layer.weight.copy_(torch.eye(HS) + 0.01 * torch.arange(HS * HS).reshape(HS, HS).sin())
            self.layer.bias.zero_()
            self.lm_head.weight.copy_(weight)
        head = self.lm_head.weight if trainable else self.lm_head.weight.detach()
        self.loss = ht.HeadKLLoss(head, backend="reference", **opts)

    def forward(self, x, ids, values, **call):
        return self.loss(torch.tanh(self.layer(x)), ids, values, **call)


def loss_and_grads(model, run):
    model.zero_grad(set_to_none=True)
    loss = run()
    upstream = torch.linspace(-1.0, 2.0, loss.numel()).reshape(loss.shape) if loss.dim() else 3.0
    (loss * upstream).sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_compiled(model, args, call, backend="aot_eager", dynamic=None):
    """The model compiled with fullgraph=True gives eager's loss and
    gradients, and dynamo sees one graph, unbroken."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(*args, **call)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    compiled = torch.compile(model, fullgraph=True, backend=backend, dynamic=dynamic)
    got_loss, got = loss_and_grads(model, lambda: compiled(*args, **call))
    want_loss, want = loss_and_grads(model, lambda: model(*args, **call))
    close(got_loss.reshape(-1), want_loss.double().reshape(-1), "loss", rel=1e-5)
    assert got.keys() == want.keys()
    for name in want:
        close(got[name], want[name].double(), name, rel=1e-5)
    return got


@needs_ops
@pytest.mark.parametrize("backend", where_on(["aot_eager", "inductor"]))
@pytest.mark.parametrize("trainable", where_on(HEADS))
@pytest.mark.parametrize("reduction", where_on(["mean", "none"]))
def test_compile_fullgraph_matches_eager(backend, trainable, reduction):
    weight, hidden, ids, values, labels, weights = problem(11)
    model = Student(weight, trainable, reduction=reduction, weight_hard_loss=0.3)
    grads = check_compiled(model, (hidden, ids, values), dict(labels=labels, weights=weights), backend)
    assert ("lm_head.weight" in grads) == trainable


@needs_ops
@pytest.mark.parametrize("case", where_on(sorted(CASES)))
def test_compile_fullgraph_takes_every_option(case):
    opts, (weight, hidden, ids, values), call = case_problem(case)
    check_compiled(Student(weight, True, **opts), (hidden, ids, values), call)


@needs_ops
def test_compile_with_a_mask_int32_ids_and_growing_batches():
    weight, hidden, ids, values, labels, _ = problem(4, lead=(2, 9))
    model = Student(weight, True, reduction="none", ignore_mask=True)
    for n in (5, 7, 9):  # a recompile for a new length, then a dynamic one
        mask = torch.arange(n).expand(2, n) % 3 != 0
        args = (hidden[:, :n], ids[:, :n].int(), values[:, :n])
        check_compiled(model, args, dict(labels=labels[:, :n], weights=mask), dynamic=None if n < 9 else True)


@needs_ops
def test_compiled_training_follows_the_head_step_for_step():
    """A trainable head changed by each optimizer step (outside the graph)
    is read again by the op at the next compiled call: the compiled student
    trains as the eager one does."""
    weight, hidden, ids, values, _, _ = problem(8)
    losses = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = Student(weight, True)
        run = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        steps = []
        for _ in range(4):
            opt.zero_grad()
            loss = run(hidden, ids, values)
            loss.backward()
            opt.step()
            steps.append(loss.item())
        losses.append(steps)
        assert model.loss.head._uploads == 4  # once when made, then after each step but the last
    assert losses[0][-1] < losses[0][0]
    close(torch.tensor(losses[1]), torch.tensor(losses[0]).double(), "losses", rel=1e-5)


@needs_ops
def test_compile_fullgraph_full_vocab_topk_and_gather():
    weight, hidden, _, _, _, weights = problem(9)
    teacher_weight = weight[:, :24].flip(0).contiguous()

    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(HS, HS)
            self.lm_head = torch.nn.Parameter(weight.clone())
            self.full = ht.FullVocabKLLoss(self.lm_head, teacher_weight, backend="reference", beta=0.3)
            self.teacher = ht.Head(teacher_weight, backend="reference")

        def forward(self, x, teacher_hidden, weights):
            top = self.teacher.topk(teacher_hidden, K, temperature=1.5)
            again = self.teacher.gather(teacher_hidden, top.ids, temperature=1.5)
            h = self.layer(x)
            return self.full(h, teacher_hidden, weights=weights) + (top.values - again.logprobs.exp()).abs().sum()

    model = Both()
    check_compiled(model, (hidden, hidden[..., :24] * 2, weights), {})
