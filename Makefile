# The two set-up commands of the README:
#   make run   install dependencies, build, fetch the default model, run the main job
#   make test  install dependencies, build, run the whole test suite (what CI runs)
BUILD ?= build
MODEL ?= models/SmolLM2-135M-Instruct.Q4_1.gguf
JOBS ?= $(shell nproc)
FUZZ_SECONDS ?= 20

.PHONY: deps build model run test test-cpu fuzz gpu-test clean

deps:
	@bash scripts/install_deps.sh

build: deps
	@cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

model:
	@bash scripts/fetch_model.sh

run: build model
	@bash scripts/main_job.sh $(BUILD)/spade $(MODEL)

test: build model
	@cd $(BUILD) && ctest --output-on-failure -LE gpu -j $(JOBS)
	@$(MAKE) --no-print-directory fuzz

# Each libFuzzer target runs FUZZ_SECONDS from its committed corpus.
fuzz: deps
	@CC=clang CXX=clang++ cmake -S . -B $(BUILD)-fuzz -G Ninja -DSPADE_FUZZ=ON \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	@cmake --build $(BUILD)-fuzz -j $(JOBS)
	@bash scripts/run_fuzzers.sh $(BUILD)-fuzz $(FUZZ_SECONDS)

# On the GPU machine: CUDA ops vs the CPU backend.
gpu-test: build model
	@cd $(BUILD) && ctest --output-on-failure -L gpu

clean:
	rm -rf $(BUILD) $(BUILD)-fuzz
