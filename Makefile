# Two entry points on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Both create the project venv on first use. torch comes from the CPU wheel pinned here;
# pyproject.toml only states the minimum version that works.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.trident-installed

BENCH_VENV ?= .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.deepspeed-installed

.PHONY: demo test bench bench-zero bench-deepspeed-scripts gpu-check install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	echo "$(TORCH_SPEC)" > $(VENV)/constraints.txt
	PIP_CONSTRAINT=$(VENV)/constraints.txt $(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/trident train --nproc 2

test: $(STAMP)
	$(PY) -m pytest -q

# Every strategy beside its peer in one interleaved run (bench/suite.py; tables and plot in
# bench/results/). The DeepSpeed rows need the bench venv: made when missing (not remade when
# pyproject.toml changes, which would reinstall DeepSpeed). BENCH_ARGS=--quick: a 2-repeat smoke run.
BENCH_ARGS ?=
bench:
	@test -f $(BENCH_STAMP) || $(MAKE) $(BENCH_STAMP)
	$(BENCH_VENV)/bin/python bench/suite.py $(BENCH_ARGS)

# DeepSpeed lives in a venv of its own (bench/README.md, "DeepSpeed on CPU with gloo"): torch is
# installed first and pinned, so the DeepSpeed install can never pull a CUDA build.
$(BENCH_STAMP): pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --upgrade pip setuptools wheel
	$(BENCH_VENV)/bin/pip install --quiet "$(TORCH_SPEC)"
	echo "$(TORCH_SPEC)" > $(BENCH_VENV)/constraints.txt
	DS_BUILD_OPS=0 PIP_CONSTRAINT=$(BENCH_VENV)/constraints.txt \
		$(BENCH_VENV)/bin/pip install --quiet --no-build-isolation "deepspeed==0.19.*"
	PIP_CONSTRAINT=$(BENCH_VENV)/constraints.txt $(BENCH_VENV)/bin/pip install --quiet -e .
	touch $(BENCH_STAMP)

bench-zero: $(BENCH_STAMP)
	$(BENCH_VENV)/bin/python bench/zero_vs_peers.py

# The same unmodified DeepSpeed scripts under DeepSpeed (bench venv, which also needs transformers for
# the Hugging Face script) and under trident (project venv, `trident launch --as-deepspeed`).
bench-deepspeed-scripts: $(STAMP)
	@test -f $(BENCH_STAMP) || $(MAKE) $(BENCH_STAMP)
	PIP_CONSTRAINT=$(BENCH_VENV)/constraints.txt $(BENCH_VENV)/bin/pip install --quiet "transformers>=5.24"
	$(PY) bench/deepspeed_scripts.py

# Needs CUDA (CI has none), so it is not part of `make test`; README.md, "GPU check".
gpu-check: $(STAMP)
	$(VENV)/bin/trident doctor --gpu

clean:
	rm -rf $(VENV) $(BENCH_VENV) runs .pytest_cache
