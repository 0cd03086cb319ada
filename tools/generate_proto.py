"""Regenerate the gRPC modules: `make proto` (never edit *_pb2*.py by hand).

The .proto files live at src/pdserve/proto/ and are compiled with src/ as
the include root, so the generated modules import each other as
`pdserve.proto.<name>_pb2`.
"""

from __future__ import annotations

import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PROTOS = ["router.proto", "control.proto"]


def generate(out_root: Path = SRC) -> list[Path]:
    from grpc_tools import protoc

    args = ["protoc", f"-I{SRC}", f"--python_out={out_root}", f"--grpc_python_out={out_root}"]
    args += [f"pdserve/proto/{name}" for name in PROTOS]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_root / "pdserve" / "proto").glob("*_pb2*.py"))


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else SRC):
        print(path)
