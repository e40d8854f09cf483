"""Misuse is a Python exception naming the argument, raised before the
device; a KeyboardInterrupt leaves the engine usable."""

import signal
import threading
import _thread

import pytest
import torch

import headkl
import headkl.torch as ht
from test_loss import HS, V, problem


@pytest.fixture
def setup():
    weight, hidden, ids, values, labels, weights = problem(1)
    return ht.HeadKLLoss(weight, backend="reference"), hidden, ids, values, labels


def test_wrong_dtype_names_the_argument(setup):
    loss_fn, hidden, ids, values, _ = setup
    with pytest.raises(TypeError, match="hidden"):
        loss_fn(hidden.long(), ids, values)
    with pytest.raises(TypeError, match="teacher_ids"):
        loss_fn(hidden, ids.float(), values)
    with pytest.raises(TypeError, match="teacher_values"):
        loss_fn(hidden, ids, values.long())
    with pytest.raises(TypeError, match="hidden"):
        loss_fn(hidden.tolist(), ids, values)


def test_wrong_shape_names_the_argument(setup):
    loss_fn, hidden, ids, values, labels = setup
    with pytest.raises(ValueError, match="hidden"):
        loss_fn(hidden[..., :-1], ids, values)
    with pytest.raises(ValueError, match="teacher_values"):
        loss_fn(hidden, ids, values[..., :-1])
    with pytest.raises(ValueError, match="teacher_ids"):
        loss_fn(hidden, ids[:1], values[:1])
    with pytest.raises(ValueError, match="labels"):
        loss_fn(hidden, ids, values, labels=labels[:1])
    with pytest.raises(ValueError, match="weights"):
        loss_fn(hidden, ids, values, weights=torch.ones(5))


def test_wrong_device_names_the_argument(setup):
    loss_fn, hidden, ids, values, _ = setup
    with pytest.raises(TypeError, match="hidden"):
        loss_fn(hidden.to("meta"), ids, values)


def test_bad_values_name_what_is_wrong(setup):
    loss_fn, hidden, ids, values, _ = setup
    bad = ids.clone()
    bad[0, 0, 0] = V
    with pytest.raises(ValueError, match=rf"^teacher_ids\[0\]\[0\] = {V} is out of range"):
        loss_fn(hidden, bad, values)
    neg = values.clone()
    neg[0, 0, 0] = -0.5
    with pytest.raises(ValueError, match=r"^teacher_values\[0\]\[0\] = -0.5 is negative"):
        loss_fn(hidden, ids, neg)
    nan = hidden.clone()
    nan[1, 2, 3] = float("nan")
    # Rows are counted over the flattened leading dimensions: (1, 2) of (3, 7) is row 9.
    with pytest.raises(ValueError, match=r"^hidden\[9\].*not finite"):
        loss_fn(nan, ids, values)


def test_bad_options_are_refused_before_the_device():
    weight = problem(1)[0]
    for kw, name in [
        (dict(reduction="avg"), "reduction"),
        (dict(tail="drop"), "tail"),
        (dict(divergence="tv"), "divergence"),
        (dict(temperature=0.0), "temperature"),
        (dict(label_smoothing=1.5), "label_smoothing"),
        (dict(teacher_temperature=-1.0), "teacher_temperature"),
        (dict(weight_hard_loss=-1.0), "hard_weight"),
        (dict(backend="metal"), "backend"),
        (dict(shard=(0, 100), vocab_size=V, divergence="reverse"), "divergence"),
    ]:
        with pytest.raises(ValueError, match=name):
            ht.HeadKLLoss(weight if "shard" not in kw else weight[:100], **kw)
    with pytest.raises(ValueError, match="shard"):
        ht.HeadKLLoss(weight, shard=(0, 100), vocab_size=V)
    with pytest.raises(ValueError, match="weight"):
        ht.HeadKLLoss(weight[0])


def test_hard_term_without_labels_is_refused(setup):
    weight = problem(1)[0]
    _, hidden, ids, values, _ = setup
    loss_fn = ht.HeadKLLoss(weight, weight_hard_loss=1.0, backend="reference")
    with pytest.raises(ValueError, match="label"):
        loss_fn(hidden, ids, values)


def test_keyboard_interrupt_leaves_the_engine_usable():
    weight, hidden, ids, values, _, _ = problem(2, lead=(512,))
    loss_fn = ht.HeadKLLoss(weight, backend="reference")
    want = loss_fn(hidden, ids, values).item()
    # A process started in the background (`cmd &`, as a CI job may be)
    # inherits SIGINT ignored, and then a simulated Ctrl-C does nothing:
    # Python's own handler is installed for the test's duration.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    # Python may take a simulated Ctrl-C inside a finalizer, where it is
    # printed and dropped: send it again until one reaches the calls (the
    # timer joined inside the try, so a late one lands there too).
    interrupted = False
    try:
        for _ in range(20):
            timer = threading.Timer(0.05, _thread.interrupt_main)
            timer.start()
            try:
                for _ in range(2_000):
                    loss_fn(hidden, ids, values)
                timer.join()
            except KeyboardInterrupt:
                interrupted = True
            timer.cancel()
            if interrupted:
                break
    finally:
        signal.signal(signal.SIGINT, previous)
    assert interrupted
    assert loss_fn(hidden, ids, values).item() == want


