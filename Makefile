# Every target installs what it needs itself, so it works on a fresh machine.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: install test demo bench nemesis test-rdma test-rdma-stress clean

SEED    ?= 1
MINUTES ?= 2
PROTOCOL ?= derecho
DELAY_MS ?= 0
STARTS  ?= 300
KIND    ?= transport

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
	$(VPY) -m kdsync.testing.nemesis --seed $(SEED) --minutes $(MINUTES) --protocol $(PROTOCOL) \
		--delay-ms $(DELAY_MS) --out results/nemesis/$(if $(filter derecho,$(PROTOCOL)),,$(PROTOCOL)-)seed-$(SEED).json

# the soft-RoCE guest's "ci" suite (every RDMA behaviour once; what make test runs too)
test-rdma: install
	KDSYNC_VM_SUITE=ci bash infra/rdma-vm/run-tests.sh

# STARTS RDMA member starts and stops in the guest (KIND=transport: the member's transport start-up alone;
# KIND=member: kdsync run with Kafka); a crash keeps its log, core and gdb stacks in build/rdma-stress/
test-rdma-stress: install
	KDSYNC_VM_SUITE=stress KDSYNC_STRESS_STARTS=$(STARTS) KDSYNC_STRESS_KIND=$(KIND) bash infra/rdma-vm/run-tests.sh build/rdma-stress

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
