"""posttrain's TPU and Pathways JobSets next to what xpk 1.16.0 renders for the same
shapes (its `--dry-run --output-manifest-file` output, in tests/unit/data/).

Every field xpk sets is either rendered the same or is one of the differences
docs/gke-fidelity.md lists; the sets below name them, so a new difference fails here.
"""

from pathlib import Path

import pytest
import yaml

from posttrain.checks import load_job
from posttrain.render import render

DATA = Path(__file__).parent / "data"
GOLDEN = Path(__file__).parent.parent / "golden" / "jobs"
DOC = Path(__file__).parents[2] / "docs" / "gke-fidelity.md"

# xpk's environment variables posttrain leaves out (docs/gke-fidelity.md).
WORKER_ENV_LEFT_OUT = {"TPU_MIN_LOG_LEVEL", "TF_CPP_MIN_LOG_LEVEL", "PATHWAYS_HEAD"}
PROXY_ENV_LEFT_OUT = {"PATHWAYS_HEAD"}  # the address is rendered into the flag instead


def _xpk(name: str) -> dict:
    return yaml.safe_load((DATA / f"xpk-1.16.0-workload-{name}.yaml").read_text())


def _ours(name: str) -> dict:
    return render(load_job(GOLDEN / f"{name}.yaml"))[-1]


def _rjobs(js: dict) -> dict[str, dict]:
    return {r["name"]: r for r in js["spec"]["replicatedJobs"]}


def _pod(rjob: dict) -> dict:
    return rjob["template"]["spec"]["template"]["spec"]


def _containers(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in [*pod.get("initContainers", []), *pod["containers"]]}


def _env_names(c: dict) -> set[str]:
    return {e["name"] for e in c.get("env") or []}


def _ports(c: dict) -> list[int]:
    return [p["containerPort"] for p in c.get("ports", [])]


def _flags(c: dict) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in c.get("args", []))


def _limits(c: dict) -> dict[str, str]:
    return {k: str(v) for k, v in c.get("resources", {}).get("limits", {}).items()}


def test_tpu_slices_match_xpk():
    xpk, ours = _xpk("v6e-16x2"), _ours("v6e-16-multislice")
    assert xpk["metadata"]["annotations"] == ours["metadata"]["annotations"]
    (x,), (o,) = xpk["spec"]["replicatedJobs"], ours["spec"]["replicatedJobs"]
    assert x["replicas"] == o["replicas"] == 2
    for key in ("parallelism", "completions", "backoffLimit"):
        assert x["template"]["spec"][key] == o["template"]["spec"][key], key
    xp, op = _pod(x), _pod(o)
    for key in ("restartPolicy", "hostNetwork", "dnsPolicy"):
        assert xp[key] == op[key], key
    assert xp["nodeSelector"].items() <= op["nodeSelector"].items()  # + the machine type
    assert [t["key"] for t in xp["tolerations"]] == [t["key"] for t in op["tolerations"]]
    (xc,), (oc,) = xp["containers"], op["containers"]
    assert _limits(xc) == _limits(oc) == {"google.com/tpu": "4"}
    shm = {v["name"] for v in xp["volumes"] if v.get("emptyDir") == {"medium": "Memory"}}
    assert {m["mountPath"] for m in xc["volumeMounts"] if m["name"] in shm} == {"/dev/shm"}
    ours_shm = {v["name"] for v in op["volumes"] if v.get("emptyDir") == {"medium": "Memory"}}
    assert {m["mountPath"] for m in oc["volumeMounts"] if m["name"] in ours_shm} == {"/dev/shm"}
    # Differences docs/gke-fidelity.md explains: no privileged mode.
    assert xc["securityContext"] == {"privileged": True} and "securityContext" not in oc


def test_pathways_matches_xpk():
    xpk, ours = _xpk("pathways-v6e-256x2"), _ours("v6e-256-pathways-2-slices")
    for key in ("coordinator", "network", "startupPolicy", "successPolicy"):
        if key == "coordinator":
            assert xpk["spec"][key]["replicatedJob"] == ours["spec"][key]["replicatedJob"]
        else:
            assert xpk["spec"][key] == ours["spec"][key], key
    xj, oj = _rjobs(xpk), _rjobs(ours)
    assert list(xj) == list(oj) == ["pathways-head", "worker"]
    for name in xj:
        x, o = xj[name], oj[name]
        assert x["replicas"] == o["replicas"], name
        assert x["template"]["metadata"]["annotations"] == o["template"]["metadata"]["annotations"]
        for key in ("parallelism", "completions", "backoffLimit"):
            assert x["template"]["spec"][key] == o["template"]["spec"][key], (name, key)
        xp, op = _pod(x), _pod(o)
        for key in ("restartPolicy", "hostNetwork", "dnsPolicy"):
            assert xp[key] == op[key], (name, key)
        assert xp["nodeSelector"].items() <= op["nodeSelector"].items(), name
        xc, oc = _containers(xp), _containers(op)
        for c in ("pathways-rm", "pathways-proxy", "pathways-worker"):
            if c not in xc:
                continue
            assert xc[c]["image"] == oc[c]["image"], c
            assert xc[c].get("restartPolicy") == oc[c].get("restartPolicy"), c
            assert _ports(xc[c]) == _ports(oc[c]), c
            assert _limits(xc[c]) == _limits(oc[c]), c
            left_out = WORKER_ENV_LEFT_OUT if c == "pathways-worker" else PROXY_ENV_LEFT_OUT
            assert _env_names(xc[c]) - left_out <= _env_names(oc[c]), c
            xf, of = _flags(xc[c]), _flags(oc[c])
            assert set(xf) == set(of), c
            for flag, value in xf.items():
                if flag == "gcs_scratch_location":  # <output.uri>/pathways-scratch
                    continue
                if "$(PATHWAYS_HEAD)" in value:  # the head's DNS name, known at render time
                    assert of[flag].endswith(value.replace("$(PATHWAYS_HEAD)", "")), c
                    continue
                assert value == of[flag], (c, flag)
    # The head's JAX client: xpk's jax-tpu, posttrain's trainer.
    xt = _containers(_pod(xj["pathways-head"]))["jax-tpu"]
    ot = _containers(_pod(oj["pathways-head"]))["trainer"]
    assert _limits(xt) == _limits(ot)
    assert _env_names(xt) - {"PATHWAYS_HEAD"} <= _env_names(ot)
    # Differences docs/gke-fidelity.md explains: privileged head container, /tmp hostPath.
    assert xt["securityContext"] == {"privileged": True} and "securityContext" not in ot
    assert any("hostPath" in v for v in _pod(xj["worker"])["volumes"])
    assert not any("hostPath" in v for v in _pod(oj["worker"]).get("volumes", []))


@pytest.mark.parametrize(
    "difference",
    ["privileged", "hostPath", "TPU_MIN_LOG_LEVEL", "node.kubernetes.io/instance-type", "tpu7"],
)
def test_differences_are_documented(difference):
    assert difference in DOC.read_text()
