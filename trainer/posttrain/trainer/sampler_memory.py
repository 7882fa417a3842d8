"""GRPO's sampler compiled ahead of time, as `posttrain estimate --compile` compiles the
train step: Tunix's decoding loop (the program ``spec.grpo.rolloutEngine: vanilla`` runs
for every rollout: its KV cache for numGenerations x batchSize sequences of
maxPromptLength + maxCompletionLength tokens, the policy's weights with its adapters)
on the job's mesh, traced with abstract arrays only. A job with tools (spec.grpo.agent)
samples its episodes with posttrain's ``EpisodeSampler`` instead: its decoding loop over
one turn, with a KV cache of maxPromptLength + maxCompletionLength + turnLength tokens an
episode.

Colocated, the sampler runs on the trainer's devices while the optimizer's state stays
there; `colocated_peak` adds that state to the sampler's own figure.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.api.spec import PostTrainJobSpec
from posttrain.trainer import compile_figures, lora, models, optim, step_memory
from posttrain.trainer.policy import DTYPES


class StubTokenizer:
    """What Tunix's sampler asks of a tokenizer: every text encodes to `ids`, nothing
    decodes, token 1 ends a sequence and 0 pads."""

    def __init__(self, ids: Any = ()):
        self.ids = list(ids)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return list(self.ids)

    def decode(self, ids: Any, **kwargs: Any) -> str:
        return ""

    def bos_id(self) -> None:
        return None

    def eos_id(self) -> int:
        return 1

    def pad_id(self) -> int:
        return 0


def build(spec: PostTrainJobSpec, mesh: jax.sharding.Mesh) -> tuple[Any, tuple, int]:
    """The lowering of the sampler's jitted decoding loop, its abstract arguments on
    `mesh` (the policy's variables, the sampling state after the prefill) and the bytes
    of the optimizer's state that stay on the devices beside it."""
    from tunix.generate import sampler as tunix_sampler
    from tunix.rl.rollout import base_rollout

    g, t = spec.grpo, spec.training
    compute = DTYPES[spec.model.dtype]
    remat = step_memory.remat_on_accelerator(spec)
    with jax.set_mesh(mesh):
        model, info = step_memory._model(
            spec.model.source, mesh, compute if spec.lora else jnp.float32, compute, remat,
            spec.model.layers, spec.model.family, False, str(t.attention),
        )  # fmt: skip
        wrt: Any = nnx.Param
        if spec.lora:
            model = lora.apply_lora(model, spec.lora.rank, spec.lora.alpha,
                                    spec.lora.target_modules, mesh, abstract=True)  # fmt: skip
            wrt = nnx.LoRAParam
        opt = nnx.eval_shape(lambda m: nnx.Optimizer(m, optim.optimizer(t), wrt=wrt), model)
        held = sum(
            math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
            for x in jax.tree.leaves(step_memory._abstract(nnx.state(opt.opt_state), mesh))
        )
        rows = t.batch_size * g.num_generations
        if g.agent:
            return (*_episode_decode(models.without_remat(model), g, rows), held)
        length = g.max_prompt_length + g.max_completion_length
        cache = base_rollout.CacheConfig(cache_size=length, num_layers=info.num_layers,
                                         num_kv_heads=info.num_kv_heads, head_dim=info.head_dim)  # fmt: skip
        sampler = tunix_sampler.Sampler(models.without_remat(model), StubTokenizer(), cache)
        sampler.eos_ids = np.array([1], np.int32)  # no eager array on compile-only devices
        prompts = jax.ShapeDtypeStruct((rows, g.max_prompt_length), jnp.int32)

        def start(ids):
            return sampler.init_sample_state(
                ids, total_sampling_steps=length, include_logits=False,
                forbidden_token_ids=None, temperature=g.temperature, top_p=1.0, top_k=None,
                seed=jax.random.PRNGKey(0), beam_size=None, include_logprobs=False,
            )  # fmt: skip

        state = jax.eval_shape(start, prompts)
        # A static field the sampler fills from the prompts' shape: concrete, as when it runs.
        state = dataclasses.replace(state, num_input_tokens=np.array(g.max_prompt_length, np.int32))
    return sampler._compiled_decode_fn.lower, (sampler._flattened_transformer_state, state), held


def _episode_decode(model: Any, g: Any, rows: int) -> tuple[Any, tuple]:
    """spec.grpo.agent's sampler (``EpisodeSampler``): the lowering of its decoding loop
    over one turn of `rows` episodes, and its abstract arguments. Its cache holds the
    prompt, the episode's budget, a turn and a prefill block
    (``agent_rollout.turn_and_cache``)."""
    from posttrain.trainer import agent_rollout, episode_sampler

    turn, size = agent_rollout.turn_and_cache(g)
    cache = jax.eval_shape(lambda: models.init_cache(model, rows, size))
    vocab = model.embedder.input_embedding.shape[0]  # the logits' width
    lower = functools.partial(episode_sampler._decode.lower, steps=turn, eos=1, pad=0)
    args = (
        model,
        jax.ShapeDtypeStruct((rows, vocab), jnp.float32),  # the prefill's last logits
        cache,
        jax.ShapeDtypeStruct((rows, size), jnp.bool_),  # valid slots
        jax.ShapeDtypeStruct((rows,), jnp.int32),  # positions
        jax.ShapeDtypeStruct((rows,), jnp.bool_),  # ended
        jax.ShapeDtypeStruct((2,), jnp.uint32),  # the turn's key
        jax.ShapeDtypeStruct((), jnp.float32),  # temperature
    )
    return lower, args


def compile_sampler(spec: PostTrainJobSpec, mesh: jax.sharding.Mesh) -> tuple[Any, int]:
    """The sampler's decoding loop compiled for `mesh`, and the optimizer's state per
    device that stays beside it (bytes)."""
    lower, args, held = build(spec, mesh)
    with jax.set_mesh(mesh):
        return compile_figures.compile(lower(*args), mesh), held
