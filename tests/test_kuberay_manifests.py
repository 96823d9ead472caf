"""deploy/kuberay/*.yaml against KubeRay's CRDs (offline, deploy/validate.py), their tether config, and the
deployment's security defaults. The CRDs live in ../shared/kuberay/crds (or $TETHER_KUBERAY_CRDS); the
tests that need them skip, saying so, where that directory is missing."""

from __future__ import annotations

import copy
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "kuberay").glob("*.yaml"))


def _import_validate():
    spec = importlib.util.spec_from_file_location("tether_deploy_validate", DEPLOY / "validate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


validate = _import_validate()
CRD_DIR = validate.crd_dir()
SAMPLES = sorted((CRD_DIR.parent / "samples").glob("*.yaml"))


@pytest.fixture(scope="module")
def schemas():
    if not CRD_DIR.is_dir():
        pytest.skip(f"KubeRay CRDs not found at {CRD_DIR} (set {validate.CRD_DIR_ENV} to a directory with "
                    "ray.io_rayjobs.yaml etc.): cannot validate manifests offline")
    return validate.load_crd_schemas(CRD_DIR)


def load_one(path: Path) -> dict:
    docs = validate.load_documents(path)
    assert len(docs) == 1, f"{path}: expected one document"
    return docs[0]


@pytest.fixture
def rayjob() -> dict:
    return copy.deepcopy(load_one(DEPLOY / "kuberay" / "rayjob.yaml"))


@pytest.fixture
def raycluster() -> dict:
    return copy.deepcopy(load_one(DEPLOY / "kuberay" / "raycluster.yaml"))


def groups(cluster_spec: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in cluster_spec["workerGroupSpecs"]}


def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    spec = doc["spec"]
    cluster = spec["rayClusterSpec"] if doc["kind"] == "RayJob" else spec
    out = [("head", cluster["headGroupSpec"]["template"])]
    out += [(g["groupName"], g["template"]) for g in cluster["workerGroupSpecs"]]
    if "submitterPodTemplate" in spec:
        out.append(("submitter", spec["submitterPodTemplate"]))
    return out


# ====================================================================== the manifests validate


def test_manifests_exist():
    names = {p.name for p in MANIFESTS}
    assert {"rayjob.yaml", "raycluster.yaml"} <= names, names


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_deploy_manifest_validates(schemas, path):
    report = validate.validate_file(path, schemas, ROOT, security=True)
    assert report.errors == [], "\n".join(report.errors)
    assert report.checked >= 1, f"{path}: no KubeRay manifest in it"


@pytest.mark.parametrize("path", SAMPLES or [None], ids=[p.name for p in SAMPLES] or ["no-samples"])
def test_official_sample_validates(schemas, path):
    if path is None:
        pytest.skip(f"no official KubeRay samples under {CRD_DIR.parent / 'samples'}")
    report = validate.validate_file(path, schemas, ROOT)
    assert report.errors == [], "\n".join(report.errors)
    assert report.checked >= 1


def test_cli_exit_codes(schemas, tmp_path, rayjob, capsys):
    assert validate.main([str(p) for p in MANIFESTS] + ["--security"]) == 0
    rayjob["spec"]["ttlSecondsAfterFinished"] = "x"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(rayjob))
    assert validate.main([str(bad)]) == 1
    assert "$.spec.ttlSecondsAfterFinished" in capsys.readouterr().err


# ====================================================================== the validator rejects what kubectl would


def errors_of(doc: dict, schemas: dict, **kw) -> list[str]:
    return validate.validate_manifest(doc, schemas, kw.pop("repo_root", ROOT), **kw)


def test_typo_field_fails(schemas, rayjob):
    rayjob["spec"]["shutdownAfterJobFinish"] = rayjob["spec"].pop("shutdownAfterJobFinishes")
    errors = errors_of(rayjob, schemas)
    assert any(e.startswith("$.spec.shutdownAfterJobFinish: unknown field") for e in errors), errors


def test_wrong_types_fail(schemas, rayjob):
    rayjob["spec"]["ttlSecondsAfterFinished"] = "x"
    rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "two"
    rayjob["spec"]["shutdownAfterJobFinishes"] = "yes"
    errors = errors_of(rayjob, schemas)
    paths = {e.split(":")[0] for e in errors}
    assert {"$.spec.ttlSecondsAfterFinished", "$.spec.rayClusterSpec.workerGroupSpecs[0].replicas",
            "$.spec.shutdownAfterJobFinishes"} <= paths, errors


def test_unknown_field_fails_deep_in_the_pod_template(schemas, raycluster):
    container = raycluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    container["gpus"] = 1
    raycluster["spec"]["headGroupSpec"]["serviceTyp"] = "ClusterIP"
    errors = errors_of(raycluster, schemas)
    assert "$.spec.workerGroupSpecs[0].template.spec.containers[0].gpus: unknown field 'gpus' " \
           "(not in the RayCluster schema)" in errors, errors
    assert any(e.startswith("$.spec.headGroupSpec.serviceTyp:") for e in errors), errors


