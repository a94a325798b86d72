"""Regenerate the committed Python stubs of ``proto/goodspeed/v1/*.proto``.

    python -m goodspeed.proto.generate            # rewrite the stubs in place
    python -m goodspeed.proto.generate --check    # exit 1 if the committed stubs are stale

Needs the pinned ``grpcio-tools`` of the ``dev`` extra. protoc names imports after the proto path
(``goodspeed.v1``); the stubs live under ``goodspeed.proto.goodspeed.v1``, so that one import
line is rewritten — deterministically, as part of generation, never by hand.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTOS = sorted(PROTO_ROOT.glob("goodspeed/v1/*.proto"))
IMPORT_FROM, IMPORT_TO = "from goodspeed.v1 import", "from goodspeed.proto.goodspeed.v1 import"


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs into ``out_dir`` (mirroring ``goodspeed/v1/``); returns the files written."""
    from grpc_tools import protoc

    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if protoc.main(args + [str(p.relative_to(PROTO_ROOT)) for p in PROTOS]) != 0:
        raise RuntimeError("protoc failed")
    written = sorted(out_dir.glob("goodspeed/v1/*_pb2*.py"))
    for path in written:
        path.write_text(path.read_text().replace(IMPORT_FROM, IMPORT_TO))
    return written


def stale_files() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        return [
            str(p.relative_to(tmp))
            for p in fresh
            if not (PROTO_ROOT / p.relative_to(tmp)).exists() or (PROTO_ROOT / p.relative_to(tmp)).read_bytes() != p.read_bytes()
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale stubs")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: {name}")
        return 1 if stale else 0
    for path in generate(PROTO_ROOT):
        print(f"wrote {path.relative_to(PROTO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
