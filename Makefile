# Entry points: `make run` and `make test` set everything up on a fresh Debian 12 machine.
JOBS ?= $(shell nproc)
PRESET ?= release
MODEL ?= models/qwen3next-tiny-realvocab

.PHONY: deps build test run clean format python

deps:
	@scripts/install-deps.sh

build: deps
	@cmake --preset $(PRESET) >/dev/null
	@cmake --build --preset $(PRESET) -j $(JOBS)

test: build
	@ctest --preset $(PRESET) -j $(JOBS)

# The Python package with its module (python/recur/), ready for `pip install ./python`.
python: build
	@cp build/python/_recur*.so python/recur/
	@echo "python/recur is ready: pip install --no-build-isolation ./python"

run: build
	@scripts/run-main.sh $(MODEL)

clean:
	rm -rf build build-*

format:
	@find src tests bench python/src -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' | xargs clang-format -i
