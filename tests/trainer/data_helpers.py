"""Helpers for the trainer tests: a tiny tokenizer made on the spot, a real
GCS-compatible server (fake-gcs-server, built from Go modules) on 127.0.0.1, and what a
packed data position has still to emit."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from posttrain.trainer.data import DataLoader

ROOT = Path(__file__).resolve().parents[2]

FAKE_GCS_VERSION = "v1.56.1"
FAKE_GCS_BUILD = (
    f"GOBIN=$PWD/.cache/bin go install github.com/fsouza/fake-gcs-server@{FAKE_GCS_VERSION}"
)

# The ChatML template of SmolLM2-Instruct, with a shorter default system prompt.
CHATML_SMOL = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "What is the capital of France? Answer: Paris.",
    "What is 2 + 3? Answer: 5.",
    "What colour is the sky? Answer: blue.",
    "system user assistant You are a helpful assistant.",
    "Hello there, how are you today? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog 0123456789",
]


def make_tokenizer_dir(
    path: Path,
    *,
    chat_template: str | None = CHATML_SMOL,
    vocab_size: int = 400,
    corpus: Sequence[str] = (),
) -> Path:
    """Write tokenizer.json (byte-level BPE trained on a few sentences, and on `corpus`)
    and tokenizer_config.json (ChatML special tokens and chat template) into path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*_CORPUS, *corpus] * 4, trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config: dict[str, object] = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 2048,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


# ------------------------------------------------------------------ fake GCS server


def fake_gcs_binary() -> str:
    """Path of fake-gcs-server, or an AssertionError saying how to build it."""
    candidates = [os.environ.get("FAKE_GCS_SERVER"), str(ROOT / ".cache/bin/fake-gcs-server")]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    found = shutil.which("fake-gcs-server")
    if found:
        return found
    raise AssertionError(
        "fake-gcs-server is needed for the gs:// tests and was not found in .cache/bin, "
        f"$FAKE_GCS_SERVER or PATH. Build it (a few minutes) from the repo root with:\n"
        f"    {FAKE_GCS_BUILD}"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def fake_gcs_server() -> Iterator[str]:
    """Run fake-gcs-server (in-memory) on 127.0.0.1; yields its http://host:port."""
    binary = fake_gcs_binary()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            binary,
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-backend",
            "memory",
            "-public-host",
            f"127.0.0.1:{port}",
            "-external-url",
            url,
            "-log-level",
            "error",
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None:
                    err = proc.stderr.read().decode() if proc.stderr else ""
                    raise AssertionError(f"fake-gcs-server exited: {err}") from None
                if time.monotonic() > deadline:
                    raise AssertionError("fake-gcs-server did not start in 30 s") from None
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def gcs_bucket(name: str) -> Iterator[str]:
    """A fake-gcs-server holding bucket `name`, with STORAGE_EMULATOR_HOST pointing at it
    for this process and its children; yields "gs://<name>"."""
    from posttrain.trainer import storage

    mp = pytest.MonkeyPatch()
    with fake_gcs_server() as url:
        mp.setenv("STORAGE_EMULATOR_HOST", url)
        mp.setenv("GOOGLE_CLOUD_PROJECT", "posttrain-test")
        storage.gcs_client().create_bucket(name)
        try:
            yield f"gs://{name}"
        finally:
            mp.undo()


def remaining(loader: DataLoader, state) -> tuple[list[int], int]:
    """Example rows a packed state has still to emit below its frontier, and the
    frontier (the first window no host has reached)."""
    hosts = state["packing"]["hosts"]
    frontier = max(h["next"] for h in hosts)
    left = []
    for h in hosts:
        for w, done in h["queue"]:
            left.extend(e.row for row in loader.window_rows(w)[done:] for e in row)
        for w in range(h["next"], frontier, h["stride"]):
            left.extend(e.row for row in loader.window_rows(w) for e in row)
    return left, frontier


def packed_batch(vocab: int, rows, length: int, seed: int = 0) -> dict:
    """A batch of packed rows (as jnp arrays): `rows` holds each row's example lengths,
    each example with its own segment id (1, 2, ...) and positions from 0, the rest of
    `length` padding (segment 0); random token ids below `vocab`."""
    import jax.numpy as jnp
    import numpy as np

    seg = np.zeros((len(rows), length), np.int32)
    pos = np.zeros_like(seg)
    for r, lengths in enumerate(rows):
        start = 0
        for s, n in enumerate(lengths, 1):
            seg[r, start : start + n] = s
            pos[r, start : start + n] = np.arange(n)
            start += n
    ids = np.random.default_rng(seed).integers(0, vocab, seg.shape).astype(np.int32)
    return {
        "input_ids": jnp.asarray(ids),
        "loss_mask": jnp.asarray((seg != 0).astype(np.int32)),
        "segment_ids": jnp.asarray(seg),
        "positions": jnp.asarray(pos),
    }