def test_int32_bounds_enum_and_required(schemas, raycluster):
    worker = raycluster["spec"]["workerGroupSpecs"][0]
    worker["maxReplicas"] = 2**31  # int32 overflow
    del worker["groupName"]  # required, no default
    raycluster["spec"]["headGroupSpec"]["serviceType"] = 7
    errors = errors_of(raycluster, schemas)
    assert any(e.startswith("$.spec.workerGroupSpecs[0].maxReplicas:") for e in errors), errors
    assert any("'groupName' is a required property" in e for e in errors), errors
    assert any(e.startswith("$.spec.headGroupSpec.serviceType:") for e in errors), errors


def test_required_with_default_and_int_or_string_pass(schemas, raycluster):
    worker = raycluster["spec"]["workerGroupSpecs"][0]
    del worker["minReplicas"], worker["maxReplicas"]  # required, but defaulted by the API server
    limits = worker["template"]["spec"]["containers"][0]["resources"]["limits"]
    limits["cpu"] = 8  # int-or-string: an integer quantity is fine
    assert errors_of(raycluster, schemas) == []
    limits["cpu"] = ["8"]
    errors = errors_of(raycluster, schemas)
    assert any(e.startswith("$.spec.workerGroupSpecs[0].template.spec.containers[0].resources.limits.cpu:")
               for e in errors), errors


