"""Flash attention (posttrain.trainer.models.attention) against Tunix's dense attention.

On CPU the splash kernel runs in Pallas's interpret mode (``splash_interpret``) and the
cuDNN path through jax.nn.dot_product_attention's XLA implementation (``xla``): the same
masks, segment ids, windows and soft caps as on a TPU or GPU. The committed tiny
checkpoint of every family (tests/trainer/fixtures) runs packed rows of 256 tokens.
The TPU compiles use libtpu's compile-only devices (no TPU).
"""

from __future__ import annotations

import importlib.util
import os

import data_helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import FIXTURES

from posttrain.trainer import compile_figures, lora, models, sft
from posttrain.trainer.models import attention

pytestmark = pytest.mark.trainer

LENGTH = 256
# Row 0 packs three examples (the third starts past Gemma's 4-token window) and padding;
# row 1 holds one example and padding.
PACKED = ((100, 90, 40), (200,))


def packed_batch(vocab: int, rows=PACKED, length: int = LENGTH, seed: int = 0) -> dict:
    return data_helpers.packed_batch(vocab, rows, length, seed)


def load(fixture: str, kernel: str = "dense"):
    return models.load_model(FIXTURES / fixture, dtype=jnp.float32, attention=kernel)


def logits_of(model, batch: dict, mask) -> np.ndarray:
    out, _ = nnx.jit(lambda m, b, k: m(b["input_ids"], b["positions"], None, k))(model, batch, mask)
    return np.asarray(out)


def alone(model, batch: dict) -> np.ndarray:
    """Each example's logits from a dense run of that example alone (unpacked, at the
    start of its own row): what packed attention must reproduce."""
    seg = np.asarray(batch["segment_ids"])
    out = None
    for r in range(seg.shape[0]):
        for s in set(seg[r].tolist()) - {0}:
            where = np.flatnonzero(seg[r] == s)
            logits = np.asarray(
                models.forward(model, np.asarray(batch["input_ids"])[r, where][None])
            )
            if out is None:
                out = np.zeros((*seg.shape, logits.shape[-1]), np.float32)
            out[r, where] = logits[0]
    return out


@pytest.mark.parametrize("fixture", ["llama3", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3-mha"])
def test_packed_rows_match_each_example_alone(fixture: str) -> None:
    """Splash (interpret mode) and the cuDNN path (XLA) over packed rows give every real
    token the logits of its example run alone, dense: attention stays inside an example
    and, on Gemma's local layers, inside the window."""
    model, info = load(fixture)
    batch = packed_batch(info.vocab_size)
    expected = alone(model, batch)
    real = np.asarray(batch["segment_ids"]) != 0
    for kernel in ("splash_interpret", "xla"):
        attention.install(model, kernel)
        got = logits_of(model, batch, batch["segment_ids"])
        np.testing.assert_allclose(got[real], expected[real], rtol=2e-4, atol=2e-4)
    attention.install(model, "dense")


@pytest.mark.parametrize("fixture", ["llama3", "qwen3", "gemma3"])
def test_sft_loss_and_gradients_match_dense(fixture: str) -> None:
    """sft.token_nll with the splash kernel (segment ids) equals the dense step's loss,
    and so do its gradients (splash's backward kernels, interpret mode)."""
    dense, info = load(fixture)
    flash, _ = load(fixture, "splash_interpret")
    assert attention.kernel_of(flash) == "splash_interpret"
    batch = packed_batch(info.vocab_size)

    def loss(model, batch):
        total, count = sft.token_nll(model, batch)
        return total / count

    grad = nnx.jit(nnx.value_and_grad(loss))
    (l_dense, g_dense), (l_flash, g_flash) = grad(dense, batch), grad(flash, batch)
    assert abs(float(l_dense) - float(l_flash)) < 1e-5 * abs(float(l_dense))
    for a, b in zip(jax.tree.leaves(g_dense), jax.tree.leaves(g_flash), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-3, atol=1e-6)


def test_dense_masks_and_kv_cache_keep_tunix_path() -> None:
    """With a kernel installed, a [B, L, L] mask (what generation and Tunix's RL code
    pass) and KV-cache decoding still run Tunix's dense code: greedy tokens unchanged."""
    dense, info = load("gemma3")
    flash, _ = load("gemma3", "splash_interpret")
    prompt = [5, 17, 3, 99, 42, 7]
    want = models.greedy_generate(dense, None, prompt, 8).token_ids
    assert models.greedy_generate(flash, None, prompt, 8).token_ids == want
    ids = np.asarray(packed_batch(info.vocab_size)["input_ids"])[:1, :40]
    np.testing.assert_array_equal(models.forward(flash, ids), models.forward(dense, ids))


def test_decode_lengths_cover_the_cache_in_few_static_lengths() -> None:
    assert attention.decode_lengths(64) == [64]
    assert attention.decode_lengths(140) == [128, 140]
    assert attention.decode_lengths(576) == [128, 256, 384, 512, 576]
    lengths = attention.decode_lengths(32768)
    assert len(lengths) == attention.DECODE_BUCKETS and lengths[-1] == 32768
    assert all(n % 128 == 0 for n in lengths)


def test_decode_attention_over_the_filled_slots_is_attention_over_the_cache() -> None:
    """Each decode length (and a cache that wrapped: every slot filled) gives what the
    query over the whole masked cache gives; slots past the filled ones hold garbage that
    must not be read."""
    b, size, heads, kv, h = 3, 300, 4, 2, 16
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, 1, heads, h))
    k = jax.random.normal(keys[1], (b, size, kv, h))
    v = jax.random.normal(keys[2], (b, size, kv, h))
    slots = jnp.arange(size)
    decode = jax.jit(attention.decode_attend)
    for filled in (1, 127, 128, 129, 256, 299, 300, 301 + size):
        mask = jnp.broadcast_to(slots < min(filled, size), (b, 1, size))
        # a row whose prompt was padded (a step's own new slot is always visible)
        mask = mask.at[1, 0, : min(2, filled - 1)].set(False)
        garbage = jnp.where(slots[None, :, None, None] < filled, k, 1e30)
        want = attention._masked(q, k, v, mask)
        got = decode(q, garbage, v, mask, filled)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fixture", ["llama3", "qwen3"])
