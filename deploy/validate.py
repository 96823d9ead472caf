"""Offline validation of KubeRay manifests (RayJob, RayCluster, RayService) against KubeRay's own CRDs.

``kubectl --dry-run=client`` needs an API server, so instead each CRD's served ``v1``
``spec.versions[*].schema.openAPIV3Schema`` is converted to JSON Schema the way the API server reads it
(offline, without an API server):

- ``x-kubernetes-int-or-string`` becomes ``type: [integer, string]``;
- ``nullable: true`` lets ``null`` through;
- ``format: int32`` / ``int64`` get their integer bounds;
- a required field that has a default stops being required (the API server fills it in);
- an object with ``properties`` and without ``x-kubernetes-preserve-unknown-fields`` gets
  ``additionalProperties: false`` (kubectl's strict field validation: unknown fields and typos fail);
- ``x-kubernetes-list-type: set`` becomes ``uniqueItems: true``.

The top-level ``apiVersion`` must be the CRD's ``<group>/v1`` and ``kind`` the CRD's kind; ``metadata`` is a
generic object (name, namespace, labels, annotations are type-checked, anything else is accepted).
Duplicate keys in a YAML mapping are errors, as in kubectl's strict mode.

Not covered: the CRDs' CEL rules (``x-kubernetes-validations``), ``x-kubernetes-list-type: map`` key
uniqueness, ``format`` strings (date-time), and everything the operator's webhook/controller checks.

For a RayJob whose entrypoint passes ``--config PATH``, PATH (relative to the repository root) must exist
and validate as tether's JobConfig (``services.config.load_config``); the Ray cluster the RayJob creates
must then have room for every actor the config places (CPU, GPU and custom Ray resources per pod).

Core kinds that tether ships (a ``PersistentVolumeClaim``) are checked against a small schema of the fields
they may use (``CORE_SCHEMAS``; no Kubernetes schema is downloaded); other core kinds are skipped with a note.

``security_findings(doc)`` (CLI: ``--security``) checks this project's deployment policy on top: Services
are ClusterIP, no ingress, pods and containers run as non-root without privilege escalation, and every
container has resource requests and limits.

``policy_findings(doc)`` (CLI: ``--policy``) checks what a tether job needs from a cluster across pods:
- one shared volume (a PersistentVolumeClaim) mounted at the same path in the head and every worker group;
- Ray token auth on (``authOptions.mode: token``, Ray >= 2.52), and no container or runtime env that sets
  ``RAY_AUTH_MODE`` to anything else or writes a token into the manifest;
- ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1`` in every Ray container (tether defaults it to 0 where unset);
- ``RAY_JOB_STOP_WAIT_TIME_S`` on the head (time for the SIGTERM checkpoint), and the dashboard's
  ``RAY_PROMETHEUS_HOST`` / ``RAY_GRAFANA_HOST``;
- every GPU group's ``nvidia.com/gpu`` limit equal to its ``num-gpus``;
- for a RayJob's ``--config`` (with the entrypoint's ``--section.field value`` overrides): ``model.cache_dir``
  and a local ``run.output_dir`` lie on the shared volume (or ``run.output_dir`` is a remote URI), and every
  custom resource of ``cluster.<role>.resources`` is declared by a worker group, one with GPUs where the role
  asks for GPUs.

CLI: ``python deploy/validate.py [--security] [--policy] FILE...`` prints every problem with its JSON path and
exits 1 if there was any (2 on a usage problem, such as a missing CRD directory). The CRD directory is
``deploy/kuberay/crds`` (KubeRay v1.7, copied verbatim: deploy/kuberay/SOURCE.txt) unless
``TETHER_KUBERAY_CRDS`` names another.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import shlex
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CRD_DIR = REPO_ROOT / "deploy" / "kuberay" / "crds"
CRD_DIR_ENV = "TETHER_KUBERAY_CRDS"
CRD_VERSION = "v1"

INT_BOUNDS = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
MAX_MESSAGE = 300

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# ====================================================================== CRD -> JSON Schema


def crd_dir() -> Path:
    """The CRD directory: $TETHER_KUBERAY_CRDS, else deploy/kuberay/crds."""
    env = os.environ.get(CRD_DIR_ENV)
    return Path(env).expanduser() if env else DEFAULT_CRD_DIR


def _add_null(node: dict[str, Any]) -> None:
    types = node.get("type")
    if isinstance(types, str):
        node["type"] = [types, "null"]
    elif isinstance(types, list) and "null" not in types:
        node["type"] = [*types, "null"]
    if "enum" in node and None not in node["enum"]:
        node["enum"] = [*node["enum"], None]


def _has_type(node: dict[str, Any], name: str) -> bool:
    types = node.get("type")
    return types == name or (isinstance(types, list) and name in types)


def convert_schema(node: Any) -> Any:
    """One OpenAPI v3 (structural CRD) schema node, and everything under it, as JSON Schema."""
    if isinstance(node, list):
        return [convert_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: convert_schema(sub) for name, sub in value.items()}
        elif (key in ("items", "additionalProperties", "not") and isinstance(value, dict)) or key in (
            "anyOf", "allOf", "oneOf"
        ):
            out[key] = convert_schema(value)
        elif key == "description" or key.startswith("x-kubernetes-") or key == "nullable":
            continue  # handled below (or documentation only)
        else:
            out[key] = copy.deepcopy(value)

    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
        out.pop("anyOf", None)  # the CRD spells it anyOf: [{type: integer}, {type: string}]

    # OpenAPI 3.0 boolean exclusive bounds -> JSON Schema numeric ones
    for excl, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if out.get(excl) is True and bound in out:
            out[excl] = out.pop(bound)
        elif out.get(excl) is False:
            out.pop(excl)

    fmt = out.get("format")
    if fmt in INT_BOUNDS and _has_type(out, "integer"):
        lo, hi = INT_BOUNDS[fmt]
        out["minimum"] = max(out.get("minimum", lo), lo)
        out["maximum"] = min(out.get("maximum", hi), hi)

    if "required" in out:
        props = out.get("properties", {})
        required = [name for name in out["required"] if "default" not in props.get(name, {})]
        if required:
            out["required"] = required
        else:
            del out["required"]

    if "properties" in out and not node.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)

    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True

    if node.get("nullable"):
        _add_null(out)
    return out


GENERIC_METADATA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "generateName": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


QUANTITY = {"type": ["string", "integer", "number"],
            "pattern": r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"}

# The fields of core kinds that tether's manifests may use, typed as in Kubernetes' API (core/v1).
CORE_SCHEMAS: dict[str, dict[str, Any]] = {
    "PersistentVolumeClaim": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"type": "string", "const": "v1"},
            "kind": {"type": "string", "const": "PersistentVolumeClaim"},
            "metadata": {**copy.deepcopy(GENERIC_METADATA), "required": ["name"]},
            "spec": {
                "type": "object",
                "required": ["accessModes", "resources"],
                "additionalProperties": False,
                "properties": {
                    "accessModes": {"type": "array", "minItems": 1, "uniqueItems": True, "items": {
                        "enum": ["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]}},
                    "storageClassName": {"type": ["string", "null"]},
                    "volumeMode": {"enum": ["Filesystem", "Block"]},
                    "volumeName": {"type": "string"},
                    "volumeAttributesClassName": {"type": "string"},
                    "selector": {"type": "object"},
                    "dataSource": {"type": "object"},
                    "dataSourceRef": {"type": "object"},
                    "resources": {
                        "type": "object",
                        "required": ["requests"],
                        "additionalProperties": False,
                        "properties": {
                            "requests": {"type": "object", "required": ["storage"],
                                         "additionalProperties": False, "properties": {"storage": QUANTITY}},
                            "limits": {"type": "object", "additionalProperties": False,
                                       "properties": {"storage": QUANTITY}},
                        },
                    },
                },
            },
        },
    },
}


def crd_to_schema(crd: dict[str, Any], version: str = CRD_VERSION) -> tuple[str, dict[str, Any]]:
    """(kind, JSON Schema) of one CustomResourceDefinition's served ``version``."""
    spec = crd["spec"]
    kind = spec["names"]["kind"]
    served = [v for v in spec.get("versions", []) if v.get("name") == version and v.get("served", True)]
    if not served:
        raise ValueError(f"CRD {crd.get('metadata', {}).get('name', kind)} serves no version {version!r}")
    schema = convert_schema(served[0]["schema"]["openAPIV3Schema"])
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    props = schema.setdefault("properties", {})
    props["apiVersion"] = {"type": "string", "const": f"{spec['group']}/{version}"}
    props["kind"] = {"type": "string", "const": kind}
    props["metadata"] = copy.deepcopy(GENERIC_METADATA)
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    schema["additionalProperties"] = False
    return kind, schema