def test_conversion_rules():
    nullable = validate.convert_schema({"type": "string", "format": "date-time", "nullable": True})
    assert nullable["type"] == ["string", "null"]
    i32 = validate.convert_schema({"type": "integer", "format": "int32", "minimum": 0})
    assert (i32["minimum"], i32["maximum"]) == (0, 2**31 - 1)
    ios = validate.convert_schema({"anyOf": [{"type": "integer"}, {"type": "string"}],
                                   "x-kubernetes-int-or-string": True})
    assert ios == {"type": ["integer", "string"]}
    obj = validate.convert_schema({"type": "object", "required": ["a", "b"],
                                   "properties": {"a": {"type": "integer", "default": 1}, "b": {"type": "string"}}})
    assert obj["required"] == ["b"] and obj["additionalProperties"] is False
    loose = validate.convert_schema({"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                                     "properties": {"a": {"type": "string"}}})
    assert "additionalProperties" not in loose


def test_api_version_kind_and_metadata(schemas, rayjob):
    assert errors_of(rayjob, schemas) == []
    rayjob["metadata"]["annotations"] = {"owner": "rlhf"}
    rayjob["metadata"]["uid"] = "anything"  # metadata is a generic object
    assert errors_of(rayjob, schemas) == []
    wrong = dict(rayjob, apiVersion="ray.io/v1alpha1")
    assert any(e.startswith("$.apiVersion:") for e in errors_of(wrong, schemas))
    unknown = dict(rayjob, kind="RayBatch")
    assert any(e.startswith("$.kind:") for e in errors_of(unknown, schemas))
    notes: list[str] = []
    assert errors_of({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}, schemas,
                     notes=notes) == []
    assert notes and "not a KubeRay kind" in notes[0]
    assert "RayService" in schemas


def test_duplicate_keys_and_multi_document(schemas, tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("apiVersion: ray.io/v1\nkind: RayCluster\nkind: RayCluster\nmetadata: {name: x}\nspec: {}\n")
    report = validate.validate_file(dup, schemas, ROOT)
    assert report.errors and "duplicate key" in report.errors[0]
    multi = tmp_path / "multi.yaml"
    multi.write_text((DEPLOY / "kuberay" / "raycluster.yaml").read_text()
                     + "\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {}\n---\n"
                     + "apiVersion: ray.io/v1\nkind: RayCluster\nmetadata: {name: y}\nspec: {bogus: 1}\n")
    report = validate.validate_file(multi, schemas, ROOT)
    assert report.checked == 2 and len(report.notes) == 1
    assert report.errors == [
        "document 2 (RayCluster/y): $.spec: 'headGroupSpec' is a required property",
        "document 2 (RayCluster/y): $.spec.bogus: unknown field 'bogus' (not in the RayCluster schema)",
    ], report.errors


# ====================================================================== the entrypoint's tether config


def test_entrypoint_config_exists_and_validates(rayjob):
    entrypoint = rayjob["spec"]["entrypoint"]
    assert shlex.split(entrypoint)[:3] == ["python", "-m", "learner.main"]
    config = validate.entrypoint_config(entrypoint)
    assert config == "deploy/configs/gpu-smoke.yaml"
    assert (ROOT / config).is_file()
    from learner.config import load_config

    cfg = load_config(ROOT / config)
    assert cfg.rollout.engine == "vllm" and cfg.learner.zero_stage == 2
    assert cfg.cluster.rollout.num_gpus == 1 and cfg.cluster.learner.num_gpus == 1
    assert 0 < cfg.cluster.reference.num_gpus <= 1
    assert cfg.run.iterations <= 10 and cfg.run.output_dir == "/tmp/tether-runs"
    assert validate.check_job_config(config, ROOT)[0] == []


def test_missing_or_invalid_config_fails(schemas, rayjob, tmp_path):
    rayjob["spec"]["entrypoint"] = "python -m learner.main --config=deploy/configs/nope.yaml"
    assert any("no such file" in e for e in errors_of(rayjob, schemas))
    (tmp_path / "bad.yaml").write_text("rollout:\n  engine: tgi\nrun:\n  iteratons: 3\n")
    rayjob["spec"]["entrypoint"] = "python -m learner.main --config bad.yaml"
    errors = errors_of(rayjob, schemas, repo_root=tmp_path)
    assert len(errors) == 1 and "not a valid JobConfig" in errors[0], errors
    assert "rollout.engine" in errors[0] and "iteratons" in errors[0]


def test_cluster_has_room_for_every_actor(schemas, rayjob):
    cfg = validate.load_job_config(ROOT / validate.entrypoint_config(rayjob["spec"]["entrypoint"]))
    cluster = rayjob["spec"]["rayClusterSpec"]
    assert validate.capacity_errors(cfg, cluster, "$") == []
    nodes = validate.cluster_nodes(cluster)
    assert sum(n.get("GPU", 0) for n in nodes) == 3
    # without the learner pod's second GPU the reference (0.5 GPU, pinned there) has nowhere to go
    groups(cluster)["learner"]["rayStartParams"]["num-gpus"] = "1"
    errors = errors_of(rayjob, schemas)
    assert len(errors) == 1 and "reference actor" in errors[0], errors
    groups(cluster)["learner"]["rayStartParams"]["resources"] = "{learner: 1}"  # not JSON
    errors = errors_of(rayjob, schemas)
    assert len(errors) == 1 and "cannot read the Ray resources" in errors[0], errors


# ====================================================================== GPUs per role


def test_rayjob_lifecycle_and_gpu_groups(rayjob):
    spec = rayjob["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec["ttlSecondsAfterFinished"], int) and spec["ttlSecondsAfterFinished"] > 0
    for doc_groups in (groups(spec["rayClusterSpec"]), groups(load_one(DEPLOY / "kuberay" / "raycluster.yaml")["spec"])):
        assert {"rollout", "learner"} <= set(doc_groups)
        for name in ("rollout", "learner"):
            group = doc_groups[name]
            container = group["template"]["spec"]["containers"][0]
            gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
            assert gpus >= 1 and int(container["resources"]["requests"]["nvidia.com/gpu"]) == gpus
            assert int(group["rayStartParams"]["num-gpus"]) == gpus
            assert name in validate.group_node_resources(group), f"{name} group declares no {name!r} resource"


def test_images_match_the_dockerfile(rayjob, raycluster):
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"^ARG RAY_IMAGE=rayproject/ray:(\d+\.\d+\.\d+)-py311-gpu$", dockerfile, re.MULTILINE)
    assert base, "the Dockerfile should build FROM a rayproject/ray GPU image"
    assert re.search(r"pip install '\.\[gpu\]'", dockerfile)
    users = re.findall(r"^USER (\S+)", dockerfile, re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    for doc in (rayjob, raycluster):
        cluster = doc["spec"].get("rayClusterSpec", doc["spec"])
        assert cluster["rayVersion"] == base.group(1)
        for _, template in pod_templates(doc):
            for c in template["spec"]["containers"]:
                assert c["image"] == "tether-rlhf:latest"


# ====================================================================== security defaults


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_security_defaults(path):
    doc = load_one(path)
    cluster = doc["spec"].get("rayClusterSpec", doc["spec"])
    head = cluster["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    assert not head.get("enableIngress")
    assert head.get("headService", {}).get("spec", {}).get("type", "ClusterIP") == "ClusterIP"
    for role, template in pod_templates(doc):
        pod = template["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
            where = f"{path.name} {role}/{c['name']}"
            assert sc.get("runAsNonRoot") is True, where
            assert sc.get("runAsUser") == 1000, where
            assert c.get("securityContext", {}).get("allowPrivilegeEscalation") is False, where
            assert not sc.get("privileged"), where
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][part]), f"{where}: resources.{part}"
    assert validate.security_findings(doc) == []


def test_security_check_is_not_vacuous(rayjob):
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]
    head["serviceType"] = "LoadBalancer"
    worker = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    del worker["containers"][0]["resources"]["limits"]
    worker["securityContext"]["runAsNonRoot"] = False
    del worker["containers"][0]["securityContext"]["runAsNonRoot"]
    findings = validate.security_findings(rayjob)
    assert any("serviceType: must be ClusterIP" in f for f in findings)
    assert any("resources.limits.cpu: missing" in f for f in findings)
    assert any("runAsNonRoot" in f for f in findings)
    if SAMPLES:  # the official samples set no securityContext at all
        sample = validate.load_documents(CRD_DIR.parent / "samples" / "ray-cluster.sample.yaml")[0]
        assert any("allowPrivilegeEscalation" in f for f in validate.security_findings(sample))
