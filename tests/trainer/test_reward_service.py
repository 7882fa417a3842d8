"""Rewards from a verifier service (spec.grpo.rewards[].type http), against a real HTTP
server on localhost: batches, bounded concurrency, retries with backoff, the auth header
from the Secret's variable, rollouts without a reward dropped from their groups and
counted, the job stopped past maxFailures naming the service; and a tiny GRPO job run
through `posttrain run` while the verifier is killed and started again."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from tb_events import scalars
from tool_server import ToolServer
from verifier_server import VerifierServer, free_port

from posttrain.api.spec import HttpRewardSpec
from posttrain.render import render
from posttrain.trainer import reward_failures, reward_service
from posttrain.trainer.reward_service import HttpReward, RewardServiceDown

TOKEN = "s3cr3t-verifier-token"
TOOL_TOKEN = "s3cr3t-tool-token"
HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(reward_service, "BACKOFF_S", 0.01)


def reward(url: str, environ=None, **http) -> HttpReward:
    spec = HttpRewardSpec.model_validate({"url": url, **http})
    return HttpReward(spec, 0, 1.0, environ=environ or {})


def ask(fn: HttpReward, completions: list[str], answers: list[str]) -> list[float]:
    prompts = [f"p{i}" for i in range(len(completions))]
    return fn(prompts=prompts, completions=completions, answer=answers, mode="train")


def test_batches_go_concurrently_with_the_auth_header_and_score_in_order():
    with VerifierServer(TOKEN) as server:
        server.behaviour.delay_s = 0.2
        fn = reward(
            server.url,
            {"POSTTRAIN_REWARD_0_AUTH": TOKEN},
            batchSize=3,
            concurrency=2,
            authSecret={"name": "verifier", "key": "token"},
        )
        completions = [f"it is {i % 3}" for i in range(10)]
        got = ask(fn, completions, ["1"] * 10)
    assert got == [1.0 if i % 3 == 1 else 0.0 for i in range(10)]
    reqs = server.behaviour.requests
    assert sorted(len(r["items"]) for r in reqs) == [1, 3, 3, 3]
    assert server.behaviour.most_in_flight == 2  # 4 batches, never more than 2 at once
    assert {r["auth"] for r in reqs} == {f"Bearer {TOKEN}"}
    item = next(i for r in reqs for i in r["items"] if i["metadata"]["index"] == 4)
    assert item == {
        "prompt": "p4",
        "completion": "it is 1",
        "answer": "1",
        "metadata": {"index": 4},
    }
    assert fn.take_seconds() >= 0.2


def test_a_busy_service_is_asked_again_after_a_backoff():
    with VerifierServer() as server:
        server.behaviour.fail_next = 2  # two 503s, then answers
        fn = reward(server.url, retries=2)
        assert ask(fn, ["7"], ["7"]) == [1.0]
        assert len(server.behaviour.requests) == 3 and fn.failures == 0


def test_a_refused_token_is_not_asked_again_and_the_token_is_in_no_log(caplog):
    caplog.set_level(logging.INFO)
    with VerifierServer(TOKEN) as server:
        fn = reward(
            server.url,
            {"POSTTRAIN_REWARD_0_AUTH": "wrong-token"},
            retries=3,
            maxFailures=100,
            authSecret={"name": "verifier"},
        )
        got = ask(fn, ["1", "2"], ["1", "2"])
        assert all(math.isnan(v) for v in got)
        # One POST per round (a 401 is not retried), STEP_ROUNDS rounds.
        assert len(server.behaviour.requests) == reward_service.STEP_ROUNDS
    assert fn.failures == 2 and fn.last_error == "HTTP 401 Unauthorized"
    assert "dropped from their groups" in caplog.text
    assert "wrong-token" not in caplog.text


def test_nulls_below_the_fraction_are_dropped_without_asking_again():
    with VerifierServer() as server:
        server.behaviour.null_for = {"3"}
        fn = reward(server.url, maxFailureFraction=0.5)
        got = ask(fn, ["1", "2", "3", "4"], ["1", "0", "3", "4"])
        assert got[:2] == [1.0, 0.0] and math.isnan(got[2]) and got[3] == 1.0
        assert len(server.behaviour.requests) == 1  # 1 of 4 missing: not past 0.5
        server.behaviour.requests.clear()
        fn.spec = fn.spec.model_copy(update={"max_failure_fraction": 0.0})
        ask(fn, ["1", "2", "3", "4"], ["1", "0", "3", "4"])
        # Past 0.0: the missing one is asked for again, alone, each round.
        assert [len(r["items"]) for r in server.behaviour.requests] == [4, 1, 1]
    assert fn.failures == 2


@pytest.mark.parametrize(
    "body, error",
    [
        (b"not json", 'the answer is not JSON {"rewards": [...]}'),
        (b'{"rewards": [1.0]}', "the answer has 1 rewards for 2 items"),
        (b'{"rewards": ["high", 1]}', "a reward is str, not a number or null"),
    ],
)
def test_a_malformed_answer_is_a_failure_named(body, error):
    with VerifierServer() as server:
        server.behaviour.body = body
        fn = reward(server.url, retries=1)
        got = ask(fn, ["1", "2"], ["1", "2"])
    assert all(math.isnan(v) for v in got) and fn.last_error == error


def test_a_slow_service_times_out():
    with VerifierServer() as server:
        server.behaviour.delay_s = 1.0
        fn = reward(server.url, timeoutSeconds=0.1, retries=0)
        start = time.monotonic()
        assert math.isnan(ask(fn, ["1"], ["1"])[0])
    assert time.monotonic() - start < 1.0 * reward_service.STEP_ROUNDS
    assert "timed out" in fn.last_error


def test_past_max_failures_the_job_stops_naming_the_service_and_its_last_error():
    port = free_port()  # nothing listens
    fn = reward(f"http://127.0.0.1:{port}/score", retries=0, maxFailures=3)
    got = ask(fn, ["1", "2"], ["1", "2"])  # 2 failures: within maxFailures
    assert all(math.isnan(v) for v in got)
    with pytest.raises(RewardServiceDown) as e:
        ask(fn, ["1", "2"], ["1", "2"])
    message = str(e.value)
    assert message.startswith(
        f"spec.grpo.rewards[0].http: the reward service http://127.0.0.1:{port}/score gave no "
        "reward for 4 completions (maxFailures 3); last error: "
    )
    assert "Connection refused" in message


def test_a_missing_secret_variable_names_the_field_and_variable():
    with pytest.raises(ValueError) as e:
        reward("http://127.0.0.1:1/s", {}, authSecret={"name": "verifier", "key": "tok"})
    assert str(e.value) == (
        "spec.grpo.rewards[0].http.authSecret: the trainer has no POSTTRAIN_REWARD_0_AUTH "
        "(Secret verifier, key tok); on a cluster the JobSet sets it, for `posttrain run` "
        "export POSTTRAIN_REWARD_0_AUTH"
    )


def test_unscored_rollouts_leave_their_groups_and_are_counted():
    from tunix.rl import algo_core

    nan = math.nan
    parts = np.array([[1.0], [0.0], [nan], [1.0], [nan], [nan], [nan], [2.0]], np.float32)
    sample = {
        "rewards": parts,
        "total": np.nan_to_num(parts[:, 0]),  # Tunix sums with nansum
        "completion_mask": np.ones((8, 3), np.int32),
    }
    out = reward_failures.drop_unscored(sample, 4, True, algo_core.compute_advantages)
    assert out["reward_failures"] == 4
    # Group 0: the scored rewards 1, 0, 1 alone make the advantages (Tunix's estimator on them).
    expected = algo_core.compute_advantages(np.array([1.0, 0.0, 1.0]), 3)
    np.testing.assert_allclose(out["advantages"][[0, 1, 3]], expected, rtol=1e-5)
    # Group 1: one scored rollout, nothing to compare it with.
    assert out["advantages"][2] == 0 and not out["advantages"][4:].any()
    assert out["completion_mask"].sum(axis=-1).tolist() == [3, 3, 0, 3, 0, 0, 0, 3]
    # In the metrics a dropped rollout is its group's mean.
    assert out["rewards"][:, 0].tolist() == pytest.approx([1, 0, 2 / 3, 1, 2, 2, 2, 2])
    # Nothing missing: Tunix's estimator, the mask untouched.
    whole = {**sample, "rewards": np.nan_to_num(parts)}
    same = reward_failures.drop_unscored(whole, 4, True, algo_core.compute_advantages)
    assert same["reward_failures"] == 0 and same["completion_mask"].all()


def test_the_jobset_passes_the_verifier_token_by_reference():
    from posttrain.api.spec import PostTrainJob

    doc = yaml.safe_load(
        """
