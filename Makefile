# The two set-up commands of the README:
#   make run   install dependencies, build, fetch the default model, run the main job
#   make test  install dependencies, build, run the whole test suite (what CI runs)
BUILD ?= build
MODEL ?= models/SmolLM2-135M-Instruct.Q4_1.gguf
JOBS ?= $(shell nproc)
FUZZ_SECONDS ?= 20
# GPUs the CUDA build targets (cmake/cuda_archs.cmake): auto (this machine's GPU, Hopper without
# one), all (every supported GPU: the portable binary, several times longer to build), hopper,
# or a CMake list such as "80-real;86-real".
CUDA_ARCHS ?= auto
# ON: compiler warnings are errors in the C++ builds (the g++ build, the clang ASan and fuzz
# builds); CI (.ci/run) sets it, so a new warning of g++ or clang fails CI. Off for users: a newer
# compiler's new warnings must not stop their build.
WERROR ?= OFF

.PHONY: deps build model run test test-cpu test-sanitize fuzz gpu-test clean

deps:
	@bash scripts/install_deps.sh

build: deps
	@cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release "-DSPADE_CUDA_ARCHS=$(CUDA_ARCHS)" \
	  -DSPADE_WERROR=$(WERROR) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

model:
	@bash scripts/fetch_model.sh

run: build model
	@bash scripts/main_job.sh $(BUILD)/spade $(MODEL)

test: build model
	@cd $(BUILD) && ctest --output-on-failure -LE gpu -j $(JOBS)
	@$(MAKE) --no-print-directory fuzz
	@$(MAKE) --no-print-directory test-sanitize

# The same CPU suite (unit tests, CLI runs, server e2e and soak) built with AddressSanitizer
# (LeakSanitizer on) + UndefinedBehaviorSanitizer: clang, -O1, no CUDA, only the two targets
# ctest runs (so also CI's clang++ build of every CPU source, warning-free with WERROR=ON). Any
# sanitizer report of any process fails it (scripts/run_sanitized_tests.sh).
test-sanitize: deps model
	@CC=clang CXX=clang++ cmake -S . -B $(BUILD)-asan -G Ninja -DSPADE_SANITIZE=ON \
	  -DCMAKE_BUILD_TYPE=Sanitize -DSPADE_WERROR=$(WERROR) >/dev/null
	@cmake --build $(BUILD)-asan -j $(JOBS) --target spade spade_tests
	@bash scripts/run_sanitized_tests.sh $(BUILD)-asan $(JOBS)

# Each libFuzzer target runs FUZZ_SECONDS from its committed corpus.
fuzz: deps
	@CC=clang CXX=clang++ cmake -S . -B $(BUILD)-fuzz -G Ninja -DSPADE_FUZZ=ON \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPADE_WERROR=$(WERROR) >/dev/null
	@cmake --build $(BUILD)-fuzz -j $(JOBS)
	@bash scripts/run_fuzzers.sh $(BUILD)-fuzz $(FUZZ_SECONDS)

# On the GPU machine: CUDA ops vs the CPU backend.
gpu-test: build model
	@cd $(BUILD) && ctest --output-on-failure -L gpu

clean:
	rm -rf $(BUILD) $(BUILD)-fuzz $(BUILD)-asan
