# Every target sets itself up: a fresh machine needs only python3.11 and this file.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build is served locally; a loose spec pulls a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# NeMo-Run in a directory of its own, put on PYTHONPATH only by its test: its dependencies pin urllib3 and
	# anyio below what the Hugging Face hub needs. leptonai pinned: newer releases lack a module it imports.
	$(BIN)/python -m pip install -q --target $(VENV)/nemo-run 'nemo_run==0.11.1' 'leptonai==0.26.6'
	# nvidia-resiliency-ext requires the deprecated pynvml package, an import hook that makes every `import torch`
	# print a FutureWarning; nvidia-ml-py (also required) provides the same pynvml module without it. Last: a
	# later pip install would report the missing requirement.
	$(BIN)/python -m pip uninstall -q -y pynvml
	@touch $(STAMP)

# two workers, whole files each: the tests are real jobs (subprocesses, waits on them), so the two cores overlap
# them; a file's tests stay together (they share fixtures such as a file's reference run)
# our code compiled once first: where PYTHONDONTWRITEBYTECODE is set, every test's agents, fork servers and workers
# would otherwise compile it again from source (half a second of CPU each on 2 busy cores)
test: venv
	$(BIN)/python -m compileall -q -j 0 resilient tests recipes examples policies bench >/dev/null
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25 tests

# make demo DEMO_FLAGS=--gcs: the persistent tier on the bundled GCS server; --quick, --seed N, --steps N
DEMO_FLAGS ?=
demo: venv
	$(BIN)/python examples/demo.py $(DEMO_FLAGS)

bench: venv
	$(BIN)/python bench/restart.py

clean:
	rm -rf $(VENV) runs .pytest_cache