apiVersion: posttrain.dev/v1alpha1
kind: PostTrainJob
metadata: {name: verified, namespace: team}
spec:
  technique: grpo
  model: {source: hf://Qwen/Qwen3-0.6B}
  data: {source: gs://data/gsm8k.jsonl}
  output: {uri: gs://runs/verified}
  grpo:
    rewards:
    - {type: exactAnswer}
    - type: http
      http:
        url: http://verifier.team.svc.cluster.local:8080/score
        authSecret: {name: verifier, key: token}
"""
    )
    objects = render(PostTrainJob.model_validate(doc))
    text = json.dumps(objects)
    (jobset,) = [o for o in objects if o["kind"] == "JobSet"]
    (container,) = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"
    ]
    env = {e["name"]: e for e in container["env"]}
    assert env["POSTTRAIN_REWARD_1_AUTH"] == {
        "name": "POSTTRAIN_REWARD_1_AUTH",
        "valueFrom": {"secretKeyRef": {"name": "verifier", "key": "token"}},
    }
    assert "http://verifier.team.svc.cluster.local:8080/score" in text  # in the job's config
    assert "POSTTRAIN_REWARD_0_AUTH" not in env


# ------------------------------------------------------------------ posttrain run


def _grpo_job(tmp_path: Path, url: str, tools_base: str) -> Path:
    """A tiny multi-turn GRPO job: a calculator and an http tool, rewards from `url`."""
    from tiny_model import make_tiny_llama

    model = make_tiny_llama(tmp_path / "model")
    prompts = tmp_path / "say.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Say {n}.", "answer": str(n)}) + "\n" for n in range(10)) * 4
    )
    spec = {
        "technique": "grpo",
        "model": {"source": str(model), "dtype": "float32"},
        "data": {"source": str(prompts)},
        "training": {"steps": 4, "batchSize": 2, "learningRate": 0.002, "logEverySteps": 1},
        "grpo": {
            "numGenerations": 2,
            "beta": 0.0,
            "maxPromptLength": 1200,  # the tools' instructions are part of the prompt
            "maxCompletionLength": 12,
            "agent": {
                "maxTurns": 2,
                "turnLength": 6,
                "tools": [
                    {"name": "calculator", "type": "calculator"},
                    {
                        "name": "capital",
                        "type": "http",
                        "description": "The capital of a country.",
                        "parameters": {"type": "object"},
                        "http": {
                            "url": f"{tools_base}/capital",
                            "authSecret": {"name": "tools", "key": "token"},
                        },
                    },
                ],
            },
            "rewards": [
                {
                    "type": "http",
                    "http": {
                        "url": url,
                        "retries": 1,
                        "timeoutSeconds": 5,
                        "maxFailures": 50,
                        "authSecret": {"name": "verifier", "key": "token"},
                    },
                }
            ],
        },
        "checkpoint": {"everySteps": 1000},
        "output": {"uri": str(tmp_path / "out"), "exportHF": "none"},
    }
    doc = {"apiVersion": "posttrain.dev/v1alpha1", "kind": "PostTrainJob"}
    doc |= {"metadata": {"name": "verified"}, "spec": spec}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _verifier(port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "verifier_server.py"), str(port), str(log), TOKEN]
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with __import__("socket").create_connection(("127.0.0.1", port), 0.2):
                return proc
        except OSError:
            time.sleep(0.05)
    raise AssertionError("the verifier did not start")


@pytest.mark.trainer
def test_posttrain_run_drops_and_counts_rewards_while_the_verifier_is_down(tmp_path):
    """A multi-turn job with tools: the verifier is killed once it has scored step 1, and
    started again (same port) once the trainer said it dropped rollouts: the run
    completes, the dropped rollouts are counted in train/reward_failures, and neither
    token is in any output."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/score"
    tools = ToolServer(TOOL_TOKEN).__enter__()
    job = _grpo_job(tmp_path, url, tools.base)
    log = tmp_path / "verifier.log"
    verifier = _verifier(port, log)
    env = {**os.environ, "POSTTRAIN_REWARD_0_AUTH": TOKEN, "JAX_PLATFORMS": "cpu"}
    env["POSTTRAIN_TOOL_CAPITAL_AUTH"] = TOOL_TOKEN
    trainer = subprocess.Popen(
        [sys.executable, "-m", "posttrain.cli", "run", str(job)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    restarted = threading.Event()
    try:
        # Killed (SIGKILL) after its first answer: step 1's 4 rollouts.
        deadline = time.monotonic() + 300
        while not (log.exists() and log.read_text().strip()):
            assert time.monotonic() < deadline and trainer.poll() is None, "no reward asked"
            time.sleep(0.01)
        verifier.kill()
        verifier.wait()
        for line in trainer.stdout:
            lines.append(line)
            if "dropped from their groups" in line and not restarted.is_set():
                verifier = _verifier(port, log)
                restarted.set()
        assert trainer.wait(timeout=300) == 0, "".join(lines)
    finally:
        trainer.kill()
        verifier.kill()
        tools.__exit__()
    output = "".join(lines)
    assert restarted.is_set(), output
    assert TOKEN not in output and TOOL_TOKEN not in output
    tb = scalars(tmp_path / "out" / "tensorboard")
    assert sorted(tb["train/turns"]) == [1, 2, 3, 4]  # episodes ran every step
    failures = scalars(tmp_path / "out" / "tensorboard")["train/reward_failures"]
    print(f"\ntrain/reward_failures by step: {failures}")
    assert sum(failures.values()) >= 4 and failures[1] == 0, failures
    assert failures[4] == 0, failures  # the restarted verifier scored the last step
    asked = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(r["auth_ok"] for r in asked)
    assert f"got no reward from {url}" in output
