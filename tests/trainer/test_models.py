"""Loading HF checkpoints into Tunix models: logits against transformers' goldens.

The fixtures (tests/trainer/fixtures/<family>/) are tiny random models that
scripts/make_hf_fixtures.py made with `transformers`, with golden logits of a fixed input.
The multi-device checks run in a subprocess, because XLA_FLAGS must be set before jax is
first imported and other test modules import it in this process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import FIXTURE_FAMILY, FIXTURES, fixture_loader

from posttrain.trainer import models
from posttrain.trainer.models.saving import save_hf
from tests.trainer.data_helpers import gcs_bucket

pytestmark = pytest.mark.trainer

TOL = 1e-4


def golden(family: str):
    data = np.load(FIXTURES / family / "golden.npz")
    return data["input_ids"], data["logits"]


@pytest.fixture(scope="module")
def loaded():
    return fixture_loader()


@pytest.mark.parametrize("fixture", FIXTURE_FAMILY)
def test_detect_family(fixture):
    assert models.detect_family(FIXTURES / fixture) == FIXTURE_FAMILY[fixture]


def test_detect_family_names_the_field_for_unknown_models(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "bert", "architectures": ["BertModel"]})
    )
    with pytest.raises(ValueError, match=r"spec\.model\.family"):
        models.detect_family(tmp_path)


@pytest.mark.parametrize("family", FIXTURE_FAMILY)
def test_logits_match_transformers(family, loaded):
    model, info = loaded(family)
    assert info.family == FIXTURE_FAMILY[family]
    ids, expected = golden(family)
    logits = np.asarray(models.forward(model, ids))
    assert logits.shape == expected.shape
    np.testing.assert_allclose(logits, expected, atol=TOL, rtol=0)


def test_padded_batch_matches_unpadded(loaded):
    model, _ = loaded("qwen3")
    ids, expected = golden("qwen3")
    n = 7  # right-pad the first 7 tokens to the golden length (no new compilation)
    padded = np.where(np.arange(ids.shape[1]) < n, ids, 0)
    mask = np.broadcast_to(np.arange(ids.shape[1]) < n, ids.shape)
    logits = np.asarray(models.forward(model, padded, mask))[:, :n]
    np.testing.assert_allclose(logits, expected[:, :n], atol=TOL, rtol=0)


def test_rope_frequencies_come_from_config(loaded):
    """Tunix's llama3 attention ignores rope_theta; the loader must not: every attention
    layer holds config.json's frequencies and rotates with them."""
    model, info = loaded("llama3")
    own = models.build_config("llama3", info.hf_config)[1]["rope_inv_freq"]
    assert [layer.attn.rope_inv_freq for layer in model.layers] == [own] * info.num_layers
    ids, expected = golden("llama3")
    # The same weights rotated as Tunix's own RoPE does (theta 1e6, no llama3 scaling).
    tunix = nnx.merge(*nnx.split(model))
    for layer in tunix.layers:
        layer.attn.rope_inv_freq = tuple(float(x) for x in models.rope_inv_freq(1e6, info.head_dim))
    off = np.abs(np.asarray(models.forward(tunix, ids)) - expected).max()
    assert off > 100 * TOL
    np.testing.assert_allclose(np.asarray(models.forward(model, ids)), expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["llama3", "gemma2", "gemma3-mha"])
def test_param_blocks_read_only_what_they_need(family):
    """Each make_array_from_callback index reads just its block of the HF tensor(s)."""
    info, _ = models.model_info(FIXTURES / family)
    from safetensors.numpy import load_file

    tensors = load_file(FIXTURES / family / "model.safetensors")
    rng = np.random.default_rng(0)
    for m in models.param_maps(info):
        full = m.read(tensors.__getitem__, ())
        for _ in range(3):
            index = []
            for dim in m.shape:
                lo = int(rng.integers(0, dim))
                hi = int(rng.integers(lo + 1, dim + 1))
                index.append(slice(lo, hi))
            requested = []

            def get(name, requested=requested):
                class Recorder:
                    def __getitem__(self, idx):
                        requested.append((name, idx))
                        return tensors[name][idx]

                return Recorder()

            block = m.read(get, tuple(index))
            np.testing.assert_array_equal(block, full[tuple(index)])
            read = sum(np.empty(tensors[n].shape)[sl].size for n, sl in requested)
            whole = sum(tensors[n].size for n in m.sources)
            assert read <= whole
            if index[0].stop - index[0].start < m.shape[0]:
                assert read < whole or len(requested) == 0
        # the inverse gives back the HF tensors bit for bit
        for name, value in m.to_hf(full).items():
            np.testing.assert_array_equal(value, tensors[name])


