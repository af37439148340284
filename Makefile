# The two commands of the README:
#   make run    install what is missing, build, run the main job on its built-in default
#   make test   install what is missing, build, run every test (GPU tests skip without a GPU)
BUILD ?= build
JOBS ?= $(shell nproc)
# CUDA is built whenever nvcc is found (on PATH or in the toolkit's standard location).
NVCC ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CMAKE_ARGS ?=
ifneq ($(strip $(NVCC)),)
CMAKE_ARGS += -DCMAKE_CUDA_COMPILER=$(NVCC)
endif

.PHONY: deps build run test clean
deps:
	@scripts/install_deps.sh

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS)
	cmake --build $(BUILD) -j$(JOBS)

run: build
	./$(BUILD)/moefq eval

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j$(JOBS)

clean:
	rm -rf $(BUILD)
