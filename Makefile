# Two commands matter: `make demo` (the main job) and `make test` (everything CI checks).
# Both create .venv on first use and install the project into it, so a fresh machine needs
# only Python >= 3.10 and make.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# SGLang's own release for the interop tests (tests/sglang_interop/, docs/sglang-interop.md).
SGLANG_STAMP := $(VENV)/.sglang
SGLANG_REQS  := tests/sglang_interop/requirements.txt
SGLANG_CONS  := tests/sglang_interop/constraints.txt
SGLANG_IMPORTS := import sglang.srt.disaggregation.common.conn, \
	sglang.srt.disaggregation.mooncake.conn, sglang.srt.disaggregation.nixl.conn, \
	sglang.srt.disaggregation.decode, sglang.srt.managers.scheduler, \
	sglang.srt.managers.data_parallel_controller, sglang.srt.entrypoints.engine
# The real transfer engines (Mooncake, NIXL) for the end-to-end tests (tests/real_prefill/), pinned
# beside the sglang pin, and the Debian libraries the Mooncake CPU build links.
ENGINES_STAMP := $(VENV)/.engines
ENGINES_REQS  := tests/sglang_interop/engines.txt
ENGINE_DEBS   := libibverbs1 libfabric1
ENGINE_IMPORTS := import mooncake.engine, nixl._api
# Real torch (CPU build) for the multi-rank decode tests, in its own --target directory
# (tests/sglang_interop/torch.txt says why it is not in the venv's site-packages).
TORCH_STAMP := $(VENV)/.torch
TORCH_REQS  := tests/sglang_interop/torch.txt
REAL_TORCH  := $(VENV)/real-torch

.PHONY: demo demo-sglang test lint typecheck pytest crosshair bench tlc mutate clean netns-tools

# pip stays --quiet (its full output is hundreds of lines); the echo lines say what it is doing.
$(STAMP): pyproject.toml
	@echo "installing the project and its dev tools into $(VENV) (about a minute, once;" \
		"again only when pyproject.toml changes)..."
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip
	@$(PY) -m pip install --quiet -e '.[dev,plot]'
	@touch $(STAMP)
	@echo "installed into $(VENV)."

