# Two commands do all set-up on a fresh Debian 12 machine:
#   sudo make demo   installs what is missing, runs experiments/quickstart.yaml
#   sudo make test   installs what is missing, runs the whole test suite
# Re-running is a no-op when everything is present.

VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PROTO   := testbed/proto/testbed.proto
PB2     := testbed/proto/testbed_pb2.py
APT_PKGS := mininet bridge-utils ethtool iputils-ping iproute2 iptables nftables iperf3 \
            libnetfilter-queue-dev gcc
EXPERIMENT ?= experiments/quickstart.yaml
PYTEST_ARGS ?=

.PHONY: all deps apt-deps proto demo test unit bench clean-run distclean

all: deps

deps: apt-deps $(STAMP) $(PB2)

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
# site-packages. torch==2.13.0 pins the CPU wheel (a plain `torch` pulls a multi-GB CUDA build).
$(STAMP): pyproject.toml
	test -x $(PY) || /usr/bin/python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,userspace]'
	touch $@

# gRPC stubs are generated, not committed: `make proto` regenerates them.
proto: $(PB2)
$(PB2): $(PROTO) $(STAMP)
	$(PY) -m grpc_tools.protoc -I testbed/proto --python_out=testbed/proto \
	  --grpc_python_out=testbed/proto $(PROTO)
	sed -i 's/^import testbed_pb2/from testbed.proto import testbed_pb2/' testbed/proto/testbed_pb2_grpc.py

demo: deps
	$(PY) -m testbed.cli run $(EXPERIMENT)

test: deps
	$(PY) -m pytest $(PYTEST_ARGS)

unit: deps
	$(PY) -m pytest -m "not root" $(PYTEST_ARGS)

bench: deps
	$(PY) benchmarks/link_fidelity.py

clean-run:
	$(PY) -m testbed.cli clean

distclean:
	rm -rf $(VENV) testbed/proto/*_pb2*.py *.egg-info
