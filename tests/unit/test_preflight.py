"""The preflight's pure parts: which jobs are compiled first, the program key, the Job
rendered, what a pod answered, the next step, the status and condition written, the
cache, the operator's settings and admission with a preflight
(posttrain.render.preflight, posttrain.controller.preflight)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from invalid_jobs import valid_job

from posttrain.checks import validate
from posttrain.controller import preflight as pf
from posttrain.controller.admission import admission_errors, admission_warnings
from posttrain.controller.main import preflight_config
from posttrain.controller.phase import Observation, conditions_for, status_reason
from posttrain.render import RenderConfig
from posttrain.render.preflight import (
    PREFLIGHT_LABEL,
    PreflightConfig,
    applies,
    job_name,
    program_key,
    render_preflight,
)
from posttrain.render.trainer_config import CONFIG_ANNOTATION

ON = PreflightConfig(compile=True)
NOW = "2026-01-01T00:10:00Z"


def doc(accelerator: str = "v5e-8", **spec: Any) -> dict[str, Any]:
    d = valid_job("tune")
    d["metadata"].update(namespace="team-a", uid="0000-1111")
    d["spec"].update(
        model={"source": "gs://m/Qwen3-0.6B"},
        resources={"accelerator": accelerator},
        training={"batchSize": 8, "steps": 100},
    )
    for key, value in spec.items():
        d["spec"][key] = value
    return d


def parsed(d: dict[str, Any]):
    job, errors = validate(d)
    assert job is not None, errors
    return job


def key_of(d: dict[str, Any], image: str = "trainer:1") -> str:
    return program_key(parsed(d), image)


# -- which jobs, and the program key ----------------------------------------------------


def test_tpu_jobs_follow_the_installation_unless_they_say():
    assert applies(parsed(doc()), ON) and not applies(parsed(doc()), PreflightConfig())
    assert not applies(parsed(doc(preflight={"compile": False})), ON)
    assert applies(parsed(doc(preflight={"compile": True})), PreflightConfig())
    # CPU and GPU jobs are never compiled ahead, whatever they or the installation say.
    assert not applies(parsed(doc("cpu", preflight={"compile": True})), ON)
    assert not applies(parsed(doc("nvidia-h100-80gb", preflight={"compile": True})), ON)
    # An accelerator the catalog does not know: validate names it; nothing to compile.
    unknown, errors = validate(doc("v6e-300"))
    assert errors and not applies(unknown, ON)


def test_the_key_ignores_what_does_not_change_the_program():
    base = key_of(doc())
    same = doc(
        training={"batchSize": 8, "steps": 5000, "learningRate": 3e-5, "seed": 7},
        output={"uri": "/outputs/other"},
        scheduling={"queue": "tpu", "maxRestarts": 9},
        checkpoint={"everySteps": 50},
    )
    same["spec"]["data"]["source"] = "/data/other.jsonl"
    assert key_of(same) == base


@pytest.mark.parametrize(
    "change",
    [
        {"training": {"batchSize": 16, "steps": 100}},
        {"training": {"batchSize": 8, "steps": 100, "remat": "none"}},
        {"training": {"batchSize": 8, "steps": 100, "gradientAccumulation": 2}},
        {"training": {"batchSize": 8, "steps": 100, "attention": "dense"}},
        {"lora": {"rank": 16}},
        {"resources": {"accelerator": "v5e-16"}},
        {"resources": {"accelerator": "v5e-8", "slices": 2}},
        {"model": {"source": "gs://m/Qwen3-1.7B"}},
        {"technique": "dpo", "dpo": {"beta": 0.1}},
    ],
)
def test_the_key_changes_with_the_program(change):
    assert key_of(doc(**change)) != key_of(doc())


def test_the_key_changes_with_the_image_that_compiles():
    assert key_of(doc(), "trainer:1") != key_of(doc(), "trainer:2")


# -- the Job ----------------------------------------------------------------------------


def test_the_preflight_job_is_one_cpu_pod_of_the_trainer_image():
    job = parsed(doc())
    key = program_key(job, "trainer:tpu")
    config = PreflightConfig(compile=True, cpu="3", memory="12Gi", timeout_seconds=300,
                             node_selector={"pool": "cpu"})  # fmt: skip
    rendered = render_preflight(job, RenderConfig(trainer_image_tpu="trainer:tpu"), config, key)
    assert rendered["kind"] == "Job" and rendered["apiVersion"] == "batch/v1"
    meta, spec = rendered["metadata"], rendered["spec"]
    assert meta["name"] == job_name(job, key) == f"tune-pf-{key[:8]}"
    assert meta["labels"][PREFLIGHT_LABEL] == key[:16]
    assert meta["labels"]["posttrain.dev/job-name"] == "tune"
    assert meta["ownerReferences"][0]["uid"] == "0000-1111"
    assert spec["backoffLimit"] == 0 and spec["activeDeadlineSeconds"] == 300
    pod = spec["template"]
    assert pod["metadata"]["labels"][PREFLIGHT_LABEL] == key[:16]
    config_doc = json.loads(pod["metadata"]["annotations"][CONFIG_ANNOTATION])
    assert config_doc["spec"]["resources"]["accelerator"] == "v5e-8"
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "trainer:tpu"
    assert container["command"] == [
        "posttrain", "estimate", "--compile", "--fetch-configs",
        "--result", "/dev/termination-log", "/etc/posttrain/job.json",
    ]  # fmt: skip
    assert container["terminationMessagePath"] == "/dev/termination-log"
    assert container["resources"] == {"requests": {"cpu": "3", "memory": "12Gi"},
                                      "limits": {"memory": "12Gi"}}  # fmt: skip
    assert "google.com/tpu" not in json.dumps(pod)  # no TPU, no TPU toleration
    assert pod["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["restartPolicy"] == "Never"


def test_a_long_job_name_gives_a_job_name_pods_can_carry():
    d = doc()
    d["metadata"]["name"] = "a" * 40
    job = parsed(d)
    assert len(job_name(job, "f" * 64)) <= 52


def test_the_job_image_is_the_jobs_own_when_it_names_one():
    job = parsed(doc(image="registry.example/trainer:mine"))
    rendered = render_preflight(job, RenderConfig(), ON, "k" * 64)
    container = rendered["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example/trainer:mine"
    assert "env" not in container  # no token to pass


def test_a_gated_models_config_is_read_with_the_jobs_token():
    job = parsed(doc(hfTokenSecret={"name": "hf", "key": "token"}))
    container = render_preflight(job, RenderConfig(), ON, "k" * 64)["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert container["env"] == [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    ]


# -- what a pod answered ----------------------------------------------------------------

FIGURES = {"fits": False, "peakGiB": 24.52, "hbmGiB": 15.75, "compiler": "libtpu 0.0.42.1",
           "error": "RESOURCE_EXHAUSTED: Ran out of memory on HBM"}  # fmt: skip


def pod(phase="Succeeded", key="k" * 16, **container_state: Any) -> dict[str, Any]:
    statuses = [{"name": "preflight", "state": container_state}] if container_state else []
    return {"metadata": {"name": "p-1", "labels": {PREFLIGHT_LABEL: key}},
            "status": {"phase": phase, "containerStatuses": statuses}}  # fmt: skip


def answer(body: dict[str, Any]) -> pf.Answer | None:
    return pf.answer_from(pf.pod_state(body, PREFLIGHT_LABEL))


def test_a_terminated_pods_message_is_the_answer():
    out = answer(pod("Failed", terminated={"exitCode": 1, "message": json.dumps(FIGURES)}))
    assert out.result == pf.DOES_NOT_FIT and out.figures["peakGiB"] == 24.52
    assert "error" not in out.figures and out.why.startswith("RESOURCE_EXHAUSTED")
    fits = {"fits": True, "peakGiB": 0.06, "hbmGiB": 16.0, "argumentsGiB": 0.05}
    out = answer(pod(terminated={"exitCode": 0, "message": json.dumps(fits)}))
    assert out.result == pf.FITS and out.why == ""
    assert out.figures == {"peakGiB": 0.06, "hbmGiB": 16.0, "argumentsGiB": 0.05}


@pytest.mark.parametrize(
    "body,why",
    [
        (pod("Pending", waiting={"reason": "ImagePullBackOff", "message": "Back-off pulling"}),
         "ImagePullBackOff: Back-off pulling"),
        (pod("Failed", terminated={"exitCode": 65, "message": json.dumps(
            {"fits": None, "exitCode": 65, "error": "spec.model.source: no config.json"})}),
         "the compile could not run: spec.model.source: no config.json"),
        (pod("Failed", terminated={"exitCode": 137, "reason": "OOMKilled", "message": ""}),
         "ended (exit code 137) without an answer"),
        (pod("Failed", terminated={"exitCode": 1, "message": "Traceback ...\nboom"}),
         "ended (exit code 1) without an answer: Traceback ...\\nboom"),
    ],
)  # fmt: skip
def test_no_answer_says_why(body, why):
    out = answer(body)
    assert out.result == pf.UNKNOWN and why in out.why


@pytest.mark.parametrize(
    "body",
    [pod("Pending"), pod("Running", running={"startedAt": NOW}),
     pod("Pending", waiting={"reason": "ContainerCreating"})],
)  # fmt: skip
def test_a_pod_on_its_way_has_no_answer_yet(body):
    assert answer(body) is None


# -- the next step ----------------------------------------------------------------------

KEY = "k" * 64


def step(previous=None, pods=(), cached=None, now=NOW, timeout=600, others=(),
         elsewhere=None) -> pf.Step:  # fmt: skip
    states = [pf.pod_state(p, PREFLIGHT_LABEL) for p in pods]
    other_states = [pf.pod_state(p, PREFLIGHT_LABEL) for p in others]
    return pf.next_step(KEY, previous or {}, states, cached, now, timeout, "j", other_states,
                        elsewhere)  # fmt: skip


def test_first_the_job_is_made():
    assert step() == pf.Step(create=True, check_in=600)


def test_then_it_waits_until_the_timeout():
    started = {"key": KEY, "result": "Compiling", "job": "j", "startTime": "2026-01-01T00:05:00Z"}
    assert step(started) == pf.Step(check_in=300)
    late = step(started, now="2026-01-01T00:15:00Z")
    assert late.answer.result == pf.UNKNOWN and "within 600 s" in late.answer.why


def test_the_same_program_compiling_for_another_job_is_waited_for():
    assert step(elsewhere="other-pf-k") == pf.Step(shared="other-pf-k", check_in=10)
    waiting = {"key": KEY, "result": "Compiling", "job": "other-pf-k",
               "startTime": "2026-01-01T00:09:00Z"}  # fmt: skip
    assert step(waiting, elsewhere="other-pf-k") == pf.Step(check_in=10)
    # Its answer is this job's (marked cached: it was not compiled for this job).
    done = pod("Failed", terminated={"exitCode": 1, "message": json.dumps(FIGURES)})
    out = step(waiting, others=[done], elsewhere=None)
    assert out.answer.result == pf.DOES_NOT_FIT and out.answer.cached
    # The other job's Job is gone without an answer (its job was deleted): compile here.
    assert step(waiting, elsewhere=None).create
    # Its own compile stays its own, whatever else runs.
    own = waiting | {"job": "j"}
    assert step(own, elsewhere="other-pf-k") == pf.Step(check_in=540)


def test_a_preflight_jobs_state():
    running = {"metadata": {"name": "a-pf-1", "labels": {"posttrain.dev/job-name": "a"}}}
    assert pf.job_state(running, "posttrain.dev/job-name") == pf.PreflightJob("a-pf-1", "a", False)
    failed = running | {"status": {"conditions": [{"type": "Failed", "status": "True"}]}}
    assert pf.job_state(failed, "posttrain.dev/job-name").finished
    assert pf.job_state(running | {"status": {"succeeded": 1}}, "posttrain.dev/job-name").finished


def test_a_pod_of_another_program_is_not_the_answer():
    other = pod("Failed", key="x" * 16, terminated={"exitCode": 1,
                                                    "message": json.dumps(FIGURES)})  # fmt: skip
    assert step(pods=[other]).create


def test_a_decided_pod_wins_over_one_without_an_answer():
    stuck = pod("Pending", waiting={"reason": "ErrImagePull"})
    done = pod("Failed", terminated={"exitCode": 1, "message": json.dumps(FIGURES)})
    assert step(pods=[stuck, done]).answer.result == pf.DOES_NOT_FIT


def test_the_cache_answers_without_a_compile():
    entry = {"result": "Fits", "peakGiB": 1.5, "hbmGiB": 16.0, "at": NOW}
    out = step(cached=entry)
    assert out.answer == pf.Answer(pf.FITS, {"peakGiB": 1.5, "hbmGiB": 16.0}, "", cached=True)
    assert pf.cache_entry(out.answer, NOW) is None  # not written again


def test_an_answer_in_status_is_kept():
    previous = {"key": KEY, "result": "Fits", "peakGiB": 2.0, "message": "m"}
    assert step(previous).answer == pf.Answer(pf.FITS, {"peakGiB": 2.0}, "m")
    assert step(previous | {"key": "other"}).create  # another program: compiled


# -- status, condition, cache -----------------------------------------------------------


def test_the_status_carries_the_figures_and_says_them():
    out = pf.Answer(pf.DOES_NOT_FIT, {k: v for k, v in FIGURES.items() if k != "fits"})
    fields = pf.status_fields(out, KEY, "tune-pf-kkkkkkkk", "2026-01-01T00:05:00Z", "v5e-1")
    assert fields["result"] == "DoesNotFit" and fields["peakGiB"] == 24.52
    assert fields["message"] == (
        "the job does not fit: the TPU compiler (libtpu 0.0.42.1) needs 24.52 GiB per device "
        "for its temporaries alone, over the 15.75 GiB of HBM of each chip of v5e-1; "
        "posttrain estimate --compile shows the figures with one change"
    )
    compiling = pf.status_fields(None, KEY, "j", NOW, "v5e-1")
    assert compiling["result"] == "Compiling" and "compiling the train step" in compiling["message"]


def test_a_grpo_sampler_that_does_not_fit_is_named():
    figures = {"peakGiB": 9.5, "hbmGiB": 15.75, "samplerPeakGiB": 21.0,
               "compiler": "libtpu 0.0.42.1"}  # fmt: skip
    out = pf.status_fields(pf.Answer(pf.DOES_NOT_FIT, figures), KEY, "j", NOW, "v5e-1")
    assert out["samplerPeakGiB"] == 21.0
    assert (
        "needs 21.00 GiB per device for GRPO's sampler (the train step: 9.50 GiB)"
        in (out["message"])
    ), out["message"]
    fits = pf.status_fields(pf.Answer(pf.FITS, figures | {"samplerPeakGiB": 7.0}), KEY, "j",
                            NOW, "v5e-1")  # fmt: skip
    assert "and GRPO's sampler in 7.00 GiB" in fits["message"]


def test_the_condition_follows_the_answer():
    first = pf.with_condition([], {"result": "Compiling", "message": "c"}, NOW, 1)
    assert first == [{"type": "Preflight", "status": "Unknown", "reason": "Compiling",
                      "message": "c", "lastTransitionTime": NOW, "observedGeneration": 1}]  # fmt: skip
    later = "2026-01-01T00:11:00Z"
    fits = pf.with_condition(first, {"result": "Fits", "message": "f"}, later, 1)
    assert fits[0]["status"] == "True" and fits[0]["lastTransitionTime"] == later
    unknown = pf.with_condition([], {"result": "Unknown", "message": "u"}, NOW, None)
    assert unknown[0]["reason"] == "PreflightNoAnswer" and unknown[0]["status"] == "Unknown"
    refused = pf.with_condition(fits, {"result": "DoesNotFit", "message": "d"}, later, 1)
    assert [c["status"] for c in refused] == ["False"]


def test_the_job_conditions_keep_the_preflights():
    preflight = pf.with_condition([], {"result": "Fits", "message": "f"}, NOW, 1)
    conditions = conditions_for(Observation("Pending", "PodsStarting", "m"), preflight, NOW, 1)
    assert [c["type"] for c in conditions][-1] == "Preflight"
    assert conditions[-1] == preflight[0]
    # A Pending job's reason stays the Running condition's, not the preflight's True one.
    assert status_reason({"conditions": conditions}) == "PodsStarting"


def test_the_cache_keeps_its_newest_entries():
    data = {f"k{i:03}": json.dumps({"result": "Fits", "at": f"2026-01-01T00:{i % 60:02}:{i // 60:02}Z"})
            for i in range(pf.CACHE_ENTRIES)}  # fmt: skip
    entry = pf.cache_entry(pf.Answer(pf.FITS, {"peakGiB": 1.0}), "2026-02-01T00:00:00Z")
    patch = pf.cache_patch(data, "new", entry)["data"]
    assert patch["new"] == entry
    dropped = [k for k, v in patch.items() if v is None]
    assert dropped == ["k000"]  # the oldest, one over the limit
    assert pf.cache_patch({}, "new", entry) == {"data": {"new": entry}}
    assert pf.cached_answer({"new": entry}, "new")["peakGiB"] == 1.0
    assert pf.cached_answer({"bad": "not json"}, "bad") is None


# -- settings and admission -------------------------------------------------------------


def test_the_operators_settings_come_from_its_environment():
    assert preflight_config({}) == PreflightConfig()
    config = preflight_config({"POSTTRAIN_PREFLIGHT_COMPILE": "true",
                               "POSTTRAIN_PREFLIGHT_TIMEOUT_SECONDS": "120",
                               "POSTTRAIN_PREFLIGHT_CPU": "4",
                               "POSTTRAIN_PREFLIGHT_MEMORY": "16Gi",
                               "POSTTRAIN_PREFLIGHT_NODE_SELECTOR": '{"pool": "cpu"}'})  # fmt: skip
    assert config == PreflightConfig(True, 120, "4", "16Gi", {"pool": "cpu"})


@pytest.mark.parametrize(
    "env,named",
    [
        ({"POSTTRAIN_PREFLIGHT_COMPILE": "yes"}, "POSTTRAIN_PREFLIGHT_COMPILE"),
        ({"POSTTRAIN_PREFLIGHT_TIMEOUT_SECONDS": "-5"}, "POSTTRAIN_PREFLIGHT_TIMEOUT_SECONDS"),
        ({"POSTTRAIN_PREFLIGHT_NODE_SELECTOR": "[1]"}, "POSTTRAIN_PREFLIGHT_NODE_SELECTOR"),
    ],
)
def test_a_setting_it_cannot_take_is_named(env, named):
    with pytest.raises(ValueError, match=named):
        preflight_config(env)


def test_admission_leaves_memory_to_the_compiler_when_it_checks_first():
    """The fast estimate refuses a Qwen3-8B full fine-tune on one v5e chip; when the
    operator compiles TPU jobs first, admission warns and the compiler decides."""
    big = doc("v5e-1", model={"source": "gs://m/Qwen3-8B"})
    refused = admission_errors(big, None)
    assert len(refused) == 1 and refused[0].message.startswith(pf.MEMORY_REFUSAL)
    assert admission_errors(big, None, PreflightConfig()) == refused  # the default: off
    assert admission_errors(big, None, ON) == []
    (warning,) = admission_warnings(big, ON)
    assert "the job does not fit" in warning and "spec.preflight" in warning
    skipped = copy.deepcopy(big)
    skipped["spec"]["preflight"] = {"compile": False}
    assert admission_errors(skipped, None, ON) == refused


def test_the_tpu_trainer_image_carries_the_compiler_of_the_tpu_compile_extra():
    """The preflight pod runs the TPU build of the trainer image: its pinned libtpu
    (through jax[tpu]) is the one the tpu-compile extra allows."""
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    (wanted,) = [r for r in extra["optional-dependencies"]["tpu-compile"] if "libtpu" in r]
    prefix = re.search(r"libtpu==([\d.]+)\.\*", wanted).group(1)
    pins = (root / "docker" / "constraints-trainer-tpu.txt").read_text().split()
    (pinned,) = [p for p in pins if p.startswith("libtpu==")]
    assert pinned.removeprefix("libtpu==").startswith(prefix + ".")
    assert "ACCELERATOR" in (root / "Dockerfile.trainer").read_text()


def test_a_preflight_answer_does_not_date_the_phase():
    """The job stays Pending while its preflight answers: its phase's time is that of
    the phase's conditions, not the Preflight condition's."""
    from posttrain.controller import metrics

    pending = conditions_for(Observation("Pending", "Preflight", "m"), [], NOW, 1)
    later = "2026-01-01T00:12:00Z"
    body = {
        "metadata": {"creationTimestamp": "2026-01-01T00:00:00Z"},
        "status": {
            "phase": "Pending",
            "conditions": pf.with_condition(pending, {"result": "Fits"}, later, 1),
        },
    }
    entered = metrics.phase_entered(body, None, 1e10)
    assert entered == metrics._timestamp(NOW)
