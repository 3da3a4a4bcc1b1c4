# `make test` and `make demo` do all the set-up on a fresh machine (idempotent).
PYTHON ?= $(shell pyenv which python 2>/dev/null || command -v python3.12)
# .venv: jax 0.11.2, the GPU machine's (constraints.txt); .venv-jax012: the newest supported
# release (constraints-jax012.txt). pyproject.toml allows both and everything between.
VENV := .venv
STAMP := $(VENV)/.installed
PY := $(VENV)/bin/python
VENV_JAX012 := .venv-jax012
PY_JAX012 := $(VENV_JAX012)/bin/python
JOBS ?= 2
# The CPU suite is compile-bound (tiny shapes): LLVM at -O0 takes ~20 % off its time (on 2
# cores: 1058 s -> about 850 s) and leaves every tolerance met. Not for tests/gpu runs.
PYTEST = XLA_FLAGS="$(XLA_FLAGS) --xla_backend_optimization_level=0" \
	$(1) -m pytest -n $(JOBS) -q --durations=25 tests

.PHONY: venv venv-jax012 test demo lint bench clean docs test-integrations

venv: $(STAMP)

venv-jax012: $(VENV_JAX012)/.installed

# $(VENV)/.installed from constraints.txt, $(VENV_JAX012)/.installed from
# constraints-jax012.txt: the same steps, in the stamp's folder.
%/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), sys.version' \
	  || (echo "Python >= 3.12 needed (pyenv: see .python-version)"; exit 1)
	test -x $*/bin/python || $(PYTHON) -m venv $*
	$*/bin/python -m pip install -q --upgrade pip
	$*/bin/python -m pip install -q -c $(CONSTRAINTS) -e ".[test,train,bench]"
	$*/bin/python -m pip install -q -c $(CONSTRAINTS) --no-deps keras-hub
	touch $@

$(STAMP): CONSTRAINTS := constraints.txt
$(STAMP): constraints.txt
$(VENV_JAX012)/.installed: CONSTRAINTS := constraints-jax012.txt
$(VENV_JAX012)/.installed: constraints-jax012.txt

# The suite twice: on jax 0.11.2, then on 0.12.1 (about 2 x 12 minutes on 2 cores).
test: venv venv-jax012
	$(PY) -m ruff check .
	$(call PYTEST,$(PY))
	$(call PYTEST,$(PY_JAX012))

# The seed's equivalence check, then the tiny transformer trained on the stdlib's source.
demo: venv
	$(PY) -m pallas_flash.tutorial.demo
	$(PY) -m models.train --preset tiny --overwrite --out runs/tiny

# The documentation site, offline, into site/ (mkdocs.yml; pages in docs/).
docs: venv
	$(PY) -m mkdocs build --strict

# The adapters for the heavy libraries (Gemma, MaxText) in a venv of their own, with the
# versions they were tested with; not part of `make test` (CI runs both).
INTEG_VENV := .venv-integrations
INTEG_PY := $(INTEG_VENV)/bin/python
MAXTEXT_DEPS := aqtp drjax huggingface_hub omegaconf pathwaysutils qwix sympy tiktoken tokamax \
  transformers

$(INTEG_VENV)/.installed: pyproject.toml constraints.txt constraints-integrations.txt
	test -x $(INTEG_PY) || $(PYTHON) -m venv $(INTEG_VENV)
	$(INTEG_PY) -m pip install -q --upgrade pip
	$(INTEG_PY) -m pip install -q -c constraints.txt -c constraints-integrations.txt \
	  -e ".[flax]" pytest optax gemma maxtext sentencepiece $(MAXTEXT_DEPS)
	touch $@

test-integrations: $(INTEG_VENV)/.installed
	XLA_FLAGS="$(XLA_FLAGS) --xla_backend_optimization_level=0" \
	  $(INTEG_PY) -m pytest -q --durations=10 tests_integrations

lint: venv
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) $(VENV_JAX012) .pytest_cache .ruff_cache