@functools.lru_cache(maxsize=8)
def _load_crd_schemas(directory: str, version: str) -> dict[str, dict[str, Any]]:
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"KubeRay CRD directory {path} does not exist (set {CRD_DIR_ENV})")
    schemas: dict[str, dict[str, Any]] = {}
    for file in sorted(path.glob("*.y*ml")):
        with file.open() as fh:
            for doc in yaml.load_all(fh, Loader=_Loader):
                if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                    kind, schema = crd_to_schema(doc, version)
                    schemas[kind] = schema
    if not schemas:
        raise FileNotFoundError(f"no CustomResourceDefinition found in {path}")
    return schemas


def load_crd_schemas(crd_dir_: str | Path | None = None,
                     version: str = CRD_VERSION) -> dict[str, dict[str, Any]]:
    """``{kind: JSON Schema}`` for every CRD in ``crd_dir_`` (default: :func:`crd_dir`). Cached: do not
    mutate."""
    return _load_crd_schemas(str(Path(crd_dir_ or crd_dir()).resolve()), version)


# ====================================================================== YAML


class _StrictLoader(_Loader):  # type: ignore[misc, valid-type]
    """Safe loader that rejects duplicate mapping keys (kubectl strict mode does too)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}",
                key_node.start_mark
            )
        seen[key] = loader.construct_object(value_node, deep=deep)
    return seen


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_documents(path: str | Path) -> list[Any]:
    """Every YAML document of ``path`` (empty documents dropped). Raises yaml.YAMLError on bad YAML."""
    with Path(path).open() as fh:
        return [doc for doc in yaml.load_all(fh, Loader=_StrictLoader) if doc is not None]


# ====================================================================== validation


def json_path(parts: Iterable[Any]) -> str:
    out = "$"
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.replace("_", "").replace("-", "").isalnum():
            out += f".{part}"
        else:
            out += f"[{json.dumps(part)}]"
    return out


def _short(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def _label(doc: dict[str, Any]) -> str:
    meta = doc.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return f"{doc.get('kind')}/{name or '?'}"


_VALIDATORS: dict[int, Draft202012Validator] = {}


def _validator_for(schema: dict[str, Any]) -> Draft202012Validator:
    validator = _VALIDATORS.get(id(schema))
    if validator is None or validator.schema is not schema:
        validator = _VALIDATORS[id(schema)] = Draft202012Validator(schema)
    return validator


def schema_errors(doc: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Every JSON Schema violation of ``doc``, as ``$.json.path: message``, in document order."""
    found: list[tuple[list[Any], str]] = []
    for err in _validator_for(schema).iter_errors(doc):
        path = list(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            allowed = set(err.schema.get("properties", {}))
            for extra in sorted(k for k in err.instance if k not in allowed):
                found.append(([*path, extra],
                              f"unknown field {extra!r} (not in the {doc.get('kind')} schema)"))
            continue
        found.append((path, _short(err.message)))
    found.sort(key=lambda item: [str(p) for p in item[0]])
    return [f"{json_path(path)}: {message}" for path, message in found]


def validate_manifest(
    doc: Any,
    schemas: dict[str, dict[str, Any]],
    repo_root: str | Path = REPO_ROOT,
    notes: list[str] | None = None,
) -> list[str]:
    """Problems of one manifest (empty: valid). Non-KubeRay kinds are skipped with a line in ``notes``."""
    if not isinstance(doc, dict):
        return [f"$: a manifest must be a mapping, got {type(doc).__name__}"]
    kind, api_version = doc.get("kind"), doc.get("apiVersion")
    if kind in CORE_SCHEMAS and api_version == CORE_SCHEMAS[kind]["properties"]["apiVersion"]["const"]:
        return schema_errors(doc, CORE_SCHEMAS[kind])
    if kind not in schemas:
        if isinstance(api_version, str) and api_version.startswith("ray.io/"):
            return [f"$.kind: {kind!r} is not a KubeRay kind (known: {', '.join(sorted(schemas))})"]
        if notes is not None:
            notes.append(f"skipped {_label(doc)} ({api_version}): not a KubeRay kind")
        return []
    errors = schema_errors(doc, schemas[kind])
    if kind == "RayJob":  # the room check needs a schema-valid cluster spec
        errors += rayjob_checks(doc, Path(repo_root), notes, check_capacity=not errors)
    return errors


# ====================================================================== RayJob: the tether config


def entrypoint_config(entrypoint: str) -> str | None:
    """The PATH of ``--config PATH`` / ``--config=PATH`` in a RayJob entrypoint, or None."""
    try:
        tokens = shlex.split(entrypoint)
    except ValueError:
        tokens = entrypoint.split()
    for i, token in enumerate(tokens):
        if token == "--config" and i + 1 < len(tokens):
            return tokens[i + 1]
        if token.startswith("--config="):
            return token.split("=", 1)[1]
    return None


def entrypoint_overrides(entrypoint: str) -> dict[str, Any]:
    """The ``--section.field value`` / ``--section.field=value`` settings of an entrypoint, as a nested dict.

    A flag without a value (``--run.overwrite``) is ``True``; values are read as YAML scalars."""
    try:
        tokens = shlex.split(entrypoint)
    except ValueError:
        tokens = entrypoint.split()
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("--") or "." not in token.split("=", 1)[0]:
            continue
        key, has_value, value = token[2:].partition("=")
        if not has_value:
            if i < len(tokens) and not tokens[i].startswith("--"):
                value, i = tokens[i], i + 1
            else:
                value = "true"
        node = overrides
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value) if value else value
    return overrides


