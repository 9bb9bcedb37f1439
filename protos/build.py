"""Generate the Python modules of protos/*.proto, or check that the committed ones are current.

    python -m peerd.protos.build          # regenerate protos/*_pb2*.py in place
    python -m peerd.protos.build --check  # exit 1 if any generated file differs from a fresh build

The generated files are committed so that a plain `pip install .` works without grpcio-tools; the
check (run by tests/test_protos.py) keeps them from going stale. Never edit them by hand.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
VIRTUAL = "peerd/protos"  # where an install puts protos/


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every .proto in protos/; returns the generated files under out_dir."""
    from grpc_tools import protoc  # build-time dependency only (the "test" extra)

    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    # protos/ is installed as peerd.protos (pyproject.toml): protoc sees it at that path, so the
    # generated modules name themselves and each other peerd.protos.*.
    protos = sorted(f"{VIRTUAL}/{p.name}" for p in PROTO_DIR.glob("*.proto"))
    args = [
        "protoc",
        f"-I{VIRTUAL}={PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_dir / VIRTUAL).glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for path in fresh:
            target = PROTO_DIR / path.name
            if not target.exists() or not filecmp.cmp(path, target, shallow=False):
                stale.append(target)
                if not args.check:
                    target.write_bytes(path.read_bytes())
        fresh_names = {p.name for p in fresh}
        orphans = [p for p in PROTO_DIR.glob("*_pb2*.py*") if p.name not in fresh_names]
        for orphan in orphans:
            stale.append(orphan)
            if not args.check:
                orphan.unlink()
    if args.check and stale:
        names = ", ".join(str(p.relative_to(ROOT)) for p in stale)
        print(f"stale generated code: {names}; run `python -m peerd.protos.build`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