def test_decoding_with_a_kernel_reads_the_filled_cache_with_the_same_tokens(fixture) -> None:
    """A decode step of a model with a kernel installed attends over the cache's filled
    slots (``decode_attend``): greedy tokens and logits as Tunix's dense decode, across
    the 128-slot boundary of a 140-slot cache."""
    dense, info = load(fixture)
    flash, _ = load(fixture, "splash_interpret")
    prompt = np.asarray(packed_batch(info.vocab_size)["input_ids"])[1, :120].tolist()
    want = models.greedy_generate(dense, None, prompt, 20)
    got = models.greedy_generate(flash, None, prompt, 20)
    assert got.token_ids == want.token_ids and len(got.token_ids) == 20
    calls = []
    decode_attend = attention.decode_attend
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "decode_attend", lambda *a: calls.append(1) or decode_attend(*a))
        models.greedy_generate(flash, None, prompt, 3)
    assert calls  # traced by each layer's decode step


def test_grpos_sampler_decodes_the_same_with_a_kernel_installed() -> None:
    """Tunix's sampler (GRPO's rollouts; prompts left-padded to its prompt length) gives
    the same greedy tokens through ``decode_attend``, across the 128-slot boundary."""
    from tunix.generate import sampler as tunix_sampler
    from tunix.rl.rollout import base_rollout

    from posttrain.trainer.sampler_memory import StubTokenizer

    outs = []
    for kernel in ("dense", "splash_interpret"):
        model, info = load("qwen3", kernel)
        ids = np.asarray(packed_batch(info.vocab_size)["input_ids"])[1, 2:122] + 2
        cache = base_rollout.CacheConfig(cache_size=150, num_layers=info.num_layers,
                                         num_kv_heads=info.num_kv_heads,
                                         head_dim=info.head_dim)  # fmt: skip
        sampler = tunix_sampler.Sampler(model, StubTokenizer(ids.tolist()), cache)
        out = sampler(["a", "b"], max_generation_steps=24, max_prompt_length=126,
                      eos_tokens=[-1])  # fmt: skip
        outs.append(out)
    dense, flash = outs
    assert [list(t) for t in flash.tokens] == [list(t) for t in dense.tokens]
    assert len(dense.tokens[0]) == 24


def test_kernel_survives_lora_and_views() -> None:
    """apply_lora, compute_view and without_remat keep the installed kernel, and a LoRA
    model's loss with splash equals its dense loss."""
    flash, info = load("qwen3", "splash_interpret")
    dense, _ = load("qwen3")
    batch = packed_batch(info.vocab_size)
    flash, dense = (lora.apply_lora(m, 4, 8.0, seed=3) for m in (flash, dense))
    for view in (flash, models.compute_view(flash), models.without_remat(flash)):
        assert attention.kernel_of(view) == "splash_interpret"
        assert all(type(layer.attn).posttrain_flash for layer in view.layers)
    assert attention.kernel_of(dense) == "dense"

    def loss(model, batch):
        total, count = sft.token_nll(model, batch)
        return total / count

    l_flash, l_dense = nnx.jit(loss)(flash, batch), nnx.jit(loss)(dense, batch)
    assert abs(float(l_flash) - float(l_dense)) < 1e-5 * abs(float(l_dense))


