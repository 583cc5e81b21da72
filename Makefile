# The two commands of the README:
#   make demo   install what is missing, build, run the driver's part4 (flash) check
#   make test   install what is missing, build, run the whole test suite
#   make bench  the README's performance tables on this machine (benchmarks/bench.py summary)
#   make sanitize   the suite against an AddressSanitizer + UBSan build (.ci/sanitize: ~4 min build, ~8 min run)
#   make wheel      the wheel into dist/ (kernels compiled ahead of time, stripped; pip install dist/*.whl)
#   make wheel-check   builds the wheel in a fresh virtualenv, installs it, checks it from another directory
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: deps build demo test sanitize wheel wheel-check bench clean

deps:
	$(PIP) install -q -r requirements.txt

# The kernels are compiled on first use (JIT, cached under build/); this just triggers it.
build: deps
	$(PYTHON) -c "import cs149gpt; print('cs149gpt kernels:', cs149gpt.isa())"

demo: build
	$(PYTHON) cs149gpt/gpt149.py part4

test: build
	$(PYTHON) -m pytest -q tests

sanitize: deps
	PYTHON=$(PYTHON) .ci/sanitize

# torch is the one already installed (requirements.txt's pin): the wheel requires exactly that release.
wheel: deps
	$(PIP) install -q "setuptools>=64" wheel
	MAX_JOBS=$${MAX_JOBS:-$$(nproc)} $(PIP) wheel . --no-build-isolation --no-deps -w dist

wheel-check:
	PYTHON=$(PYTHON) .ci/wheel_check

bench: build
	$(PYTHON) benchmarks/bench.py summary

clean:
	rm -rf build dist cs149gpt/_C*.so *.egg-info
