# The README's two commands, `make demo` and `make test`, do all the set-up: they build a
# local virtual environment from nothing, with every package pinned in requirements-dev.txt.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all bench clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements-dev.txt
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# DeepSpeed's sdist, pinned: tests/test_deepspeed_code.py runs the text of its 1-bit optimizers
# from it (never installed, never imported as a package; tests/deepspeed_shim.py).
DEEPSPEED_SDIST := $(VENV)/deepspeed/deepspeed-0.19.6.tar.gz

$(DEEPSPEED_SDIST): | $(STAMP)
	$(BIN)/pip download --quiet --no-deps --no-binary :all: deepspeed==0.19.6 -d $(VENV)/deepspeed

# The main job: LAMB, 1-bit LAMB and 1-bit Adam pretraining a small BERT side by side, the 1-bit
# optimizers with the automatic freeze (the default, `--freeze auto`).
demo: $(STAMP)
	$(BIN)/onebitlamb compare --preset demo --out runs/demo

# The whole default test suite (the slow tests are covered by shorter ones; `make test-all` runs them too).
test: $(STAMP) $(DEEPSPEED_SDIST)
	ONEBITLAMB_REQUIRE_DEEPSPEED=1 $(BIN)/python -m pytest -q

test-all: $(STAMP) $(DEEPSPEED_SDIST)
	ONEBITLAMB_REQUIRE_DEEPSPEED=1 $(BIN)/python -m pytest -q -m ""

# The compression kernels against a memory copy, into BENCHMARKS.md (the other benchmarks: benchmarks/).
bench: $(STAMP)
	$(BIN)/python -m benchmarks.kernels

clean:
	rm -rf $(VENV) runs
