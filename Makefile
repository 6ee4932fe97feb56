# flashsdpa: `make test` and `make bench` work on a fresh clone: each creates (or reuses) the
# virtual environment .venv, installs the pinned dependencies, builds the extension, and runs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch: the version pyproject.toml pins for isolated builds (one pin for both)
TORCH_PIN := $(shell sed -n 's/.*"\(torch==[^"]*\)".*/\1/p' pyproject.toml)
DEPS   := $(TORCH_PIN) triton==3.7.1 numpy pybind11 ninja pytest transformers==5.24.0 matplotlib
STAMP  := $(VENV)/.deps-installed
BENCH_ARGS ?=

SIMDE_HEADER := /usr/include/simde/x86/avx512.h

.PHONY: all test test-all bench build deps simde peak bench-all bench-avx2-host readme-table hw-check clean fuzz fuzz-triton fuzz-variants fuzz-kvcache fuzz-varlen stress sanitize

all: test

$(STAMP): Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(DEPS)
	@touch $@

deps: $(STAMP)

# System packages the tests need beyond Python's: SIMDe (Debian's libsimde-dev), with which the
# build adds the emulated AVX-512 / AMX tiers the tests run on any x86 CPU, and the aarch64 cross
# compiler the build tests compile the portable tier with. Best effort: without them those tests
# skip, saying why (and fail under FLASHSDPA_STRICT=1, as in CI).
CROSS_CXX := aarch64-linux-gnu-g++
simde:
	@{ test -f $(SIMDE_HEADER) && command -v $(CROSS_CXX) >/dev/null 2>&1; } || { \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO="sudo -n"; PKGS="libsimde-dev g++-aarch64-linux-gnu"; \
	  command -v apt-get >/dev/null 2>&1 && \
	  { $$SUDO apt-get install -y -q $$PKGS >/dev/null 2>&1 || \
	    { $$SUDO apt-get update -q >/dev/null 2>&1 && $$SUDO apt-get install -y -q $$PKGS >/dev/null 2>&1; }; }; \
	  test -f $(SIMDE_HEADER) || echo "note: SIMDe not installed; the emulated-tier tests will skip"; \
	  command -v $(CROSS_CXX) >/dev/null 2>&1 || echo "note: no $(CROSS_CXX); the aarch64 build test will skip"; }

