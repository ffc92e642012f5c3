#!/usr/bin/env bash
# Prepare, on a Debian 12 machine with `make` done, what scripts/gpu_check.sh needs on a bare GPU
# machine that reaches no package registry, as one folder to send there:
#   scripts/gpu_pack.sh DEST [PYVER]        (PYVER: the GPU machine's python, default 3.12)
# DEST gets a copy of this checkout's files (tracked, untracked-not-ignored, and the generated
# gRPC stubs); DEST/.whl the wheels the GPU image lacks or has in other versions (pyroute2,
# zlib-ng, grpcio and protobuf at this venv's versions, since the stubs were generated for
# them), for PYVER, downloaded with pip; DEST/.gpu-tools Mininet's python package and the
# binaries it and the testbed call (mnexec, brctl, ifconfig, ip, tc, ethtool, sysctl, ps,
# pgrep, nsenter, iptables, iptables-restore, the compiled delay line), each with the shared libraries it needs beyond glibc (loaded through the loader's
# --library-path, for that binary alone). Then, on the GPU machine: bash DEST/scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:?usage: scripts/gpu_pack.sh DEST [PYVER]}
PYVER=${2:-3.12}
PY=${PY:-.venv/bin/python}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)

# the checkout
{ git ls-files -z --cached --others --exclude-standard; printf '%s\0' testbed/proto/*_pb2*.py; } |
  while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done |
  xargs -0 cp --parents -t "$DEST"

# wheels at this venv's versions
ver() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p "$DEST/.whl"
for pkg in pyroute2 zlib-ng grpcio protobuf; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$DEST/.whl" "$pkg==$(ver "$pkg")"
done

# Mininet and the binaries
T=$DEST/.gpu-tools
rm -rf "$T"
mkdir -p "$T/bin" "$T/libexec" "$T/lib" "$T/python"
MN=$("$PY" -c "import mininet, os; print(os.path.dirname(mininet.__file__))")
cp -r "$MN" "$T/python/"
rm -rf "$T/python/mininet/examples"
find "$T/python" -name __pycache__ -prune -exec rm -rf {} +
needs() {  # the shared libraries of $1 beyond glibc's own
  ldd "$1" | awk '/=>/ {print $3}' | grep -v -E '/lib(c|m|dl|pthread|rt)\.so' || true
}
wrap() {  # wrap NAME SRC [ENV=VALUE]: bin/NAME runs SRC through the loader with lib/
  local name=$1 src=$2 env=${3:-} libs
  libs=$(needs "$src")
  if [ -z "$libs" ] && [ -z "$env" ]; then cp "$src" "$T/bin/$name"; return; fi
  cp "$src" "$T/libexec/$name"
  for lib in $libs; do cp -n "$lib" "$T/lib/"; done
  # The loader's --library-path applies to this binary alone: the programs it starts
  # (`ip netns exec ... python`) do not inherit these libraries.
  printf '#!/bin/sh\nd=$(cd "$(dirname "$0")/.." && pwd)\n%sexec /lib64/ld-linux-x86-64.so.2 --library-path "$d/lib" "$d/libexec/%s" "$@"\n' \
    "${env:+export $env; }" "$name" > "$T/bin/$name"
  chmod +x "$T/bin/$name"
}
for b in mnexec brctl ifconfig ip tc ethtool sysctl ps pgrep nsenter; do
  wrap "$b" "$(PATH=$PATH:/usr/sbin:/sbin command -v "$b")"
done
# iptables (the userspace shaping backend, used where the kernel has no netem): the nft
# multi-binary picks its mode from its name; its extensions are dlopened from XTABLES_LIBDIR.
cp -r /usr/lib/x86_64-linux-gnu/xtables "$T/xtables"
for so in "$T"/xtables/*.so; do for lib in $(needs "$so"); do cp -n "$lib" "$T/lib/"; done; done
for b in iptables iptables-restore; do
  wrap "$b" "$(readlink -f "$(PATH=$PATH:/usr/sbin command -v "$b")")" 'XTABLES_LIBDIR=$d/xtables'
done
# the delay line (testbed/net/delayline.c), built here; gpu_check.sh puts a wrapper into the
# cache directory where testbed.net.shaping.delayline_binary() looks first.
DL=$(PYTHONPATH=$PWD "$PY" -c "from testbed.net.shaping import delayline_binary as d; print(d())")
mkdir -p "$T/delayline"
cp "$DL" "$T/delayline/"
for lib in $(needs "$DL"); do cp -n "$lib" "$T/lib/"; done
du -sh "$DEST" "$DEST/.whl" "$T"