def load_job_config(path: Path, overrides: dict[str, Any] | None = None):
    """``services.config.load_config(path, overrides)``, importing the project from ``REPO_ROOT`` if need
    be."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from services.config import load_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(path, overrides)


def check_job_config(
    config: str, repo_root: Path, overrides: dict[str, Any] | None = None
) -> tuple[list[str], Any]:
    """(errors, JobConfig or None) for the ``--config`` file of an entrypoint, relative to ``repo_root``,
    with the entrypoint's ``overrides`` on top."""
    where = "$.spec.entrypoint"
    path = Path(config)
    if path.is_absolute():
        message = (f"{where}: --config {config} is an absolute path; use one relative to the repository root "
                   "(the image's working directory) so it can be checked")
        return [message], None
    full = repo_root / path
    if not full.is_file():
        return [f"{where}: --config {config}: no such file under {repo_root}"], None
    try:
        cfg = load_job_config(full, overrides)
    except ImportError as err:
        return [f"{where}: cannot import services.config to check --config {config}: {err}"], None
    except Exception as err:  # noqa: BLE001 (pydantic ValidationError, ValueError, YAML errors)
        text = str(err).replace("\n", "\n    ")
        return [f"{where}: --config {config} is not a valid JobConfig: {text}"], None
    return [], cfg