# The package is installed once in editable mode without the extension (that maps
# flashsdpa.kernels to kernels/); the extension is then built in place, in build/, where ninja
# recompiles only what changed since the last build.
EDITABLE := $(VENV)/.editable-installed
$(EDITABLE): $(STAMP) setup.py
	FLASHSDPA_NO_EXT=1 $(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	@touch $@

# A test build: with the emulated tiers (FLASHSDPA_EMULATED=1; never in a pip-installed build),
# tiers compiled in parallel, a progress line per tier.
build: $(EDITABLE) simde
	FLASHSDPA_EMULATED=1 $(PY) setup.py --quiet build_ext --inplace

test: build
	$(PY) -m pytest -q tests

# Everything: the suite with every case on the emulated tiers and under the Triton interpreter
# too (`make test` runs a covering subset there; tests/conftest.py), the long fuzzer runs, the
# sanitizer build with its subset, the 5-minute thread stress run.
test-all: export FLASHSDPA_TESTS = all
test-all: test fuzz fuzz-triton fuzz-variants fuzz-kvcache fuzz-varlen sanitize stress

# The differential fuzzer against PyTorch (tests/fuzz_sdpa.py), long run; FUZZ_CASES, FUZZ_SEED.
FUZZ_CASES ?= 10000
FUZZ_SEED ?= 0
fuzz: build
	$(PY) tests/fuzz_sdpa.py --cases $(FUZZ_CASES) --seed $(FUZZ_SEED)

# The same calls on the Triton kernels too (under the interpreter without a GPU, ~0.1 s a case).
FUZZ_TRITON_CASES ?= 3000
fuzz-triton: build
	$(PY) tests/fuzz_sdpa.py --triton --cases $(FUZZ_TRITON_CASES) --seed $(FUZZ_SEED)

# The attention variants' fuzzer (tests/fuzz_variants.py): CPU kernels, then the Triton ones
# (under the interpreter without a GPU, ~0.7 s a case).
FUZZ_VARIANT_CASES ?= 5000
FUZZ_VARIANT_TRITON_CASES ?= 1000
fuzz-variants: build
	$(PY) tests/fuzz_variants.py --cases $(FUZZ_VARIANT_CASES) --seed $(FUZZ_SEED)
	$(PY) tests/fuzz_variants.py --triton --cases $(FUZZ_VARIANT_TRITON_CASES) --seed $(FUZZ_SEED)

# The KV-cache fuzzer (tests/fuzz_kvcache.py): flash_attn_with_kvcache, paged / float8 / append;
# CPU kernels, then the Triton split-KV kernel (under the interpreter without a GPU, ~1.3 s a case).
FUZZ_KVCACHE_CASES ?= 5000
FUZZ_KVCACHE_TRITON_CASES ?= 300
fuzz-kvcache: build
	$(PY) tests/fuzz_kvcache.py --cases $(FUZZ_KVCACHE_CASES) --seed $(FUZZ_SEED)
	$(PY) tests/fuzz_kvcache.py --triton --cases $(FUZZ_KVCACHE_TRITON_CASES) --seed $(FUZZ_SEED)

# The packed-batch fuzzer (tests/fuzz_varlen.py): CPU kernels, then the Triton packed launch
# (under the interpreter without a GPU, ~4 s a case).
FUZZ_VARLEN_CASES ?= 3000
FUZZ_VARLEN_TRITON_CASES ?= 200
fuzz-varlen: build
	$(PY) tests/fuzz_varlen.py --cases $(FUZZ_VARLEN_CASES) --seed $(FUZZ_SEED)
	$(PY) tests/fuzz_varlen.py --triton --cases $(FUZZ_VARLEN_TRITON_CASES) --seed $(FUZZ_SEED)

# The extension built with ASan + UBSan in a copy of the sources (build-sanitize/, incremental),
# with only the tiers this CPU runs (SAN_TIERS: what the regular build reports runnable; the
# others' code could not execute under it), and SANITIZE_TESTS run under it (libasan preloaded;
# Python's own leaks are not reported). Any sanitizer report fails the run. (Not the tests
# of the Triton kernels, which run no C++ under the interpreter.)
SANITIZE_TESTS ?= tests/test_as_pytorch.py tests/test_api.py tests/test_masks.py \
	tests/test_varlen.py tests/test_kvcache.py tests/test_errors.py tests/test_fuzz.py \
	tests/test_build.py::test_tier_table_matches_the_binary
SAN_DIR := build-sanitize
SAN_TIERS = $(shell $(PY) -c "from flashsdpa import _C; print(','.join(t['name'] for t in _C.tiers() if t['built'] and t['cpu_ok']))")
sanitize: build
	@test -n "$(SAN_TIERS)" || { echo "sanitize: no runnable tier reported by the build"; exit 1; }
	mkdir -p $(SAN_DIR)
	cp -a setup.py pyproject.toml README.md flashsdpa_autoload.py csrc flashsdpa kernels tests $(SAN_DIR)/
	rm -f $(SAN_DIR)/flashsdpa/_C*.so
	cd $(SAN_DIR) && FLASHSDPA_SANITIZE=1 FLASHSDPA_TIERS=$(SAN_TIERS) \
	  ../$(PY) setup.py --quiet build_ext --inplace
	cd $(SAN_DIR) && FLASHSDPA_TIERS=$(SAN_TIERS) PYTHONPATH=$$PWD LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so)" \
	  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ../$(PY) -m pytest -q -p no:cacheprovider $(SANITIZE_TESTS) -k "not emu- and not triton"

# Threads calling attention while another toggles enable()/disable(): results, crashes, RSS.
stress: build
	$(PY) tests/stress_toggle.py --seconds 300 --threads 8

