"""The package's layout: headkl.torch re-exports the same objects the
modules define, the public callables carry their own docs, py.typed ships,
and no source file outgrows one reader (400 lines)."""

import pathlib

import headkl
import headkl.functional
import headkl.head
import headkl.nn
import headkl.torch as ht

PACKAGE = pathlib.Path(headkl.__file__).parent


def test_headkl_torch_names_are_the_modules_objects():
    assert ht.HeadKLLoss is headkl.nn.HeadKLLoss
    assert ht.FullVocabKLLoss is headkl.nn.FullVocabKLLoss
    assert ht.Head is headkl.head.Head
    assert ht.topk is headkl.functional.topk
    assert ht.gather is headkl.functional.gather
    for name in ht.__all__:
        assert hasattr(ht, name), name


def test_public_callables_have_their_own_docs():
    for cls in (ht.HeadKLLoss, ht.FullVocabKLLoss):
        assert cls.__doc__ and cls.forward.__doc__, cls
        # Not torch's generic nn.Module.forward text.
        assert "Define the computation performed at every call" not in cls.forward.__doc__
    functional = (headkl.functional.head_kl_loss, headkl.functional.full_vocab_kl_loss)
    for fn in (ht.topk, ht.gather, ht.Head.topk, ht.Head.gather, headkl.devices, headkl.check) + functional:
        assert fn.__doc__, fn


def test_py_typed_ships_and_no_file_is_over_400_lines():
    assert (PACKAGE / "py.typed").is_file()
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, long


def test_the_modules_show_their_options():
    import torch

    w = torch.randn(64, 8)
    r = repr(ht.HeadKLLoss(w, temperature=2.0, tail="bucket", backend="reference"))
    assert r.startswith("HeadKLLoss(") and "temperature=2.0" in r and "tail='bucket'" in r, r
    assert "backend='reference'" in r, r
    r = repr(ht.FullVocabKLLoss(w, torch.randn(64, 4), divergence="forward", weight_soft_loss=0.5, backend="reference"))
    assert r.startswith("FullVocabKLLoss(vocab_size=64, hidden_size=8, teacher_hidden_size=4,"), r
    assert "divergence='forward'" in r and "weight_soft_loss=0.5" in r and "beta=0.5" in r, r
    assert "ignore_index" not in r and "f32_inputs" not in r, r  # defaults not shown