def test_a_length_splash_cannot_tile_falls_back_to_the_same_result() -> None:
    """A row length that is no multiple of 128 computes the masked attention in jnp."""
    model, info = load("llama3", "splash_interpret")
    batch = packed_batch(info.vocab_size, rows=((30, 40), (70,)), length=100)
    got = logits_of(model, batch, batch["segment_ids"])
    attention.install(model, "dense")
    want = logits_of(model, batch, sft.attention_mask(batch["segment_ids"]))
    real = np.asarray(batch["segment_ids"]) != 0
    np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_reference_kernel_sliding_window_and_soft_cap() -> None:
    """attend's kernels against a per-query loop: causal, same segment, the last `window`
    tokens, Gemma 2's soft cap, GQA (4 query heads on 2 kv heads)."""
    rng = np.random.default_rng(1)
    b, t, n, kv, h, window, cap = 2, 128, 4, 2, 16, 5, 3.0
    q, k, v = (rng.standard_normal((b, t, m, h)).astype(np.float32) for m in (n, kv, kv))
    seg = np.repeat(np.array([[1, 2, 2, 0], [1, 1, 1, 1]]), t // 4, axis=1).astype(np.int32)
    want = np.zeros((b, t, n, h), np.float32)
    for i in range(b):
        for j in range(t):
            keys = [s for s in range(j + 1) if seg[i, s] == seg[i, j] and j - s < window]
            for head in range(n):
                g = head // (n // kv)
                s = q[i, j, head] @ k[i, keys, g].T
                s = np.tanh(s / cap) * cap
                p = np.exp(s - s.max())
                want[i, j, head] = (p / p.sum()) @ v[i, keys, g]
    for kernel in ("splash_interpret", "reference"):
        got = attention.attend(*map(jnp.asarray, (q, k, v, seg)), kernel=kernel, window=window,
                               soft_cap=cap)  # fmt: skip
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_resolve_settings() -> None:
    resolve = attention.resolve
    assert resolve("auto", family="llama3", platform="cpu") == "dense"
    assert resolve("auto", family="llama3", platform="tpu") == "splash"
    assert resolve("flash", family="gemma2", platform="tpu") == "splash"
    assert resolve("auto", family="qwen3", platform="gpu") == "cudnn"
    assert resolve("auto", family="gemma2", platform="gpu") == "dense"  # soft cap
    assert resolve("auto", family="gemma3", platform="tpu", vision=True) == "dense"
    assert resolve("dense", family="qwen3", platform="tpu") == "dense"
    for setting, kw in (
        ("flash", dict(family="llama3", platform="cpu")),
        ("flash", dict(family="gemma2", platform="gpu")),
        ("flash", dict(family="gemma3", platform="tpu", vision=True)),
        ("sdpa", dict(family="llama3", platform="tpu")),
    ):
        with pytest.raises(ValueError, match=r"^spec\.training\.attention: "):
            resolve(setting, **kw)


# --- compiled for a TPU v5e by libtpu's compile-only client -----------------------------

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu (the TPU compiler) not installed"
)


@pytest.fixture(scope="module")
def v5e_mesh():
    for key, value in {
        "TPU_ACCELERATOR_TYPE": "v5litepod-1",
        "TPU_WORKER_HOSTNAMES": "localhost",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }.items():
        os.environ.setdefault(key, value)
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(
        platform="tpu",
        topology_name="v5e:1x1",
        chip_config_name="default",
        chips_per_host_bounds=(1, 1, 1),
        num_slices=1,
    ).devices
    grid = np.empty(1, dtype=object)
    grid[:] = devices[:1]
    return jax.sharding.Mesh(
        grid.reshape(1, 1, 1), ("dp", "fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 3
    )


def compiled_step_temp(mesh, fixture: str, kernel: str, length: int, batch: int = 1) -> int:
    """Temporaries (bytes) of a bf16 SFT gradient step (layer remat) compiled for `mesh`."""
    info, extras = models.model_info(FIXTURES / fixture, dtype=jnp.bfloat16, remat="layer")
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    with jax.set_mesh(mesh):
        model = models.abstract_model(info, extras, mesh, kernel)
        state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
            nnx.state(model),
        )
        nnx.update(model, state)

        def loss(model, batch):
            total, count = sft.token_nll(model, batch)
            return total / count

        keys = ("input_ids", "loss_mask", "segment_ids", "positions")
        rows = {k: jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=replicated)
                for k in keys}  # fmt: skip
        step = nnx.jit(nnx.value_and_grad(loss))
        compiled = compile_figures.compile(step.lower(model, rows), mesh)
    return compiled.memory_analysis().temp_size_in_bytes


@needs_libtpu
@pytest.mark.parametrize("fixture", ["qwen2", "qwen3", "gemma2", "gemma3"])
def test_splash_step_compiles_for_v5e(v5e_mesh, fixture: str) -> None:
    """Every family's splash train step compiles for a v5e chip at 8k tokens, with no
    temporary of the [B, L, L] mask's size (a boolean [1, 8192, 8192] is 64 MiB)."""
    length = 8192
    temp = compiled_step_temp(v5e_mesh, fixture, "splash", length)
    assert temp < length * length // 2, f"{fixture}: {temp / 2**20:.1f} MiB of temporaries"


@needs_libtpu
def test_splash_step_on_v5e_against_dense(v5e_mesh) -> None:
    """Llama 3 at 8k tokens: the dense step's temporaries hold [heads, L, L] float32
    scores (over 256 MiB a layer for 4 heads); splash's stay far below one [L, L] mask."""
    length = 8192
    flash = compiled_step_temp(v5e_mesh, "llama3", "splash", length)
    dense = compiled_step_temp(v5e_mesh, "llama3", "dense", length)
    assert flash < length * length // 2
    assert dense > 4 * length * length * 4 // 2
    assert dense > 20 * flash