# The default microbenchmark: forward, public suite, fp32 + bf16, causal and not, vs PyTorch.
# Results go to bench/out/ (untracked): a run leaves the checkout clean.
bench: build
	$(PY) bench/bench_sdpa.py $(BENCH_ARGS)

peak: build
	$(PY) bench/peak.py

# Every mode, into the tracked bench/results/, then the README performance table regenerated
# from those results (and the GPU results bench/gpu_check.sh last committed: no GPU here to
# refresh them). The other bench targets write untracked files (bench/out/, bench/.build/),
# hw-check excepted (bench/results/hw_*).
bench-all: build
	$(PY) bench/bench_sdpa.py --mode fwd --out-dir bench/results
	$(PY) bench/bench_sdpa.py --mode fwd --cap-isa avx2 --tag fwd_avx2 --out-dir bench/results
	$(PY) bench/bench_sdpa.py --mode train --out-dir bench/results
	$(PY) bench/bench_sdpa.py --mode decode --out-dir bench/results
	$(PY) bench/bench_paths.py --out bench/results/paths.json
	$(PY) bench/bench_sdpa.py --mode variants --out-dir bench/results
	$(PY) bench/bench_sdpa.py --mode serving --out-dir bench/results
	$(PY) bench/bench_sdpa.py --mode hf --dtypes fp32,bf16 --out-dir bench/results
	$(REPORT)

# On a host without AVX-512: the forward, decode and serving suites and the avx2 decode paths
# natively, into bench/results/*_$(AVX2_HOST).json, which the README's tables then show beside
# the others (each run of bench-all renders the last ones committed, as for the GPU results).
# AVX2_HOST names the host's files: another AVX2 core's results beside the first one's
# (avx2_host_<core>; the report renders every *_avx2_host*.json).
AVX2_HOST ?= avx2_host
bench-avx2-host: build
	$(PY) bench/bench_sdpa.py --mode fwd --tag fwd_$(AVX2_HOST) --out-dir bench/results
	$(PY) bench/bench_sdpa.py --mode decode --tag decode_$(AVX2_HOST) --out-dir bench/results
	$(PY) bench/bench_sdpa.py --mode serving --tag serving_$(AVX2_HOST) --out-dir bench/results
	$(PY) bench/bench_paths.py --paths decode,e4m3_fast,near_pf,near_pf@kvcache --out bench/results/paths_$(AVX2_HOST).json
	$(REPORT)

# The README's performance tables from the tracked results (the files present are rendered).
REPORT = $(PY) bench/report.py --readme README.md --plots bench/results \
	  bench/results/fwd.json bench/results/fwd_avx2.json \
	  $$(ls bench/results/fwd_avx2_host*.json 2>/dev/null) bench/results/train.json \
	  bench/results/decode.json $$(ls bench/results/decode_avx2_host*.json 2>/dev/null) \
	  bench/results/paths.json $$(ls bench/results/paths_avx2_host*.json 2>/dev/null) \
	  bench/results/variants.json \
	  bench/results/serving.json $$(ls bench/results/serving_avx2_host*.json 2>/dev/null) \
	  bench/results/hf.json \
	  $$(ls bench/results/gpu_fwd.json bench/results/gpu_train.json 2>/dev/null)

# A/B of the working tree against git revision BASE, both builds in one process, interleaved
# (bench/ab.py; BASE is exported and built once into bench/.build/ab/). AB_ARGS: more options.
.PHONY: bench-ab
bench-ab: build
	@test -n "$(BASE)" || { echo "usage: make bench-ab BASE=<git revision> [AB_ARGS=...]"; exit 2; }
	$(PY) bench/ab.py --base $(BASE) $(AB_ARGS)

# On a machine with AVX-512 / AMX: native tests and benchmarks per tier, in one command.
hw-check:
	bench/hw_check.sh

# The README's tables alone, from the results already in bench/results (no bench run).
readme-table:
	$(REPORT)

clean:
	rm -rf build *.egg-info flashsdpa/_C*.so bench/.build
