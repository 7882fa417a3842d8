"""Hugging Face safetensors checkpoints <-> Tunix nnx models, for the trainer.

Families: ``llama3``, ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3`` (``auto`` reads the HF
``config.json``). One module a step:

- ``families``: the family table (HF ``model_type``/``architectures`` names, Tunix classes);
- ``rope``: the RoPE fix (Tunix's llama3/qwen3 attention with config.json's frequencies);
- ``config``: config.json -> family, Tunix ``ModelConfig`` and ``ModelInfo``;
- ``param_map``, ``params``: which HF tensor(s) each Tunix parameter is made of;
- ``vision``: Gemma 3's vision tower and projector (loaded with ``vision=True``);
- ``safetensors_io``: reading safetensors a slice at a time, writing them a tensor at a time;
- ``loading``: a checkpoint into a sharded model, each host reading only its shards;
- ``generation``: the forward pass and greedy generation;
- ``attention``: flash attention kernels (splash on TPU, cuDNN on GPU) for training;
- ``remat``: decoder-layer remat that keeps the matmul outputs (``spec.training.remat: dots``);
- ``scan``: the decoder layers stacked and run by one ``lax.scan`` (``spec.training.layerLoop``);
- ``head``: the vocabulary projection over only the last positions (completions' log-probs);
- ``saving``: a model (LoRA merged in) back to a HF checkpoint.

Imports point one way: ``posttrain.trainer.lora`` stands on this package, and
``saving`` stands on ``lora`` (it merges the adapters), so this package re-exports
everything but ``saving``: ``from posttrain.trainer.models.saving import save_hf``.
LoRA (qwix) and the PEFT adapter format: ``posttrain.trainer.lora``.

Nothing here imports Kubernetes code.
"""

from __future__ import annotations

from posttrain.trainer.mesh import make_mesh
from posttrain.trainer.models.attention import attention_input
from posttrain.trainer.models.config import (
    ModelInfo,
    build_config,
    detect_family,
    model_info,
    read_hf_config,
    resolve_remat,
)
from posttrain.trainer.models.families import FAMILIES
from posttrain.trainer.models.generation import (
    Generation,
    causal_mask,
    compute_view,
    forward,
    greedy_generate,
    init_cache,
    next_logits,
    without_remat,
)
from posttrain.trainer.models.head import last_positions
from posttrain.trainer.models.loading import abstract_model, fit_spec, load_model
from posttrain.trainer.models.param_map import ParamMap
from posttrain.trainer.models.params import param_maps
from posttrain.trainer.models.rope import rope_inv_freq
from posttrain.trainer.models.safetensors_io import host_array, write_safetensors

__all__ = [
    "FAMILIES",
    "Generation",
    "ModelInfo",
    "ParamMap",
    "abstract_model",
    "attention_input",
    "build_config",
    "causal_mask",
    "compute_view",
    "detect_family",
    "fit_spec",
    "forward",
    "greedy_generate",
    "host_array",
    "init_cache",
    "last_positions",
    "next_logits",
    "load_model",
    "make_mesh",
    "model_info",
    "param_maps",
    "read_hf_config",
    "resolve_remat",
    "rope_inv_freq",
    "without_remat",
    "write_safetensors",
]
