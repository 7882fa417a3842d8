"""SFT's per-token loss (logsumexp minus the target's logit) against the log-softmax it
replaces: the same values and the same gradients, at large logits and vocabularies too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.trainer import sft


def _log_softmax_nll(logits, targets):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


@pytest.mark.parametrize("vocab,scale", [(7, 1.0), (4096, 1.0), (4096, 80.0)])
def test_target_nll_is_the_log_softmax_nll(vocab, scale):
    rng = np.random.default_rng(vocab)
    logits = jnp.asarray(rng.standard_normal((2, 5, vocab)) * scale, jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (2, 5)), jnp.int32)
    got, want = sft.target_nll(logits, targets), _log_softmax_nll(logits, targets)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert bool(jnp.all(got >= 0))
    weights = jnp.asarray(rng.random((2, 5)), jnp.float32)
    g_got = jax.grad(lambda x: jnp.sum(sft.target_nll(x, targets) * weights))(logits)
    g_want = jax.grad(lambda x: jnp.sum(_log_softmax_nll(x, targets) * weights))(logits)
    np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-6)
