"""Parameter mapping: which Hugging Face tensor(s) each Tunix parameter is made of, and how.

A ``ParamMap`` reads the block of a Tunix parameter that one device needs straight from
the HF tensor(s) (``read``) and turns a whole value back into HF tensors (``to_hf``);
``param_maps`` lists them for every parameter of a family's model.
"""

from __future__ import annotations

from posttrain.trainer.models.config import ModelInfo
from posttrain.trainer.models.param_map import ParamMap


def param_maps(info: ModelInfo) -> list[ParamMap]:
    """Every Tunix param of the family and the HF tensor(s) it is made of."""
    p, fam = info.hf_prefix, info.family
    d, n, k, h = info.hidden_size, info.num_heads, info.num_kv_heads, info.head_dim
    f, v = info.intermediate_size, info.vocab_size
    maps = [
        ParamMap(
            ("embedder", "input_embedding"), (f"{p}embed_tokens.weight",), ((v,), (d,)), (0, 1)
        )
    ]
    gemma = fam.startswith("gemma")
    for i in range(info.num_layers):
        hf, t = f"{p}layers.{i}.", ("layers", i)

        def vec(path: tuple, name: str, size: int, hf=hf, t=t) -> ParamMap:
            return ParamMap(t + path, (hf + name,), ((size,),), (0,))

        mlp = [
            ParamMap(
                t + ("mlp", "gate_proj", "kernel"),
                (hf + "mlp.gate_proj.weight",),
                ((f,), (d,)),
                (1, 0),
            ),
            ParamMap(
                t + ("mlp", "up_proj", "kernel"), (hf + "mlp.up_proj.weight",), ((f,), (d,)), (1, 0)
            ),
            ParamMap(
                t + ("mlp", "down_proj", "kernel"),
                (hf + "mlp.down_proj.weight",),
                ((d,), (f,)),
                (1, 0),
            ),
        ]
        q, kk, vv, o = (hf + f"self_attn.{x}_proj.weight" for x in "qkvo")
        if not gemma:
            maps += [
                ParamMap(t + ("attn", "q_proj", "w"), (q,), ((n, h), (d,)), (2, 0, 1)),
                ParamMap(t + ("attn", "k_proj", "w"), (kk,), ((k, h), (d,)), (2, 0, 1)),
                ParamMap(t + ("attn", "v_proj", "w"), (vv,), ((k, h), (d,)), (2, 0, 1)),
                ParamMap(t + ("attn", "o_proj", "w"), (o,), ((d,), (n, h)), (1, 2, 0)),
                *mlp,
                vec(("input_layernorm", "w"), "input_layernorm.weight", d),
                vec(("post_attention_layernorm", "w"), "post_attention_layernorm.weight", d),
            ]
            if fam == "qwen2":
                maps += [
                    vec(("attn", "q_bias"), "self_attn.q_proj.bias", n * h),
                    vec(("attn", "k_bias"), "self_attn.k_proj.bias", k * h),
                    vec(("attn", "v_bias"), "self_attn.v_proj.bias", k * h),
                ]
            if fam == "qwen3":
                maps += [
                    vec(("attn", "q_norm", "w"), "self_attn.q_norm.weight", h),
                    vec(("attn", "k_norm", "w"), "self_attn.k_norm.weight", h),
                ]
            continue
        if n == k:
            maps.append(
                ParamMap(t + ("attn", "qkv_einsum", "w"), (q, kk, vv), ((n, h), (d,)), (0, 2, 1))
            )
        else:
            maps += [
                ParamMap(t + ("attn", "q_einsum", "w"), (q,), ((n, h), (d,)), (0, 2, 1)),
                ParamMap(t + ("attn", "kv_einsum", "w"), (kk, vv), ((k, h), (d,)), (0, 2, 1)),
            ]
        post_attn = "post_attn_norm" if fam == "gemma2" else "post_attention_norm"
        maps += [
            ParamMap(t + ("attn", "attn_vec_einsum", "w"), (o,), ((d,), (n, h)), (1, 2, 0)),
            *mlp,
            vec(("pre_attention_norm", "scale"), "input_layernorm.weight", d),
            vec((post_attn, "scale"), "post_attention_layernorm.weight", d),
            vec(("pre_ffw_norm", "scale"), "pre_feedforward_layernorm.weight", d),
            vec(("post_ffw_norm", "scale"), "post_feedforward_layernorm.weight", d),
        ]
        if fam == "gemma3":
            maps += [
                vec(("attn", "_query_norm", "scale"), "self_attn.q_norm.weight", h),
                vec(("attn", "_key_norm", "scale"), "self_attn.k_norm.weight", h),
            ]
    norm = ("final_norm", "scale") if gemma else ("final_norm", "w")
    maps.append(ParamMap(norm, (f"{p}norm.weight",), ((d,),), (0,)))
    if not info.tie_word_embeddings:
        head = (
            "language_model.lm_head.weight" if p.startswith("language_model.") else "lm_head.weight"
        )
        maps.append(ParamMap(("lm_head", "w"), (head,), ((v,), (d,)), (1, 0)))
    if info.vision is not None:  # Gemma 3's vision tower and projector
        from posttrain.trainer.models import vision

        maps += vision.param_maps(info.vision, info.hidden_size)
    return maps
