"""The vocabulary projection over only the last positions (``last_positions``), for the
log-probs of completions.

A forward pass projects every position's hidden state onto the vocabulary: ``[B, T, D]``
x ``[D, V]``, with V in the tens of thousands the largest matmul of a small model, and its
``[B, T, V]`` logits (and their float32 casts and gradient) the largest arrays of a step. The
log-probs of a completion read the logits of its K tokens' previous positions only:
Tunix's ``compute_per_token_logps`` slices ``logits[:, -K-1:-1]``, so a learner that runs
the whole prompt + completion projects the prompt's positions for nothing (41% of them in
the calculator example: 104 prompt and 152 completion tokens).

``last_positions(model, n)`` is a view of ``model`` whose final norm keeps only the last
``n`` positions of the hidden states, so the head (``embedder.decode`` or ``lm_head``,
then Gemma 2's logit soft cap) projects those alone and the model returns ``[B, n, V]``
logits. With ``n = K + 1`` Tunix's ``[-K-1:-1]`` slice keeps the very rows it kept of the
full logits (the one projected row it drops is the completion's last position). The norm
works on each position by itself (RMSNorm), so every kept logit is the number the full
projection gives; in the backward pass the positions left out get no cotangent from the
head, as they got zeros before. Not for packed sequences (Tunix's ``segment_ids``), whose
log-probs read every position.

Every family posttrain loads (``families``) ends ``x = self.final_norm(x)``, then the
head: the view gives its norm a subclass of the norm's class whose call slices first, as
``remat`` gives the decoder layers theirs. Parameter paths, checkpoints and LoRA targets
are unchanged (they name attributes, not classes), and ``model`` itself is left as it was:
the view is new modules over its Variables (as ``generation.without_remat``'s), made
inside the traced function, so gradients flow to ``model``'s params.
"""

from __future__ import annotations

import functools
from typing import Any

from flax import nnx


@functools.cache
def _keeping_last(cls: type, n: int) -> type:
    def __call__(self, x: Any, *args: Any, **kwargs: Any):  # noqa: N807 - the module's call
        return cls.__call__(self, x[:, -n:], *args, **kwargs)

    return type(cls.__name__, (cls,), {"__call__": __call__, "posttrain_last_positions": n})


def last_positions(model: nnx.Module, n: int) -> nnx.Module:
    """A view of ``model`` whose logits are those of its last ``n`` positions only
    (``[B, n, V]``; see the module's docstring)."""
    if n < 1:
        raise ValueError(f"last_positions: n must be at least 1, got {n}")
    if not isinstance(getattr(model, "final_norm", None), nnx.Module):
        raise TypeError(f"{type(model).__name__} has no final_norm before its head")
    view = nnx.merge(*nnx.split(model))
    cls = type(view.final_norm)
    if getattr(cls, "posttrain_last_positions", None):  # a view of a view
        cls = cls.__bases__[0]
    view.final_norm.__class__ = _keeping_last(cls, n)
    return view
