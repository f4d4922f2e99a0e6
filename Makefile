# Every target installs what it needs itself, so it works on a fresh machine.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: install test demo bench nemesis test-rdma clean

SEED    ?= 1
MINUTES ?= 2

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test,spark,embedded,bench,lint]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

test: install
	$(VPY) -m pytest -q

demo: install
	$(VENV)/bin/kdsync demo

bench: install
	$(VPY) -m bench.run

nemesis: install
	$(VPY) -m kdsync.testing.nemesis --seed $(SEED) --minutes $(MINUTES) --out results/nemesis/seed-$(SEED).json

test-rdma: install
	bash infra/rdma-vm/run-tests.sh

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