@pytest.mark.parametrize("family", FIXTURE_FAMILY)
def test_save_hf_round_trip(family, loaded, tmp_path):
    model, info = loaded(family)
    out = save_hf(model, tmp_path / "hf", info)
    from safetensors.numpy import load_file

    original = load_file(FIXTURES / family / "model.safetensors")
    saved = load_file(out / "model.safetensors")
    assert set(saved) == set(original)
    for name in original:
        np.testing.assert_array_equal(saved[name], original[name], err_msg=name)
    cfg = json.loads((out / "config.json").read_text())
    assert (
        cfg["model_type"]
        == json.loads((FIXTURES / family / "config.json").read_text())["model_type"]
    )
    again, info2 = models.load_model(out)
    assert info2.family == FIXTURE_FAMILY[family]
    ids, expected = golden(family)
    np.testing.assert_allclose(np.asarray(models.forward(again, ids)), expected, atol=TOL, rtol=0)


def test_save_hf_bfloat16_and_shards(loaded, tmp_path):
    model, info = loaded("llama3")
    out = save_hf(model, tmp_path / "hf", info, dtype=jnp.bfloat16, max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    again, _ = models.load_model(out, dtype=jnp.bfloat16)
    for (path, new), (_, old) in zip(
        nnx.to_flat_state(nnx.state(again, nnx.Param)),
        nnx.to_flat_state(nnx.state(model, nnx.Param)),
        strict=True,
    ):
        assert new.get_value().dtype == jnp.bfloat16, path
        np.testing.assert_array_equal(
            np.asarray(new.get_value()), np.asarray(old.get_value()).astype(jnp.bfloat16)
        )


@pytest.mark.parametrize("family", ["llama3", "gemma2", "gemma3"])
def test_greedy_generate_with_cache_matches_recompute(family, loaded):
    """KV-cache decoding (past the sliding window) agrees with full recomputation."""
    model, _ = loaded(family)
    ids, _ = golden(family)
    prompt, steps = ids[0, :6].tolist(), ids.shape[1] - 6  # past the sliding window (4)
    got = models.greedy_generate(model, None, prompt, steps)
    assert got.text is None
    # recompute the whole right-padded sequence at every step (the golden input's shape,
    # so the forward compiled for the logits test is reused)
    seq = np.zeros_like(ids)
    seq[:, : len(prompt)] = prompt
    for n in range(len(prompt), ids.shape[1]):
        mask = np.broadcast_to(np.arange(ids.shape[1]) < n, ids.shape)
        logits = np.asarray(models.forward(model, seq, mask))
        seq[:, n] = int(logits[0, n - 1].argmax())
    assert got.token_ids == seq[0, len(prompt) :].tolist()


def test_greedy_generate_stops_at_eos(loaded):
    model, _ = loaded("llama3")  # same shapes as above: nothing new to compile
    ids, _ = golden("llama3")
    prompt, steps = ids[0, :6].tolist(), ids.shape[1] - 6
    first = models.greedy_generate(model, None, prompt, steps).token_ids
    stopped = models.greedy_generate(model, None, prompt, steps, eos_token_ids=[first[1]])
    assert stopped.token_ids == first[: first.index(first[1]) + 1]


def test_unsupported_configs_are_refused_with_the_field():
    cfg = json.loads((FIXTURES / "llama3" / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ValueError, match=r"spec\.model.*yarn"):
        models.build_config("llama3", cfg)
    with pytest.raises(ValueError, match=r"spec\.model\.family"):
        models.build_config("mistral", cfg)


def test_legacy_rope_fields_are_read():
    """Checkpoints from transformers < 5 have rope_theta / rope_scaling at the top level."""
    cfg = json.loads((FIXTURES / "llama3" / "config.json").read_text())
    new = models.build_config("llama3", cfg)[1]["rope_inv_freq"]
    legacy = dict(cfg)
    params = legacy.pop("rope_parameters")
    legacy["rope_theta"] = params["rope_theta"]
    legacy["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    assert models.build_config("llama3", legacy)[1]["rope_inv_freq"] == new


def test_mesh_axes_that_do_not_divide_a_dimension_are_dropped():
    mesh = types.SimpleNamespace(shape={"fsdp": 2, "tp": 4})
    assert models.fit_spec(("fsdp", "tp", None), (64, 2, 16), mesh) == ("fsdp", None, None)
    assert models.fit_spec(("tp", "fsdp"), (128, 64), mesh) == ("tp", "fsdp")
    assert models.fit_spec((("fsdp", "tp"),), (8,), mesh) == (("fsdp", "tp"),)
    assert models.fit_spec((("fsdp", "tp"),), (4,), mesh) == (None,)
    assert models.fit_spec(("sp",), (8,), mesh) == (None,)


def test_gemma3_multimodal_layout(loaded, tmp_path):
    """Gemma 3 4B+ checkpoints (Gemma3ForConditionalGeneration) nest the text config and
    prefix the decoder's tensors; the text model loads from them, and exports as
    Gemma3ForCausalLM."""
    from safetensors.numpy import load_file, save_file

    src = FIXTURES / "gemma3"
    text = json.loads((src / "config.json").read_text())
    cfg = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = {
        f"model.language_model.{k[len('model.') :]}": v
        for k, v in load_file(src / "model.safetensors").items()
    }
    tensors["model.vision_tower.unused.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    model, info = models.load_model(tmp_path)
    assert (info.family, info.hf_prefix) == ("gemma3", "model.language_model.")
    ids, expected = golden("gemma3")
    np.testing.assert_allclose(np.asarray(models.forward(model, ids)), expected, atol=TOL, rtol=0)
    out = save_hf(model, tmp_path / "text", info)
    assert set(load_file(out / "model.safetensors")) == set(load_file(src / "model.safetensors"))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]


_TWO_PROCESSES = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port, pid, fixtures, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    from jax.experimental import multihost_utils
    from posttrain.trainer import lora as lora_lib, models, peft_format
    from posttrain.trainer.models.saving import save_hf

    assert len(jax.devices()) == 4 and len(jax.local_devices()) == 2
    result = {}

    def logits_diff(model, mesh, golden):
        data = np.load(golden)
        with jax.set_mesh(mesh):
            logits = models.forward(model, data["input_ids"])
        logits = np.asarray(multihost_utils.process_allgather(logits, tiled=True))
        return float(np.abs(logits - data["logits"]).max())

    reads = []
    original_read = models.ParamMap.read
    def recording_read(self, get, index):
        block = original_read(self, get, index)
        reads.append((self.path, block.size))
        return block

    mesh = models.make_mesh(2, 2)
    models.ParamMap.read = recording_read
    model, info = models.load_model(f"{fixtures}/qwen2", mesh=mesh)
    models.ParamMap.read = original_read
    emb = model.embedder.input_embedding.get_value()
    result["qwen2"] = {
        "diff": logits_diff(model, mesh, f"{fixtures}/qwen2/golden.npz"),
        "fully_addressable": emb.is_fully_addressable,
        "emb_shard": list(emb.addressable_shards[0].data.shape),
        "emb_shape": list(emb.shape),
        "emb_reads": [n for path, n in reads if path == ("embedder", "input_embedding")],
        "read": sum(n for _, n in reads),
        "total": sum(int(np.prod(m.shape)) for m in models.param_maps(info)),
    }
    save_hf(model, f"{out}/hf-{pid}", info)  # every process gathers, process 0 writes

    # LoRA on the mesh, restored from the committed PEFT adapter
    lora = lora_lib.apply_lora(model, 4, 8.0, mesh=mesh)
    peft_format.load_peft_adapter(lora, f"{fixtures}/qwen2/peft_adapter")
    b = lora.layers[0].mlp.gate_proj.kernel_lora_b.get_value()
    result["lora"] = {
        "diff": logits_diff(lora, mesh, f"{fixtures}/qwen2/peft_golden.npz"),
        "b_shard": list(b.addressable_shards[0].data.shape),
        "b_shape": list(b.shape),
    }
    print("RESULT" + json.dumps(result))
    """
)


def test_two_processes_four_devices(tmp_path):
    """jax.distributed with 2 CPU processes x 2 fake devices (a 4-device mesh): the logits
    match transformers, params and adapters are sharded, each process's callbacks read only
    the blocks of its own devices, and save_hf gathers across processes.

    Runs in subprocesses: XLA_FLAGS must be set before jax is imported."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    env.update(XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    argv = [sys.executable, "-c", _TWO_PROCESSES, str(port)]
    procs = [
        subprocess.Popen(
            [*argv, str(pid), str(FIXTURES), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for pid in (0, 1)
    ]
    results = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=600)
        finally:
            for other in procs:
                if other.poll() is None and proc.returncode not in (None, 0):
                    other.kill()
        assert proc.returncode == 0, stderr[-4000:]
        line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT"))
        results.append(json.loads(line[len("RESULT") :]))
    for result in results:
        for name, r in result.items():
            assert r["diff"] < TOL, (name, r)
            if name == "lora":
                assert r["b_shard"] != r["b_shape"]  # the adapter is sharded too
                continue
            assert not r["fully_addressable"]
            # the embedding [vocab, hidden] is sharded ('tp', 'fsdp'): a block per device,
            # and a process reads just the blocks of its 2 devices
            v, d = r["emb_shape"]
            assert r["emb_shard"] == [v // 2, d // 2], (name, r)
            assert r["emb_reads"] == [v * d // 4] * 2, (name, r)
            assert r["read"] < r["total"], (name, r)
    from safetensors.numpy import load_file

    saved = load_file(tmp_path / "hf-0" / "model.safetensors")
    original = load_file(FIXTURES / "qwen2" / "model.safetensors")
    assert set(saved) == set(original)
    for name in original:
        np.testing.assert_array_equal(saved[name], original[name], err_msg=name)
    assert not (tmp_path / "hf-1").exists()


# ------------------------------------------------------------------ weights on gs://


@pytest.fixture(scope="module")
def gcs():
    with gcs_bucket("ptmodels") as bucket:
        yield bucket


def test_gcs_safetensors_reads_only_the_rows_asked_for(gcs, tmp_path):
    from safetensors.numpy import save_file

    from posttrain.trainer import storage
    from posttrain.trainer.gcs_safetensors import GcsSafetensors

    tensors = {
        "w": np.arange(8 * 16, dtype=np.float32).reshape(8, 16),
        "b": np.arange(6, dtype=np.float32).astype(jnp.bfloat16),
        "ids": np.arange(24, dtype=np.int64).reshape(2, 3, 4),
        "scale": np.array(2.5, dtype=np.float32),
    }
    save_file(tensors, tmp_path / "t.safetensors")
    storage.upload_dir(tmp_path, f"{gcs}/rows")
    f = GcsSafetensors(f"{gcs}/rows/t.safetensors")
    assert sorted(f.keys()) == sorted(tensors)
    header = f.bytes_read
    w = f.get_slice("w")
    assert w.get_shape() == [8, 16]
    np.testing.assert_array_equal(w[2:4], tensors["w"][2:4])
    assert f.bytes_read - header == 2 * 16 * 4  # two rows, nothing else
    np.testing.assert_array_equal(w[1:7, 3:5], tensors["w"][1:7, 3:5])
    np.testing.assert_array_equal(w[:], tensors["w"])
    np.testing.assert_array_equal(f.get_slice("b")[1:5], tensors["b"][1:5])
    assert f.get_slice("b")[:].dtype == jnp.bfloat16
    np.testing.assert_array_equal(f.get_slice("ids")[1:2, :, 1:3], tensors["ids"][1:2, :, 1:3])
    assert f.get_slice("scale")[()] == 2.5

    storage.write_bytes(f"{gcs}/rows/bad.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{nope")
    with pytest.raises(ValueError, match=r"gs://ptmodels/rows/bad.safetensors: not a safetensors"):
        GcsSafetensors(f"{gcs}/rows/bad.safetensors")


def test_load_model_from_gcs_fetches_blocks_not_files(gcs, tmp_path, caplog):
    """A gs:// model source: the small files are copied, the weights read in place (ranged
    reads of each block, none twice), and the model equals the one loaded from disk."""
    from posttrain.trainer import sources, storage

    storage.upload_dir(FIXTURES / "llama3", f"{gcs}/llama3")
    with caplog.at_level("INFO", logger="posttrain.trainer.models"):
        model, info = sources.load_model_source(f"{gcs}/llama3", tmp_path)
    fetched, total = map(int, re.search(r"fetched (\d+) of the (\d+) bytes", caplog.text).groups())
    assert 0 < fetched <= total
    copied = {p.name for p in Path(info.model_dir).iterdir()}
    assert "config.json" in copied and not any(n.endswith(".safetensors") for n in copied)
    ids, expected = golden("llama3")
    np.testing.assert_allclose(np.asarray(models.forward(model, ids)), expected, atol=TOL, rtol=0)


def test_gcs_safetensors_serves_repeated_blocks_from_one_fetch(gcs, tmp_path):
    """Devices of one host asking for the same rows (replicated or column-cut blocks)
    cost one fetch."""
    from safetensors.numpy import save_file

    from posttrain.trainer import storage
    from posttrain.trainer.gcs_safetensors import GcsSafetensors

    w = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    save_file({"w": w, "v": w[:2]}, tmp_path / "t.safetensors")
    storage.upload_dir(tmp_path, f"{gcs}/repeat")
    f = GcsSafetensors(f"{gcs}/repeat/t.safetensors")
    start = f.bytes_read
    blocks = [f.get_slice("w")[:, c : c + 4] for c in range(0, 16, 4)]
    np.testing.assert_array_equal(np.concatenate(blocks, axis=1), w)
    np.testing.assert_array_equal(f.get_slice("w")[3:5], w[3:5])
    assert f.bytes_read - start == w.nbytes
    np.testing.assert_array_equal(f.get_slice("v")[:], w[:2])
    np.testing.assert_array_equal(f.get_slice("w")[0:1], w[0:1])  # "v" evicted "w"
    assert f.bytes_read - start == w.nbytes + 2 * 16 * 4 + 16 * 4
