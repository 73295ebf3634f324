# Two commands do everything on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PROMPT ?= def parse_args(

.PHONY: demo test lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(PY) -m tinydraft_mlx.generate --prompt "$(PROMPT)" --max-tokens 64 --verbose

test: $(VENV)/.installed
	$(VENV)/bin/ruff check tinydraft_mlx tests bench
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
