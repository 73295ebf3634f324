# Two commands do everything on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PROMPT ?= def parse_args(
# the prompt reaches the command through the environment, as typed: no make or shell expansion
# of its quotes, $ signs or backslashes on the way (make demo PROMPT='say "hi" $HOME')
export DEMO_PROMPT := $(value PROMPT)

.PHONY: demo test lint clean

# the demo needs only the package (and MKL on Linux x86-64); the tests need the test extra too
$(VENV)/.demo: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[mkl]"
	touch $@

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@ $(VENV)/.demo

demo: $(VENV)/.demo
	HF_HUB_OFFLINE=1 $(PY) -m tinydraft_mlx.generate --prompt "$$DEMO_PROMPT" --max-tokens 64 --verbose

# the tests in worker processes, one per core (at most 4: each loads its own fixtures), then
# the few that assert on wall-clock time (marked `serial`) alone
test: $(VENV)/.installed
	$(VENV)/bin/ruff check tinydraft_mlx tests bench training
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q --durations=10 -n auto --maxprocesses=4 --dist loadfile \
		-m "not serial"
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q --durations=5 -m serial

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