def rayjob_checks(
    doc: dict[str, Any], repo_root: Path, notes: list[str] | None = None, check_capacity: bool = True
) -> list[str]:
    """RayJob checks beyond the schema: the YAML/JSON strings parse; the tether --config is valid and fits."""
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return []
    errors: list[str] = []
    runtime_env = spec.get("runtimeEnvYAML")
    if isinstance(runtime_env, str):
        try:
            parsed = yaml.safe_load(runtime_env)
        except yaml.YAMLError as err:
            errors.append(f"$.spec.runtimeEnvYAML: not valid YAML: {_short(str(err))}")
        else:
            if parsed is not None and not isinstance(parsed, dict):
                errors.append("$.spec.runtimeEnvYAML: must be a YAML mapping")
    if isinstance(spec.get("entrypointResources"), str):
        try:
            parsed = json.loads(spec["entrypointResources"])
        except json.JSONDecodeError as err:
            errors.append(f"$.spec.entrypointResources: not valid JSON: {err}")
        else:
            if not isinstance(parsed, dict):
                errors.append("$.spec.entrypointResources: must be a JSON object")

    entrypoint = spec.get("entrypoint")
    config = entrypoint_config(entrypoint) if isinstance(entrypoint, str) else None
    if config is None:
        return errors
    config_errors, cfg = check_job_config(config, repo_root, entrypoint_overrides(entrypoint))
    errors += config_errors
    if cfg is not None and check_capacity:
        if "rayClusterSpec" in spec:
            errors += capacity_errors(cfg, spec["rayClusterSpec"], "$.spec.rayClusterSpec")
        elif notes is not None:
            notes.append(f"{_label(doc)}: uses an existing cluster; "
                         f"its room for --config {config} is not checked")
    return errors


# ====================================================================== RayJob: room for every actor


