"""Pathways client start-up: under JAX_PLATFORMS=proxy the trainer waits for the proxy,
names its address when it does not answer, and exits with a code the JobSet retries."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.api.spec import USER_ERROR_EXIT_CODE
from posttrain.trainer import pathways

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_other_platforms_skip_pathways():
    assert pathways.initialize({"JAX_PLATFORMS": "cpu"}) is False
    assert pathways.initialize({}) is False


def test_proxy_address_parsing():
    assert pathways.proxy_address("grpc://head-0-0.job:29000") == ("head-0-0.job", 29000)
    with pytest.raises(pathways.ProxyUnreachable, match="names no host:port"):
        pathways.proxy_address("grpc://head")


def test_waits_for_a_listening_proxy():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        pathways.wait_for_proxy(f"grpc://127.0.0.1:{server.getsockname()[1]}", timeout=5)


def test_unreachable_proxy_is_named():
    port = _free_port()
    env = {"JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": f"grpc://127.0.0.1:{port}"}
    with pytest.raises(pathways.ProxyUnreachable, match=f"proxy at 127.0.0.1:{port} "):
        pathways.initialize(env, timeout=0.5)


def test_trainer_exits_with_a_retried_code_when_the_proxy_is_down(tmp_path):
    """`posttrain train` in a head pod whose proxy never answers: exit 75, not the
    user-error code the JobSet does not retry, and the message names the address."""
    port = _free_port()
    job = (ROOT / "examples" / "sft-lora-smollm2-cpu.yaml").read_text()
    (tmp_path / "job.yaml").write_text(job)
    env = {
        **os.environ,
        "JAX_PLATFORMS": "proxy",
        "JAX_BACKEND_TARGET": f"grpc://127.0.0.1:{port}",
        "POSTTRAIN_PATHWAYS_PROXY_TIMEOUT": "1",
    }
    cmd = [sys.executable, "-m", "posttrain.cli", "train", "--config", str(tmp_path / "job.yaml")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == pathways.UNREACHABLE_EXIT_CODE != USER_ERROR_EXIT_CODE, out.stderr
    assert f"Pathways proxy at 127.0.0.1:{port}" in out.stderr
