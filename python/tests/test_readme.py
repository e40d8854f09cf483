"""The README's PyTorch snippets run as written, with the tensors they
name made first (a user's first minutes)."""

import os
import re
import textwrap

import torch

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")

PRELUDE = """
import torch
import headkl.torch
torch.manual_seed(0)
lm_head = torch.nn.Linear(32, 512, bias=False)
teacher_hidden = torch.randn(2, 8, 32)
hidden = torch.randn(2, 8, 32, requires_grad=True)
teacher_ids, teacher_probs = headkl.torch.topk(teacher_hidden, lm_head.weight, 16)
"""


def snippets():
    """The ```python blocks of the section "Use it from PyTorch" (a block
    inside a list item dedented)."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Use it from PyTorch") :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", section, flags=re.S | re.M)
    return [textwrap.dedent(body) for _, body in blocks]


def run(snippet):
    scope = {}
    exec(compile(PRELUDE + snippet, "README.md", "exec"), scope)
    return scope


def test_the_readme_snippet_runs():
    scope = run(snippets()[0])
    assert scope["hidden"].grad is not None and scope["hidden"].grad.abs().sum() > 0
    assert scope["loss"].dim() == 0 and torch.isfinite(scope["loss"])
    assert scope["top"].ids.shape == (2, 8, 64)
    assert torch.isfinite(scope["lp"].logprobs).all()


def test_the_trainable_tied_and_frozen_head_snippet_runs():
    blocks = snippets()
    assert len(blocks) == 2, len(blocks)
    scope = run(blocks[0] + blocks[1])  # in order, as a reader runs them
    assert scope["lm_head"].weight.grad is not None and scope["lm_head"].weight.grad.abs().sum() > 0
    embed = scope["embed"]
    assert embed.weight.grad is not None and embed.weight.grad.abs().sum() > 0
    # The head's share reaches rows no token looked up (the lookup's alone would not).
    unused = torch.ones(embed.weight.shape[0], dtype=torch.bool)
    unused[scope["tokens"].reshape(-1)] = False
    assert embed.weight.grad[unused].abs().sum() > 0
    assert scope["tied_fn"].head._uploads == 2
    assert not scope["frozen_fn"].head._weight.requires_grad
