"""The committed stubs must equal what `make protos` generates from the .proto files."""

from pathlib import Path

from protos.generate import PROTO_DIR, generate


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    fresh = {p.name: p.read_text() for p in generate(tmp_path)}
    committed = {
        p.name: p.read_text()
        for p in sorted(PROTO_DIR.iterdir())
        if p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))
    }
    assert fresh.keys() == committed.keys(), "run `make protos` and commit the result"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated stubs {stale}: run `make protos` and commit the result"
