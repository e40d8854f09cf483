"""The README's PyTorch snippet runs as written, with the tensors it
names made first (a user's first minutes)."""

import os

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


def test_the_readme_snippet_runs():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Use it from PyTorch") :]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    scope = {}
    exec(compile(PRELUDE + snippet, "README.md", "exec"), scope)
    assert scope["hidden"].grad is not None and scope["hidden"].grad.abs().sum() > 0
    assert scope["loss"].dim() == 0 and torch.isfinite(scope["loss"])
    assert scope["top"].ids.shape == (2, 8, 64)
    assert torch.isfinite(scope["lp"].logprobs).all()