def test_device_error_is_a_runtime_error():
    assert issubclass(headkl.DeviceError, RuntimeError)


def test_teacher_values_that_require_grad_are_said_to_get_none(caplog):
    """Teacher values that require grad get no gradient (the teacher is a
    fixed target): said once on the headkl logger, and the loss and the
    rows' gradient are those of the detached values."""
    import logging

    import headkl._checks

    caplog.set_level(logging.WARNING, logger="headkl")
    headkl._checks._said_teacher_no_grad = False
    weight, hidden, ids, values, _, _ = problem(3)
    loss_fn = ht.HeadKLLoss(weight, backend="reference")
    live = values.clone().requires_grad_()
    for _ in range(2):
        x = hidden.clone().requires_grad_()
        loss = loss_fn(x, ids, live)
        loss.backward()
    assert live.grad is None
    y = hidden.clone().requires_grad_()
    want = loss_fn(y, ids, values)
    want.backward()
    assert loss.item() == want.item() and torch.equal(x.grad, y.grad)
    said = [r.getMessage() for r in caplog.records if "teacher_values requires grad" in r.getMessage()]
    assert len(said) == 1, said


def test_log_probabilities_passed_as_probabilities_say_teacher_form():
    weight, hidden, ids, values, _, _ = problem(4)
    loss_fn = ht.HeadKLLoss(weight, backend="reference")
    hint = r"^teacher_values\[0\]\[0\] = .* is negative: teacher_values look like log-probabilities .*"
    hint += "teacher_form='logprobs'"
    with pytest.raises(ValueError, match=hint):
        loss_fn(hidden, ids, values.log())
    mixed = values.clone()
    mixed[0, 0, 0] = -0.5
    with pytest.raises(ValueError, match=r"is negative; if teacher_values are log-probabilities, pass teacher_form="):
        loss_fn(hidden, ids, mixed)
    as_logprobs = ht.HeadKLLoss(weight, teacher_form="logprobs", backend="reference")
    with pytest.raises(ValueError, match=r"^teacher_values\[0\]\[0\].*look like probabilities: .*teacher_form='probs'"):
        as_logprobs(hidden, ids, values)


def test_a_bad_head_value_names_the_argument():
    """The caller's argument (``weight``, ``teacher_weight``), not the engine's ``head[17][3]``."""
    from test_head_refresh import full_vocab_problem

    weight = problem(1)[0]
    bad = weight.clone()
    bad[17, 3] = float("nan")
    with pytest.raises(ValueError, match=r"^weight\[17\]\[3\] = NaN is not finite$"):
        ht.HeadKLLoss(bad, backend="reference")
    with pytest.raises(ValueError, match=r"^weight\[17\]\[3\] = NaN"):
        ht.topk(torch.zeros(2, HS), bad, 3, backend="reference")
    # Changed after the upload: the re-read names it too.
    loss_fn = ht.HeadKLLoss(weight, backend="reference")
    _, hidden, ids, values, _, _ = problem(1)
    weight[2, 5] = float("inf")
    with pytest.raises(ValueError, match=r"^weight\[2\]\[5\] = inf is not finite"):
        loss_fn(hidden, ids, values)
    w, tw, _, _, _ = full_vocab_problem()
    tw[5, 1] = float("-inf")
    with pytest.raises(ValueError, match=r"^teacher_weight\[5\]\[1\] = -inf is not finite"):
        ht.FullVocabKLLoss(w, tw, backend="reference")


def test_auto_says_what_it_picked_and_why(caplog, monkeypatch):
    import logging

    import headkl._engine

    monkeypatch.setattr(headkl._engine, "_said_auto", set())
    caplog.set_level(logging.INFO, logger="headkl")
    loss_fn = ht.HeadKLLoss(problem(1)[0], backend="auto")
    picked = loss_fn.info["backend"]
    said = [r.getMessage() for r in caplog.records if "backend='auto' picked" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"headkl: backend='auto' picked {picked} ("), said
    assert [r.levelno for r in caplog.records if r.getMessage() == said[0]] == [logging.INFO]
    why = said[0].split("): ", 1)[1]
    assert len(why) > 20 and "headkl devices" in why, why
    # Once per device picked, not per head.
    ht.Head(problem(1)[0], backend="auto")
    assert sum("backend='auto' picked" in r.getMessage() for r in caplog.records) == 1
    # A named backend is no pick.
    monkeypatch.setattr(headkl._engine, "_said_auto", set())
    ht.Head(problem(1)[0], backend="reference")
    assert sum("backend='auto' picked" in r.getMessage() for r in caplog.records) == 1
