"""The committed gRPC stubs are what testbed.proto compiles to, and pyproject admits them.

testbed/proto/testbed_pb2.py and testbed_pb2_grpc.py are committed so that a plain
`pip install .` (or a checkout on PYTHONPATH) has them without grpcio-tools. `make proto`
regenerates them after an edit of the .proto; this test fails until that is done. Generated code
refuses to import under a protobuf runtime older than the protoc that wrote it (and a grpcio
older than the plugin), so pyproject's floors must be at least those versions.
"""

import ast
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "testbed" / "proto"


def _serialized_descriptor(pb2_path):
    """The FileDescriptorProto bytes a _pb2.py module registers (AddSerializedFile's argument)."""
    for node in ast.walk(ast.parse(pb2_path.read_text())):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "AddSerializedFile"
                and isinstance(node.args[0], ast.Constant)):
            return node.args[0].value
    raise AssertionError(f"{pb2_path}: no AddSerializedFile(b'...') call")


def _floor(requirement_prefix):
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        m = re.fullmatch(rf"{requirement_prefix}\s*>=\s*([0-9.]+)(,.*)?", dep)
        if m:
            return tuple(int(x) for x in m.group(1).split("."))
    raise AssertionError(f"pyproject.toml: no '{requirement_prefix}>=X' dependency")


def _version(text):
    return tuple(int(x) for x in text.split("."))


def test_stubs_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) regenerates the stubs")
    out = tmp_path / "gen"
    out.mkdir()
    # The same invocation as the Makefile's `proto` target, into a scratch directory.
    r = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".",
                        f"--python_out={out}", f"--grpc_python_out={out}",
                        "testbed/proto/testbed.proto"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    fresh = out / "testbed" / "proto"
    assert (_serialized_descriptor(fresh / "testbed_pb2.py")
            == _serialized_descriptor(PROTO_DIR / "testbed_pb2.py")), \
        "testbed/proto/testbed_pb2.py is stale: run `make proto` and commit the result"
    committed_grpc = (PROTO_DIR / "testbed_pb2_grpc.py").read_text()
    fresh_grpc = (fresh / "testbed_pb2_grpc.py").read_text()
    if (re.search(r"GRPC_GENERATED_VERSION = '(.*)'", committed_grpc).group(1)
            == re.search(r"GRPC_GENERATED_VERSION = '(.*)'", fresh_grpc).group(1)):
        assert committed_grpc == fresh_grpc, \
            "testbed/proto/testbed_pb2_grpc.py is stale: run `make proto` and commit the result"


def test_stubs_import_from_the_package_path():
    """`from testbed.proto import testbed_pb2` inside the grpc module (no sys.path hack)."""
    from testbed.proto import testbed_pb2, testbed_pb2_grpc
    assert testbed_pb2.DESCRIPTOR.name == "testbed/proto/testbed.proto"
    for service in testbed_pb2.DESCRIPTOR.services_by_name:
        assert hasattr(testbed_pb2_grpc, f"{service}Stub")
        assert hasattr(testbed_pb2_grpc, f"add_{service}Servicer_to_server")


def test_dependency_floors_admit_the_generated_code():
    pb2 = (PROTO_DIR / "testbed_pb2.py").read_text()
    gencode = _version(re.search(r"^# Protobuf Python Version: ([0-9.]+)$", pb2, re.M).group(1))
    plugin = _version(re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'",
                                (PROTO_DIR / "testbed_pb2_grpc.py").read_text()).group(1))
    assert _floor("protobuf") >= gencode, f"pyproject needs protobuf>={gencode}"
    assert _floor("grpcio") >= plugin, f"pyproject needs grpcio>={plugin}"