# SGLang's wheel is cp311 only; elsewhere the interop tests skip (tests/support/sglang_support.py says
# why) and this target only says so. PIP_CONSTRAINT replaces any constraint file pip's global
# config names (this machine has /etc/xdg/pip), so the install resolves the same everywhere.
# --no-compile: the wheel holds ~6,400 files and the tests import a few hundred of them; byte-
# compiling all of them took 140 s of a loaded machine, unpacking alone 7 s. Instead, one import
# of the modules the tests use writes the bytecode of exactly those (even where the environment
# sets PYTHONDONTWRITEBYTECODE, which would make every test run compile them again) and checks
# that the import works at all.
$(SGLANG_STAMP): $(STAMP) $(SGLANG_REQS) $(SGLANG_CONS)
	@if ! $(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then \
		echo "sglang interop: .venv runs Python $$($(PY) -c 'import platform; print(platform.python_version())')," \
			"SGLang's wheel is cp311 only: the SGLang interop tests will skip (not installed)."; \
	else \
		start=$$(date +%s); \
		echo "sglang interop: installing $$(grep '^sglang==' $(SGLANG_REQS)) (--no-deps) and its light" \
			"import-time packages into $(VENV), torch & co. made unresolvable (about a minute, once)..."; \
		PIP_CONSTRAINT=$(abspath $(SGLANG_CONS)) $(PY) -m pip install --quiet --no-compile --no-warn-conflicts --no-deps \
			"$$(grep '^sglang==' $(SGLANG_REQS))" && \
		grep -v '^sglang==' $(SGLANG_REQS) > $(VENV)/.sglang-light.txt && \
		PIP_CONSTRAINT=$(abspath $(SGLANG_CONS)) $(PY) -m pip install --quiet --no-compile --no-warn-conflicts \
			-r $(VENV)/.sglang-light.txt -c $(SGLANG_CONS) && \
		env -u PYTHONDONTWRITEBYTECODE SGLANG_HOST_IP=127.0.0.1 PYTHONPATH=tests/sglang_stubs \
			$(PY) -W ignore -c "$(SGLANG_IMPORTS)" && \
		touch $(SGLANG_STAMP) && \
		echo "sglang interop: installed in $$(( $$(date +%s) - start )) s." ; \
	fi

# The real transfer engines, only where SGLang's wheel is (Python 3.11). apt-get runs only when a
# library is missing; where it cannot (not root, no apt, no network) this says so, installs
# nothing, and the end-to-end tests skip naming what is missing (tests/real_prefill/engines.py).
# No stamp on failure: the next `make` tries again.
$(ENGINES_STAMP): $(SGLANG_STAMP) $(ENGINES_REQS)
	@if [ ! -f $(SGLANG_STAMP) ]; then \
		echo "engines: SGLang's wheel is not installed here, so neither are the transfer engines" \
			"(the end-to-end tests will skip)."; \
	else \
		missing=""; for deb in $(ENGINE_DEBS); do \
			dpkg-query -W -f='$${Status}' $$deb 2>/dev/null | grep -q "ok installed" || missing="$$missing $$deb"; \
		done; \
		if [ -n "$$missing" ]; then \
			echo "engines: installing Debian's$$missing with apt-get (the Mooncake transfer engine's" \
				"CPU build links libibverbs and libfabric, even over TCP)..."; \
			apt-get install -y -q --no-install-recommends $$missing >/dev/null 2>&1 || \
			{ apt-get update -q >/dev/null 2>&1 && \
				apt-get install -y -q --no-install-recommends $$missing >/dev/null 2>&1; } || \
			echo "engines: could not install$$missing (apt-get needs root and a package mirror):" \
				"the end-to-end tests will skip."; \
		fi; \
		echo "engines: installing $$(grep -v '^#' $(ENGINES_REQS) | tr '\n' ' ')(--no-deps) into $(VENV)..."; \
		PIP_CONSTRAINT=$(abspath $(SGLANG_CONS)) $(PY) -m pip install --quiet --no-compile \
			--no-warn-conflicts --no-deps -r $(ENGINES_REQS) && \
		env UCX_MODULES=^ib $(PY) -c "$(ENGINE_IMPORTS)" && touch $(ENGINES_STAMP) && \
		echo "engines: Mooncake and NIXL import." || \
		echo "engines: not usable here (see above): the end-to-end tests will skip."; \
	fi

# Only where SGLang's wheel is. PIP_CONSTRAINT is emptied: the interop constraints make torch
# unresolvable on purpose, and the pin names the CPU build exactly, so nothing else can match.
# Where the CPU build cannot be had, this says so and the multi-rank tests skip naming it.
$(TORCH_STAMP): $(ENGINES_STAMP) $(TORCH_REQS)
	@if [ ! -f $(SGLANG_STAMP) ]; then \
		echo "torch: SGLang's wheel is not installed here, so neither is torch (the multi-rank" \
			"decode tests will skip)."; \
	else \
		start=$$(date +%s); \
		echo "torch: installing $$(grep -v '^#' $(TORCH_REQS)) into $(REAL_TORCH) (about 200 MB" \
			"unpacked to ~750 MB; once)..."; \
		rm -rf $(REAL_TORCH); \
		PIP_CONSTRAINT= $(PY) -m pip install --quiet --no-compile --no-warn-conflicts \
			--target $(REAL_TORCH) -r $(TORCH_REQS) && \
		$(PY) -c "import sys; sys.path.append('$(REAL_TORCH)'); import torch.distributed as d; \
			assert d.is_gloo_available()" && touch $(TORCH_STAMP) && \
		echo "torch: installed in $$(( $$(date +%s) - start )) s." || \
		echo "torch: not installed (see above): the multi-rank decode tests will skip."; \
	fi

demo: $(STAMP)
	$(PY) -m statemachine demo

# The same restart demo in front of SGLang 0.5.23's real prefill and beside SGLang's own decode,
# moving real KV bytes (Python 3.11 with the interop packages and the engines above).
demo-sglang: $(ENGINES_STAMP)
	$(PY) -m statemachine demo --prefill sglang

test: lint typecheck pytest crosshair

lint: $(STAMP)
	$(VENV)/bin/ruff check statemachine tests benchmarks
	$(VENV)/bin/ruff format --check statemachine tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy --strict statemachine

pytest: $(STAMP) $(SGLANG_STAMP) $(ENGINES_STAMP) $(TORCH_STAMP) netns-tools
	$(PY) -m pytest

# The network-namespace tests and benchmark (tests/support/netns_support.py) need `ip` (iproute2) and
# `nft` (nftables: this machine kind's kernel has no netem qdisc, but nftables' hooks). As root
# with apt-get, what is missing is installed; otherwise those tests skip and say why.
netns-tools:
	@if command -v ip >/dev/null 2>&1 && command -v nft >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "netns tests: installing iproute2 and nftables with apt-get (once)..."; \
		{ apt-get install -y -qq iproute2 nftables >/dev/null 2>&1 || \
			{ apt-get update -qq >/dev/null 2>&1 && \
			apt-get install -y -qq iproute2 nftables >/dev/null 2>&1; }; } && \
		echo "netns tests: installed." || \
		echo "netns tests: apt-get failed: the network-namespace tests will skip."; \
	else \
		echo "netns tests: no ip/nft, and not root with apt-get: the network-namespace tests will skip."; \
	fi

# Symbolic check of the pool's PEP 316 contracts. The default search is too weak to find pool
# bugs (it found 1 of 8 seeded ones here); 50 uninteresting iterations found all of them.
# CrossHair prints nothing until it ends (a minute or more), so a ticker says it is still going.
# CrossHair is single-threaded and four functions carry the search (CPU measured, one at a
# time: invalidate_entries 25 s, retire_instance_entries 17 s, invalidate_address_entries 7 s,
# publish_entry 5 s, the classes and the rest under 1 s), so two processes share the module:
# invalidate_entries, and every other top-level function and class of pool.py (read from its
# source, so one added later is checked too). Each target gets the same analysis as in a
# check of the whole file; on two cores this takes the time of the larger half.
CROSSHAIR_CHECK := $(VENV)/bin/crosshair check --analysis_kind=PEP316 --max_uninteresting_iterations=50
CROSSHAIR_ALONE := invalidate_entries
crosshair: $(STAMP)
	@echo "crosshair: symbolic check of statemachine/pool.py's contracts (25-60 s on an idle 2-core machine, minutes under load)..."
	@start=$$(date +%s); \
	( while sleep 15; do echo "crosshair: still checking ($$(( $$(date +%s) - start )) s)"; done ) & \
	ticker=$$!; trap 'kill $$ticker 2>/dev/null' EXIT INT TERM; \
	rest=$$($(PY) -c 'import ast, sys; tree = ast.parse(open("statemachine/pool.py").read()); \
		print(" ".join("statemachine.pool." + n.name for n in tree.body if isinstance(n, \
		(ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name != sys.argv[1]))' \
		$(CROSSHAIR_ALONE)) || exit 2; \
	$(CROSSHAIR_CHECK) statemachine.pool.$(CROSSHAIR_ALONE) & alone=$$!; \
	$(CROSSHAIR_CHECK) $$rest; rc=$$?; \
	wait $$alone; rc_alone=$$?; [ $$rc -ne 0 ] || rc=$$rc_alone; \
	[ $$rc -ne 0 ] || echo "crosshair: every contract held ($$(( $$(date +%s) - start )) s)"; \
	exit $$rc

bench: $(STAMP) netns-tools
	$(PY) -m benchmarks

# TLC is not installable from the registries CI reaches; run it where a user has the jar
# (TLA2TOOLS_JAR=/path/to/tla2tools.jar make tlc): every cfg, MCLarge included, and every spec
# mutation, compared with the mirror. Without the variable it says TLC was skipped. `make test`
# runs the same comparison without MCLarge (tests/model/test_model_tlc.py) when the variable is set.
tlc: $(STAMP)
	$(PY) -m statemachine.model.tlc

# Seeded bugs in the manager, flight, plans, transport, liveness, acks, etcd and server code
# (tests/code_mutants): each applied to a temporary copy of the tree, its targeted tests run
# there; prints progress and a caught/survived report. Minutes (real processes); not in `test`
# (tests/test_code_mutants.py, which is, checks that the table still fits the sources).
mutate: $(STAMP)
	$(PY) -m tests.code_mutants

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
