"""posttrain's pieces in the shapes Tunix's RL stack takes, for GRPO (``grpo``): the
tokenizer (``TunixTokenizer``), a rollout on a host-local replica of the policy
(``make_host_local_rollout_class``) and the rollout engines this image has
(``check_rollout_engine``)."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import jax
from flax import nnx

from posttrain.trainer import data, models

log = logging.getLogger("posttrain.grpo")


class TunixTokenizer:
    """posttrain's tokenizer in the shape Tunix's TokenizerAdapter takes.

    Prompts come rendered by the chat template (which writes the special tokens), so no
    BOS is added; ``encode`` keeps a prompt's last ``max_prompt_length`` tokens
    (spec.grpo.maxPromptLength: left-truncated), so every rollout has the same shape.

    Tunix tells padding from tokens by value (``ids != pad_id``), so a pad token that is
    also the EOS (SmolLM2, many Llamas) would hide every end-of-turn token of a chat
    prompt from attention. Then another special token pads (see ``PAD_FALLBACKS``).
    """

    PAD_FALLBACKS = ("<|endoftext|>", "<unk>", "<pad>", "<|finetune_right_pad_id|>")

    def __init__(self, tokenizer: data.Tokenizer, max_prompt_length: int):
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        if tokenizer.eos_id is None:
            raise ValueError(
                "spec.model.source: the tokenizer has no eos_token; GRPO needs one to end "
                "completions (set eos_token in tokenizer_config.json)"
            )
        self._eos = int(tokenizer.eos_id)
        self._pad = int(tokenizer.pad_id)
        if self._pad == self._eos:
            ids = [tokenizer.token_to_id(t) for t in self.PAD_FALLBACKS]
            ids = [i for i in ids if i is not None and i != self._eos]
            self._pad = ids[0] if ids else (0 if self._eos != 0 else 1)
            log.info("GRPO pads with token id %d (the pad token is the EOS)", self._pad)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(str(text))[-self.max_prompt_length :]

    def decode(self, ids: Any, **kwargs: Any) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def bos_id(self) -> int | None:
        return None

    def eos_id(self) -> int:
        return self._eos

    def pad_id(self) -> int:
        return self._pad


def local_mesh() -> jax.sharding.Mesh:
    return models.make_mesh(devices=jax.local_devices())


def _to_local(value: Any, mesh: jax.sharding.Mesh) -> jax.Array:
    """The full value of a (possibly multi-host) array, replicated on this host's mesh."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.device_put(models.host_array(value), sharding)


def _local_copy(state: nnx.State, mesh: jax.sharding.Mesh) -> nnx.State:
    return jax.tree.map(lambda v: _to_local(v, mesh), state)


def make_host_local_rollout_class():
    from tunix.rl.rollout import base_rollout, vanilla_rollout

    class HostLocalRollout(base_rollout.BaseRollout):
        """Tunix's vanilla rollout on a host-local replica of the policy.

        With several processes the policy's arrays span hosts and Tunix's sampler (which
        feeds host-local prompt arrays) cannot run on them. Each host samples on its own
        replica instead: built once from the gathered params, then refreshed by
        ``update_params`` with the trainable params after every update.
        """

        def __init__(
            self,
            rollout_actor: nnx.Module,
            tokenizer: Any,
            mesh: jax.sharding.Mesh,
            rollout_config: Any,
            cache_config: Any,
        ):
            self.mesh = mesh
            graphdef, state = nnx.split(rollout_actor)
            self._local_model = nnx.merge(graphdef, _local_copy(state, mesh))
            self._inner = vanilla_rollout.VanillaRollout(
                self._local_model, tokenizer, cache_config_or_size=cache_config
            )

        def generate(self, prompts, rollout_config, **kwargs):
            with jax.set_mesh(self.mesh):
                return self._inner.generate(prompts, rollout_config, **kwargs)

        def get_per_token_logps(self, prompt_tokens, completion_tokens):
            return self._inner.get_per_token_logps(prompt_tokens, completion_tokens)

        def update_params(self, params, filter_types=None):
            nnx.update(self._local_model, _local_copy(params, self.mesh))

        def pad_id(self) -> int:
            return self._inner.pad_id()

        def eos_id(self) -> int:
            return self._inner.eos_id()

        def model(self) -> nnx.Module:
            return self._local_model

    return HostLocalRollout


def check_rollout_engine(engine: str) -> None:
    """vllm only where the package is installed; the message names the field."""
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "spec.grpo.rolloutEngine: vllm is not installed in this trainer image; use "
            "rolloutEngine: vanilla (Tunix's JAX sampler) or an image with vllm (and "
            "tpu-inference on TPU)"
        )
