"""Regenerate the gRPC modules: `make proto` (never edit *_pb2*.py by hand).

The .proto files are compiled as if they lived at pdserve/proto/, so the
generated modules import each other as `pdserve.proto.<name>_pb2`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ["router.proto", "control.proto"]


def generate(out_dir: Path = HERE) -> list[Path]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / "pdserve" / "proto"
        pkg.mkdir(parents=True)
        for name in PROTOS:
            shutil.copy(HERE / name, pkg / name)
        args = ["protoc", f"-I{tmp}", f"--python_out={tmp}", f"--grpc_python_out={tmp}"]
        args += [f"pdserve/proto/{name}" for name in PROTOS]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        written = []
        for f in sorted(pkg.glob("*_pb2*.py")):
            shutil.copy(f, out_dir / f.name)
            written.append(out_dir / f.name)
        return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(path)
