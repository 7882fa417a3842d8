"""Which reward functions a job may name: never Python's own modules, and only the
installation's module prefixes where it set them (posttrain.api.functions), the same in
validate, the webhook, the renderer's trainer pods and the trainer."""

from __future__ import annotations

from invalid_jobs import valid_job

from posttrain.api.functions import ALLOWED_ENV, allowed_modules, function_error
from posttrain.checks import validate


def reward_job(function: str) -> dict:
    doc = valid_job()
    doc["spec"]["technique"] = "grpo"
    doc["spec"]["grpo"] = {"rewards": [{"type": "python", "function": function}]}
    return doc


def test_python_s_own_modules_are_refused():
    for f in ("builtins:exec", "subprocess:run", "os.path:join", "_posixsubprocess:fork_exec"):
        assert "from Python's own" in function_error(f), f
    assert function_error("acme.rewards:score") is None
    assert function_error("osmosis:score") is None  # a module of its own, not os


def test_an_installation_allows_its_own_prefixes_only(monkeypatch):
    assert allowed_modules({}) is None
    allowed = allowed_modules({ALLOWED_ENV: " acme.rewards, lab ,"})
    assert allowed == ("acme.rewards", "lab")
    assert function_error("acme.rewards:f", allowed) is None
    assert function_error("acme.rewards.math:f", allowed) is None
    assert function_error("lab:f", allowed) is None
    said = function_error("acme.rewardsevil:f", allowed)
    assert said == (
        f"'acme.rewardsevil:f': this installation allows functions from acme.rewards, lab "
        f"only ({ALLOWED_ENV})"
    )
    # validate (and so the webhook and the trainer) reads the installation's setting.
    monkeypatch.setenv(ALLOWED_ENV, "acme.rewards")
    (err,) = validate(reward_job("other.module:f"))[1]
    assert err.field == "spec.grpo.rewards[0].function" and "acme.rewards only" in err.message
    assert validate(reward_job("acme.rewards:f"))[1] == []


def test_trainer_pods_get_the_installation_s_prefixes():
    import dataclasses

    from posttrain.api.spec import PostTrainJob
    from posttrain.render import RenderConfig, render

    job = PostTrainJob.model_validate(reward_job("acme.rewards:f"))

    def trainer_env(config: RenderConfig) -> dict:
        (jobset,) = [o for o in render(job, config) if o["kind"] == "JobSet"]
        pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        (trainer,) = [c for c in pod["containers"] if c["name"] == "trainer"]
        return {e["name"]: e.get("value") for e in trainer["env"]}

    assert ALLOWED_ENV not in trainer_env(RenderConfig())
    config = dataclasses.replace(RenderConfig(), allowed_function_modules="acme.rewards")
    assert trainer_env(config)[ALLOWED_ENV] == "acme.rewards"
