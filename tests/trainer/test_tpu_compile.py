"""Compile-only TPU tier: the trainer's own step (posttrain.trainer.step_memory) compiled
by the TPU compiler on this CPU machine, over compile-only TPU devices from libtpu
(posttrain.trainer.tpu_compile; nothing runs on them), and `posttrain estimate --compile`.
Tiny models keep each compile to seconds. Skipped, saying why, only where libtpu is not
installed (the tpu-compile extra, part of dev); the dtype test and the command's
missing-extra and GPU answers need no libtpu."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import yaml
from flax import nnx

from posttrain import cli
from posttrain.api.spec import PostTrainJobSpec

pytestmark = pytest.mark.trainer
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed (pip install 'posttrain[tpu-compile]'): no TPU compiler",
)

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
         "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
         "vocab_size": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
         "max_position_embeddings": 4096, "rope_theta": 500000.0,
         "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                          "rope_type": "llama3", "original_max_position_embeddings": 8192}}  # fmt: skip
GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
          "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 256,
          "vocab_size": 512, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 64,
          "sliding_window": 64, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
          "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
          "max_position_embeddings": 4096,
          "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
         "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
         "vocab_size": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
         "tie_word_embeddings": True, "max_position_embeddings": 40960}  # fmt: skip


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("configs")
    for name, config in {"llama": LLAMA, "gemma3": GEMMA3, "qwen3": QWEN3}.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    return root


def _doc(model: Path | str, accelerator: str, **changes) -> dict:
    spec = {
        "technique": "sft",
        "model": {"source": str(model), "dtype": "bfloat16"},
        "data": {"source": "/data.jsonl", "maxLength": 256},
        "training": {"batchSize": 8, "remat": "layer"},
        "output": {"uri": "/out"},
        "resources": {"accelerator": accelerator},
    }
    for key, value in changes.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


def _job_file(tmp_path: Path, spec: dict) -> str:
    path = tmp_path / "job.yaml"
    doc = {"apiVersion": "posttrain.dev/v1alpha1", "kind": "PostTrainJob",
           "metadata": {"name": "compile-check"}, "spec": spec}  # fmt: skip
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.mark.parametrize("lora", [True, False])
def test_abstract_llama_carries_the_jobs_param_dtype(models_dir, lora):
    """Tunix's Llama 3 config has no parameter dtype (its abstract model is float32): the
    step compiled for a bf16 LoRA job holds a bf16 base, as the loader casts it, and
    float32 adapters; a full fine-tune's masters are float32."""
    from posttrain.trainer import step_memory

    doc = _doc(models_dir / "llama", "v5e-1", **({"lora": {"rank": 8}} if lora else {}))
    spec = PostTrainJobSpec.model_validate(doc)
    _, (model, _opt, *_rest) = step_memory.build(spec, step_memory.mesh_of(1, 1))
    base = jax.tree.leaves(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
    adapters = jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
    assert {x.dtype for x in base} == {jnp.dtype(jnp.bfloat16 if lora else jnp.float32)}
    assert len(adapters) == (2 * 7 * 2 if lora else 0)  # a, b x 7 projections x 2 layers
    assert {x.dtype for x in adapters} <= {jnp.dtype(jnp.float32)}


@needs_libtpu
@pytest.mark.parametrize(
    "family,changes",
    [("gemma3", {"lora": {"rank": 8}}), ("llama", {"technique": "dpo", "lora": {"rank": 8}})],
)
def test_the_step_compiles_on_compile_only_tpu_devices(models_dir, family, changes):
    """LoRA on compile-only devices (v5e 2x2) used to fail on an eager operation there
    ("'Executable' object has no attribute 'local_devices'"): everything is abstract."""
    from posttrain import capacity, catalog
    from posttrain.trainer import tpu_compile

    spec = PostTrainJobSpec.model_validate(_doc(models_dir / family, "v5e-4", **changes))
    placement = catalog.resolve("v5e-4")
    devices = tpu_compile.tpu_devices(placement)
    assert len(devices) == 4 and devices[0].platform == "tpu"
    mesh = tpu_compile.trainer_mesh(devices, capacity.layout(spec, placement))
    assert dict(mesh.shape) == {"dp": 1, "fsdp": 4, "tp": 1}
    program = tpu_compile.compile_program("train step", spec, mesh)
    assert program.error is None and program.flops > 0
    assert 0 < program.peak < 256 << 20


@needs_libtpu
def test_estimate_compile_prints_the_tpu_compilers_figures(models_dir, tmp_path, capsys):
    code = cli.main(["estimate", "--compile", _job_file(tmp_path, _doc(models_dir / "llama",
                                                                       "v5e-8"))])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "v5e-8 (v5e:2x4, 1 slice, 8 chips)" in out and "1 x 8 (dp x fsdp)" in out
    for word in ("arguments", "temporaries", "outputs", "total", "fits", "flops"):
        assert f"  {word}" in out
    assert "peak 197 TFLOP/s bf16" in out


@needs_libtpu
def test_several_slices_compile_on_one_mesh_over_them(models_dir, tmp_path, capsys):
    doc = _doc(models_dir / "llama", "v5e-4", lora={"rank": 8}, resources={"slices": 2})
    code = cli.main(["estimate", "--compile", _job_file(tmp_path, doc)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "v5e-4 (v5e:2x2, 2 slices, 8 chips)" in out and "2 x 4 (dp x fsdp)" in out


@needs_libtpu
def test_grpo_compiles_its_sampler_beside_the_train_step(models_dir):
    """GRPO's sampler (Tunix's decoding loop) compiled for the job's devices: its
    arguments hold the policy and the KV cache of every rollout; colocated, it is held to
    the HBM the optimizer's state leaves."""
    from posttrain import catalog
    from posttrain.trainer import tpu_compile

    grpo = {"numGenerations": 16, "maxPromptLength": 64, "maxCompletionLength": 1024,
            "rewards": [{"type": "exactAnswer"}]}  # fmt: skip
    doc = _doc(models_dir / "qwen3", "v5e-1", technique="grpo", lora={"rank": 8}, grpo=grpo,
               training={"batchSize": 2})  # fmt: skip
    report = tpu_compile.compile_report(PostTrainJobSpec.model_validate(doc),
                                        catalog.resolve("v5e-1"))  # fmt: skip
    text = "\n".join(report.lines)
    assert report.fits and "GRPO's sampler on the trainer's devices" in text, text
    assert "HBM left beside the optimizer's state" in text
    c = QWEN3
    kv = (
        2 * 16 * (64 + 1024) * c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"]
    )
    weights = 2 * c["vocab_size"] * c["hidden_size"]  # bf16 embedding, the largest weight
    args = report.sampler.memory["argument"]
    assert kv + weights <= args <= 2 * (kv + weights) + (8 << 20), (args, kv, weights)
    assert report.summary()["samplerPeakGiB"] > 0


@needs_libtpu
def test_a_job_with_tools_compiles_its_episode_sampler(models_dir):
    """spec.grpo.agent samples with posttrain's EpisodeSampler, not Tunix's loop: its
    decoding loop is what is compiled, its cache a turn longer than the episode's
    prompt and budget."""
    from posttrain import catalog
    from posttrain.trainer import sampler_memory, step_memory, tpu_compile

    tools = [{"name": "calculator", "type": "calculator"}]
    grpo = {"numGenerations": 16, "maxPromptLength": 64, "maxCompletionLength": 1024,
            "rewards": [{"type": "exactAnswer"}],
            "agent": {"maxTurns": 2, "turnLength": 1536, "tools": tools}}  # fmt: skip
    doc = _doc(models_dir / "qwen3", "v5e-1", technique="grpo", lora={"rank": 8}, grpo=grpo,
               training={"batchSize": 2})  # fmt: skip
    mesh = step_memory.mesh_of(1, 1, tpu_compile.tpu_devices(catalog.resolve("v5e-1")))
    compiled, held = sampler_memory.compile_sampler(PostTrainJobSpec.model_validate(doc), mesh)
    c = QWEN3

    def kv(slots: int) -> int:  # bf16 keys and values of 32 rows
        return (
            2 * 32 * slots * c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"]
        )

    weights = 2 * c["vocab_size"] * c["hidden_size"]  # bf16 embedding, the largest weight
    args = step_memory.memory_of(compiled)["argument"]
    # The episode's cache alone is more than Tunix's cache (64 + 1024 slots) and weights.
    assert kv(64 + 1024) + 2 * weights < kv(64 + 1024 + 1536) <= args, (args, kv(2624))
    assert args <= 2 * (kv(2624) + weights) + (8 << 20), (args, kv(2624), weights)
    assert held > 0  # the LoRA optimizer's state, beside it


def test_a_cpu_job_compiles_with_xla_cpu(models_dir, tmp_path, capsys):
    code = cli.main(["estimate", "--compile", _job_file(tmp_path, _doc(models_dir / "llama",
                                                                       "cpu"))])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith("cpu: compiled with XLA:CPU") and "  fits" in out
    total = next(x for x in out.splitlines() if x.strip().startswith("total"))
    assert "memory" in total and float(total.split()[1]) > 0


@needs_libtpu
def test_a_step_over_hbm_does_not_fit_with_the_compilers_figure(models_dir, tmp_path, capsys):
    """The TPU compiler refuses a step over HBM ("... exceeds available HBM"): reported
    as "does not fit" with its figures, exit 1, never a traceback."""
    doc = _doc(models_dir / "qwen3", "v5e-1", data={"maxLength": 8192},
               training={"batchSize": 16, "remat": "none"})  # fmt: skip
    code = cli.main(["estimate", "--compile", _job_file(tmp_path, doc)])
    out = capsys.readouterr().out
    assert code == 1, out
    line = next(x for x in out.splitlines() if "does not fit" in x)
    need = float(line.split("needs ")[1].split(" GiB")[0])
    assert need > 15.75 and "15.75 GiB of HBM" in line


def test_without_libtpu_the_command_names_the_extra(models_dir, tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "libtpu" else real(name, *a))  # fmt: skip
    code = cli.main(["estimate", "--compile", _job_file(tmp_path, _doc(models_dir / "llama",
                                                                       "v5e-8"))])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().count("\n") == 0 and "pip install 'posttrain[tpu-compile]'" in err


def test_a_gpu_job_falls_back_to_the_estimate_and_says_so(models_dir, tmp_path, capsys):
    doc = _doc(models_dir / "llama", "nvidia-h100-80gb")
    code = cli.main(["estimate", "--compile", _job_file(tmp_path, doc)])
    out = capsys.readouterr().out
    assert code == 0
    assert "XLA:GPU cannot compile without a GPU" in out.splitlines()[0]
    assert "total" in out and "fits" in out.splitlines()[-1]


def test_a_model_without_a_local_config_is_named(tmp_path, capsys):
    doc = _doc("hf://Qwen/Qwen3-0.6B", "v5e-8")
    code = cli.main(["estimate", "--compile", _job_file(tmp_path, doc)])
    err = capsys.readouterr().err
    assert code == 65 and "spec.model.source" in err and "config.json" in err


@needs_libtpu
def test_the_preflight_compiles_a_gcs_model_from_its_config_alone(tmp_path, capsys):
    """The operator's preflight pod: `--fetch-configs` reads the config.json of a gs://
    model (no weights) and `--result` writes the answer as one JSON object."""
    from data_helpers import gcs_bucket

    from posttrain.trainer import storage

    with gcs_bucket("ptmodels") as bucket:
        storage.write_text(f"{bucket}/llama/config.json", json.dumps(LLAMA))
        doc = _doc(f"{bucket}/llama", "v5e-1", data={"maxLength": 128},
                   training={"batchSize": 1})  # fmt: skip
        result = tmp_path / "result.json"
        code = cli.main(["estimate", "--compile", "--fetch-configs", "--result", str(result),
                         _job_file(tmp_path, doc)])  # fmt: skip
        out = capsys.readouterr().out
        assert code == 0, out
        answer = json.loads(result.read_text())
        assert answer["fits"] is True and answer["compiler"].startswith("libtpu ")
        assert 0 < answer["peakGiB"] < 1 and answer["hbmGiB"] > 15
        assert answer["argumentsGiB"] > 0 and answer["flops"] > 0
        doc["model"]["source"] = f"{bucket}/missing"
        code = cli.main(["estimate", "--compile", "--fetch-configs", "--result", str(result),
                         _job_file(tmp_path, doc)])  # fmt: skip
        answer = json.loads(result.read_text())
        assert code == 65 and answer["fits"] is None
        assert (
            "spec.model.source: cannot read config.json of gs://ptmodels/missing"
            in (answer["error"])
        )


def test_a_scanned_steps_temporaries_are_the_compilers_own_count():
    from posttrain.trainer.tpu_compile import scanned_memory

    counted = {"argument": 10, "output": 4, "alias": 4, "temp": 100, "peak": 60}
    assert scanned_memory(counted) == {**counted, "temp": 50}  # own peak less what is held
    assert scanned_memory({**counted, "peak": 0}) == {**counted, "peak": 0}  # none given
    assert scanned_memory({**counted, "peak": 200}) == {**counted, "peak": 200}  # larger


@needs_libtpu
def test_a_scanned_step_is_held_to_the_tpu_compilers_own_peak(tmp_path, capsys):
    """spec.training.layerLoop: scan, compiled for a v5e: memory_analysis()'s temporaries
    count the layer loop's stacked buffers more than once; the estimate's total is the
    compiler's own peak, below the unrolled step's total, and says so."""
    (tmp_path / "qwen3").mkdir()
    (tmp_path / "qwen3" / "config.json").write_text(json.dumps({**QWEN3, "num_hidden_layers": 8}))
    totals = {}
    for loop in ("unroll", "scan", "auto"):  # auto: scan on a TPU
        doc = _doc(tmp_path / "qwen3", "v5e-1", lora={"rank": 8},
                   training={"remat": "dots", "layerLoop": loop})  # fmt: skip
        assert cli.main(["estimate", "--compile", _job_file(tmp_path, doc)]) == 0
        out = capsys.readouterr().out
        (total,) = [line for line in out.splitlines() if line.startswith("  total")]
        totals[loop] = float(total.split()[1])
        scanned = "the compiler's own count for the scanned layers" in out
        assert scanned == (loop != "unroll"), out
    assert totals["scan"] == totals["auto"] < totals["unroll"], totals
