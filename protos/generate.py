"""Regenerate the committed Python stubs from protos/tessera/v1/*.proto.

Run `make protos` (or `python -m protos.generate`). The staleness test calls
`generate(tmpdir)` and compares the output with the committed files.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_DIR = PROTO_ROOT / "tessera" / "v1"

# protoc writes `from tessera.v1 import x_pb2`, which only works if `tessera` were a
# top-level package. Our distribution exposes it as `protos.tessera.v1`.
_IMPORT_RE = re.compile(r"^from tessera\.v1 import ", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Write stubs under out_root/tessera/v1 and return the generated files."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    out_root.mkdir(parents=True, exist_ok=True)
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    generated = sorted((out_root / "tessera" / "v1").glob("*_pb2*.py*"))
    for path in generated:
        text = path.read_text()
        path.write_text(_IMPORT_RE.sub("from protos.tessera.v1 import ", text))
    return generated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