def parse_quantity(value: Any) -> float:
    """A Kubernetes quantity ("500m", "2", "1Gi", 4) as a float in base units."""
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip()
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
                "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
    for suffix in sorted(suffixes, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * suffixes[suffix]
    return float(text)


def _ray_resources_param(value: str) -> dict[str, float]:
    """rayStartParams ``resources``: JSON, possibly shell-quoted as a JSON string (the KubeRay samples'
    form)."""
    parsed: Any = value
    for _ in range(3):
        if not isinstance(parsed, str):
            break
        parsed = json.loads(parsed.strip().strip("'"))
    if not isinstance(parsed, dict):
        raise TypeError(f"{value!r} is not a JSON object of resource amounts")
    return {str(k): float(v) for k, v in parsed.items()}


def group_node_resources(group: dict[str, Any]) -> dict[str, float]:
    """Ray resources of one pod of a head/worker group, as KubeRay's ``ray start`` would declare them."""
    params = group.get("rayStartParams") or {}
    containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or [{}]
    res = containers[0].get("resources") or {}
    limits, requests = res.get("limits") or {}, res.get("requests") or {}
    node: dict[str, float] = {}
    if "num-cpus" in params:
        node["CPU"] = float(params["num-cpus"])
    elif "cpu" in limits or "cpu" in requests:
        node["CPU"] = float(math.ceil(parse_quantity(limits.get("cpu", requests.get("cpu")))))
    gpus = [parse_quantity(v) for k, v in limits.items() if k.endswith("gpu")]
    if "num-gpus" in params:
        node["GPU"] = float(params["num-gpus"])
    elif gpus:
        node["GPU"] = sum(gpus)
    if "resources" in params:
        node.update(_ray_resources_param(params["resources"]))
    for name, amount in (group.get("resources") or {}).items():  # group-level resources override the params
        node[{"cpu": "CPU", "gpu": "GPU"}.get(name.lower(), name)] = parse_quantity(amount)
    return {k: v for k, v in node.items() if v}


def cluster_nodes(cluster_spec: dict[str, Any]) -> list[dict[str, float]]:
    """One resource dict per Ray node the cluster starts with (head first)."""
    nodes = [group_node_resources(cluster_spec.get("headGroupSpec") or {})]
    autoscaling = bool(cluster_spec.get("enableInTreeAutoscaling"))
    for group in cluster_spec.get("workerGroupSpecs") or []:
        if group.get("suspend"):
            continue
        count = (group.get("maxReplicas", 0) if autoscaling
                 else group.get("replicas", group.get("minReplicas", 0)))
        nodes += [group_node_resources(group)] * (int(count or 0) * int(group.get("numOfHosts", 1) or 1))
    return nodes


def job_bundles(cfg: Any) -> list[tuple[str, dict[str, float]]]:
    """(role, bundle) per actor, as learner.cluster.reserve builds the placement group."""
    roles = [
        ("rollout", cfg.cluster.rollout, cfg.rollout.num_engines),
        ("reference", cfg.cluster.reference,  # none where the learner ranks score the reference themselves
         (0 if cfg.learner.reference_in_learner or cfg.reference_copy_in_learner
          else cfg.reference.num_actors)),
        ("reward", cfg.cluster.reward, 0 if cfg.reward_in_learner else cfg.reward.num_actors),
        ("learner", cfg.cluster.learner, cfg.learner.world_size),
    ]
    out = []
    for role, res, count in roles:
        bundle = {"CPU": res.num_cpus, "GPU": res.num_gpus, **res.resources}
        bundle = {k: float(v) for k, v in bundle.items() if v} or {"CPU": 0.01}
        out += [(role, bundle)] * count
    return out


def capacity_errors(cfg: Any, cluster_spec: dict[str, Any], where: str) -> list[str]:
    """Every actor's bundle must fit some pod (first fit, largest first), or Ray waits for ever."""
    try:
        nodes = [dict(n) for n in cluster_nodes(cluster_spec)]
    except (TypeError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        return [f"{where}: cannot read the Ray resources of its groups (rayStartParams, resources): {err}"]
    bundles = sorted(job_bundles(cfg), key=lambda rb: (rb[1].get("GPU", 0), rb[1].get("CPU", 0)),
                     reverse=True)
    errors = []
    for role, bundle in bundles:
        for node in nodes:
            if all(node.get(k, 0) + 1e-9 >= v for k, v in bundle.items()):
                for k, v in bundle.items():
                    node[k] -= v
                break
        else:
            # before placing
            total = {k: sum(n.get(k, 0) for n in cluster_nodes(cluster_spec)) for k in bundle}
            errors.append(f"{where}: no pod has room for a {role} actor {bundle} "
                          f"(cluster totals for these: {total}; see cluster.{role} in the --config)")
    return errors


# ====================================================================== deployment policy


def _pod_templates(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    spec = doc.get("spec") or {}
    clusters = []
    if doc.get("kind") == "RayCluster":
        clusters.append(("$.spec", spec))
    elif doc.get("kind") == "RayJob":
        if "rayClusterSpec" in spec:
            clusters.append(("$.spec.rayClusterSpec", spec["rayClusterSpec"]))
        if "submitterPodTemplate" in spec:
            yield "$.spec.submitterPodTemplate", spec["submitterPodTemplate"]
    elif doc.get("kind") == "RayService" and "rayClusterConfig" in spec:
        clusters.append(("$.spec.rayClusterConfig", spec["rayClusterConfig"]))
    for where, cluster in clusters:
        yield f"{where}.headGroupSpec.template", (cluster.get("headGroupSpec") or {}).get("template") or {}
        for i, group in enumerate(cluster.get("workerGroupSpecs") or []):
            yield f"{where}.workerGroupSpecs[{i}].template", group.get("template") or {}


def _head_groups(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    spec = doc.get("spec") or {}
    key = {"RayCluster": None, "RayJob": "rayClusterSpec",
           "RayService": "rayClusterConfig"}.get(doc.get("kind"))
    cluster = spec if key is None else spec.get(key)
    if isinstance(cluster, dict) and "headGroupSpec" in cluster:
        prefix = "$.spec" if key is None else f"$.spec.{key}"
        yield f"{prefix}.headGroupSpec", cluster["headGroupSpec"]


def security_findings(doc: dict[str, Any]) -> list[str]:
    """This project's policy: ClusterIP only, no ingress, non-root, no privilege escalation,
    requests+limits."""
    findings: list[str] = []
    for where, head in _head_groups(doc):
        if head.get("serviceType") != "ClusterIP":
            findings.append(f"{where}.serviceType: must be ClusterIP (got {head.get('serviceType')!r}); "
                            "the dashboard and GCS are not exposed outside the cluster")
        service_type = ((head.get("headService") or {}).get("spec") or {}).get("type")
        if service_type not in (None, "ClusterIP"):
            findings.append(f"{where}.headService.spec.type: must be ClusterIP (got {service_type!r})")
        if head.get("enableIngress"):
            findings.append(f"{where}.enableIngress: must not be true")
    if doc.get("kind") == "RayService":
        svc = (doc.get("spec") or {}).get("serveService") or {}
        service_type = (svc.get("spec") or {}).get("type")
        if service_type not in (None, "ClusterIP"):
            findings.append(f"$.spec.serveService.spec.type: must be ClusterIP (got {service_type!r})")

    for where, template in _pod_templates(doc):
        pod = template.get("spec") or {}
        pod_sc = pod.get("securityContext") or {}
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            if pod.get(flag):
                findings.append(f"{where}.spec.{flag}: must not be true")
        containers = [("containers", i, c) for i, c in enumerate(pod.get("containers") or [])]
        containers += [("initContainers", i, c) for i, c in enumerate(pod.get("initContainers") or [])]
        if not containers:
            findings.append(f"{where}.spec.containers: no containers")
        for group, i, container in containers:
            at = f"{where}.spec.{group}[{i}]"
            sc = container.get("securityContext") or {}
            if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
                findings.append(f"{at}.securityContext.runAsNonRoot: must be true (here or in the pod's)")
            uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
            if uid is None or uid == 0:
                findings.append(f"{at}.securityContext.runAsUser: must be a non-zero uid (Ray images: 1000)")
            if sc.get("allowPrivilegeEscalation") is not False:
                findings.append(f"{at}.securityContext.allowPrivilegeEscalation: must be false")
            if sc.get("privileged"):
                findings.append(f"{at}.securityContext.privileged: must not be true")
            resources = container.get("resources") or {}
            for part in ("requests", "limits"):
                have = resources.get(part) or {}
                for name in ("cpu", "memory"):
                    if name not in have:
                        findings.append(f"{at}.resources.{part}.{name}: missing")
            limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
            for name, amount in requests.items():
                if name not in ("cpu", "memory", "ephemeral-storage") and limits.get(name) != amount:
                    findings.append(f"{at}.resources: extended resource {name!r} "
                                    "needs equal requests and limits")
    return findings


# ================================================================== across pods: storage, auth, stop, metrics

MIN_TOKEN_AUTH_RAY = (2, 52, 0)  # KubeRay refuses authOptions.mode token below this rayVersion
MIN_STOP_WAIT_S = 30  # Ray's default of 3 s kills the job before its SIGTERM checkpoint is written
METRICS_ENV = ("RAY_PROMETHEUS_HOST", "RAY_GRAFANA_HOST")


def _cluster_specs(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    spec = doc.get("spec") or {}
    key = {"RayCluster": None, "RayJob": "rayClusterSpec",
           "RayService": "rayClusterConfig"}.get(doc.get("kind"), "-")
    cluster = spec if key is None else spec.get(key)
    if isinstance(cluster, dict):
        yield ("$.spec" if key is None else f"$.spec.{key}"), cluster


def _ray_container(group: dict[str, Any]) -> dict[str, Any]:
    """The Ray container of a group's pod: KubeRay starts Ray in the first one."""
    containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or [{}]
    return containers[0] if isinstance(containers[0], dict) else {}


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env") or [] if isinstance(e, dict) and "name" in e}


def _groups(cluster: dict[str, Any], where: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(json path, name, group) for the head and every worker group."""
    out = [(f"{where}.headGroupSpec", "head", cluster.get("headGroupSpec") or {})]
    for i, group in enumerate(cluster.get("workerGroupSpecs") or []):
        out.append((f"{where}.workerGroupSpecs[{i}]", str(group.get("groupName", i)), group))
    return out


def claim_mounts(group: dict[str, Any]) -> set[tuple[str, str]]:
    """(claimName, mountPath) of every PersistentVolumeClaim the group's Ray container mounts read-write."""
    volumes = ((group.get("template") or {}).get("spec") or {}).get("volumes") or []
    claims = {v["name"]: (v.get("persistentVolumeClaim") or {}).get("claimName") for v in volumes
              if isinstance(v, dict) and "name" in v and isinstance(v.get("persistentVolumeClaim"), dict)}
    return {(claims[m["name"]], str(m.get("mountPath", "")).rstrip("/") or "/")
            for m in _ray_container(group).get("volumeMounts") or []
            if isinstance(m, dict) and claims.get(m.get("name")) and not m.get("readOnly")}


def shared_volume(cluster: dict[str, Any], where: str = "$") -> tuple[tuple[str, str] | None, list[str]]:
    """((claimName, mountPath) that the head and every worker group mount, or None; findings)."""
    groups = _groups(cluster, where)
    mounts = {name: claim_mounts(group) for _, name, group in groups}
    common = set.intersection(*mounts.values()) if mounts else set()
    if common:
        return min(common), []
    seen = "; ".join(f"{name}: {', '.join(f'{c} at {p}' for c, p in sorted(m)) or 'none'}"
                     for name, m in mounts.items())
    message = (f"{where}: no PersistentVolumeClaim is mounted read-write at the same path in the head and "
               "every worker group (tether passes paths between pods: model cache, runs, checkpoints); "
               f"mounts: {seen}")
    return None, [message]


def _version_tuple(text: Any) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in str(text).split(".")[:3])
    except ValueError:
        return None


def _auth_findings(doc: dict[str, Any], where: str, cluster: dict[str, Any]) -> list[str]:
    findings = []
    auth = cluster.get("authOptions") or {}
    if auth.get("mode") != "token":
        findings.append(f"{where}.authOptions.mode: must be 'token' (Ray token auth); "
                        f"got {auth.get('mode')!r}")
    else:
        version = _version_tuple(cluster.get("rayVersion"))
        if version is None or version < MIN_TOKEN_AUTH_RAY:
            findings.append(f"{where}.rayVersion: token auth needs Ray >= 2.52.0; "
                            f"got {cluster.get('rayVersion')!r}")
    if auth.get("enableK8sTokenAuth") and doc.get("kind") != "RayCluster":
        findings.append(f"{where}.authOptions.enableK8sTokenAuth: KubeRay supports it for a RayCluster only")
    return findings


def _env_findings(doc: dict[str, Any]) -> list[str]:
    """No container may turn token auth off or carry the token itself."""
    findings = []
    for where, template in _pod_templates(doc):
        pod = template.get("spec") or {}
        containers = [("containers", i, c) for i, c in enumerate(pod.get("containers") or [])]
        containers += [("initContainers", i, c) for i, c in enumerate(pod.get("initContainers") or [])]
        for group, i, container in containers:
            env = _env(container)
            at = f"{where}.spec.{group}[{i}].env"
            mode = env.get("RAY_AUTH_MODE", {})
            if "RAY_AUTH_MODE" in env and mode.get("value") != "token":
                findings.append(f"{at}.RAY_AUTH_MODE: {mode.get('value')!r} turns token auth off for this "
                                "container; leave it unset (KubeRay sets 'token')")
            if "value" in env.get("RAY_AUTH_TOKEN", {}):
                findings.append(f"{at}.RAY_AUTH_TOKEN: a token written into the manifest; KubeRay injects it "
                                "from the Secret (authOptions.secretName, or the one it generates)")
    runtime_env = (doc.get("spec") or {}).get("runtimeEnvYAML")
    if isinstance(runtime_env, str):
        try:
            env_vars = (yaml.safe_load(runtime_env) or {}).get("env_vars") or {}
        except (yaml.YAMLError, AttributeError):
            env_vars = {}  # reported by rayjob_checks
        if isinstance(env_vars, dict) and env_vars.get("RAY_AUTH_MODE", "token") != "token":
            findings.append(f"$.spec.runtimeEnvYAML.env_vars.RAY_AUTH_MODE: {env_vars['RAY_AUTH_MODE']!r} "
                            "turns token auth off for the job's workers")
    return findings


def _node_env_findings(where: str, cluster: dict[str, Any]) -> list[str]:
    """Every Ray container sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1: tether defaults it to 0 (one machine)
    where unset, and with 0 Ray takes 127.0.0.1 as the node's address instead of the pod's."""
    findings = []
    for at, name, group in _groups(cluster, where):
        value = _env(_ray_container(group)).get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", {}).get("value")
        if value != "1":
            findings.append(f"{at}.template.spec.containers[0].env.RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER: "
                            f"must be '1' in the {name} pod (got {value!r}); tether defaults it to 0, which "
                            "makes Ray use 127.0.0.1")
    return findings


def _head_env_findings(where: str, cluster: dict[str, Any]) -> list[str]:
    findings = []
    at = f"{where}.headGroupSpec.template.spec.containers[0].env"
    env = _env(_ray_container(cluster.get("headGroupSpec") or {}))
    wait = env.get("RAY_JOB_STOP_WAIT_TIME_S", {}).get("value")
    try:
        wait_s = int(wait)
    except (TypeError, ValueError):
        wait_s = None
    if wait_s is None or wait_s < MIN_STOP_WAIT_S:
        findings.append(f"{at}.RAY_JOB_STOP_WAIT_TIME_S: must be whole seconds >= {MIN_STOP_WAIT_S} "
                        f"(got {wait!r}): `ray job stop` sends SIGTERM and kills the job this long after; "
                        "tether checkpoints in between")
    for name in (*METRICS_ENV, "RAY_GRAFANA_IFRAME_HOST"):
        value = env.get(name, {}).get("value")
        if value is None and name not in METRICS_ENV:
            continue
        if not (isinstance(value, str) and value.startswith(("http://", "https://"))):
            findings.append(f"{at}.{name}: must be an http(s) URL for the dashboard's metrics view "
                            f"(got {value!r})")
    return findings


def _gpu_findings(where: str, cluster: dict[str, Any]) -> list[str]:
    findings = []
    for at, name, group in _groups(cluster, where):
        limits = (_ray_container(group).get("resources") or {}).get("limits") or {}
        limit = sum(parse_quantity(v) for k, v in limits.items() if k.endswith("gpu"))
        params = group.get("rayStartParams") or {}
        if "num-gpus" in params and float(params["num-gpus"]) != limit:
            findings.append(f"{at}.rayStartParams.num-gpus: {params['num-gpus']} but the {name} pod's GPU "
                            f"limit is {limit:g}: Ray would schedule on GPUs the pod does not have "
                            "(or leave some idle)")
    return findings


def _under(path: str, mount: str) -> bool:
    return Path(path) == Path(mount) or Path(mount) in Path(path).parents


def job_storage_findings(cfg: Any, cluster: dict[str, Any], where: str = "$") -> list[str]:
    """The job's cache and run directory must be where every pod sees them: the shared volume, or a URI."""
    shared, _ = shared_volume(cluster, where)
    mount = shared[1] if shared else None
    findings = []
    output = cfg.run.output_dir
    scheme, sep, rest = output.partition("://")
    remote = bool(sep) and scheme != "file"
    local_output = rest if sep and scheme == "file" else output
    if not remote:
        if mount is None:
            findings.append(f"{where}: run.output_dir {output!r} is a local path but the pods share no "
                            "volume; mount a ReadWriteMany claim in every group or use a URI (s3://, gs://)")
        elif not (local_output.startswith("/") and _under(local_output, mount)):
            findings.append(f"{where}: run.output_dir {output!r} is not on the shared volume ({mount}): "
                            "the learner's checkpoint shards and the driver's manifest would land on "
                            "different pods")
    cache = cfg.model.cache_dir
    if mount is not None and not (cache.startswith("/") and _under(cache, mount)):
        findings.append(f"{where}: model.cache_dir {cache!r} is not on the shared volume ({mount}): actors "
                        "on other pods cannot open what the driver caches there")
    return findings


def job_resource_findings(cfg: Any, cluster: dict[str, Any], where: str = "$") -> list[str]:
    """Every custom resource a role asks for is a worker group's; a GPU role's is a group with GPUs."""
    groups = [(name, group_node_resources(group)) for _, name, group in _groups(cluster, where)[1:]]
    declared = sorted({k for _, node in groups for k in node if k not in ("CPU", "GPU", "memory")})
    findings = []
    for role in ("rollout", "reference", "reward", "learner"):
        res = getattr(cfg.cluster, role)
        for name in res.resources:
            owners = [(g, node) for g, node in groups if node.get(name)]
            if not owners:
                findings.append(f"{where}: cluster.{role}.resources names {name!r}, which no worker group "
                                f"declares (declared: {declared}); the {role} actors would wait for ever")
            elif res.num_gpus and not any(node.get("GPU") for _, node in owners):
                findings.append(f"{where}: cluster.{role} asks for {res.num_gpus:g} GPU on {name!r}, but the "
                                f"groups declaring it ({', '.join(g for g, _ in owners)}) have no GPUs")
    return findings


def policy_findings(doc: dict[str, Any], repo_root: str | Path = REPO_ROOT) -> list[str]:
    """What a tether job needs across pods (module docstring, ``--policy``); empty: all there."""
    if doc.get("kind") == "PersistentVolumeClaim":
        modes = (doc.get("spec") or {}).get("accessModes") or []
        if "ReadWriteMany" not in modes:
            return [(f"$.spec.accessModes: must include ReadWriteMany (got {modes}): the head and the GPU "
                     "workers run on different nodes and all write to the shared volume")]
        return []
    findings: list[str] = []
    for where, cluster in _cluster_specs(doc):
        findings += shared_volume(cluster, where)[1]
        findings += _auth_findings(doc, where, cluster)
        findings += _head_env_findings(where, cluster)
        findings += _node_env_findings(where, cluster)
        findings += _gpu_findings(where, cluster)
    if any(True for _ in _cluster_specs(doc)):
        findings += _env_findings(doc)
    spec = doc.get("spec") or {}
    entrypoint = spec.get("entrypoint")
    config = (entrypoint_config(entrypoint) if doc.get("kind") == "RayJob" and isinstance(entrypoint, str)
              else None)
    if config is not None and isinstance(spec.get("rayClusterSpec"), dict):
        _, cfg = check_job_config(config, Path(repo_root), entrypoint_overrides(entrypoint))
        if cfg is not None:  # a bad config is already an error of validate_manifest
            cluster = spec["rayClusterSpec"]
            try:
                findings += job_resource_findings(cfg, cluster, "$.spec.entrypoint")
            except (TypeError, ValueError) as err:
                findings.append(f"$.spec.rayClusterSpec: cannot read the Ray resources of its groups: {err}")
            findings += job_storage_findings(cfg, cluster, "$.spec.entrypoint")
    return findings


# ====================================================================== files and CLI


@dataclass
class FileReport:
    path: Path
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked: int = 0  # manifests validated: KubeRay kinds and the core kinds of CORE_SCHEMAS


def validate_file(
    path: str | Path,
    schemas: dict[str, dict[str, Any]],
    repo_root: str | Path = REPO_ROOT,
    security: bool = False,
    policy: bool = False,
) -> FileReport:
    """Validate every document of a (multi-document) YAML file; errors are prefixed with the document.
    ``security`` adds :func:`security_findings`, ``policy`` adds :func:`policy_findings`."""
    report = FileReport(Path(path))
    try:
        docs = load_documents(path)
    except (OSError, yaml.YAMLError) as err:
        report.errors.append(f"cannot read YAML: {_short(str(err))}")
        return report
    if not docs:
        report.errors.append("no YAML documents")
    for index, doc in enumerate(docs):
        where = f"document {index}" + (f" ({_label(doc)})" if isinstance(doc, dict) else "")
        errors = validate_manifest(doc, schemas, repo_root, report.notes)
        if isinstance(doc, dict) and (doc.get("kind") in schemas or doc.get("kind") in CORE_SCHEMAS):
            report.checked += 1
            if security and doc.get("kind") in schemas:
                errors += security_findings(doc)
            if policy:
                errors += policy_findings(doc, repo_root)
        report.errors += [f"{where}: {e}" for e in errors]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="YAML manifests (multi-document files allowed)")
    parser.add_argument("--crds", type=Path, default=None, help=f"CRD directory (default: ${CRD_DIR_ENV} or "
                        f"{DEFAULT_CRD_DIR})")
    parser.add_argument("--repo-root", type=Path, default=REPO_ROOT,
                        help="where entrypoint --config paths start")
    parser.add_argument("--security", action="store_true", help="also check this project's deployment policy")
    parser.add_argument("--policy", action="store_true", help="also check what a tether job needs across "
                        "pods: shared volume, token auth, stop wait, metrics env, its --config's paths and "
                        "resources")
    args = parser.parse_args(argv)
    try:
        schemas = load_crd_schemas(args.crds)
    except (OSError, ValueError, yaml.YAMLError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    failed = False
    for path in args.files:
        report = validate_file(path, schemas, args.repo_root, args.security, args.policy)
        for note in report.notes:
            print(f"{path}: note: {note}")
        for error in report.errors:
            print(f"{path}: {error}", file=sys.stderr)
        if report.errors:
            failed = True
        else:
            print(f"{path}: ok ({report.checked} manifest{'s' if report.checked != 1 else ''} checked)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
