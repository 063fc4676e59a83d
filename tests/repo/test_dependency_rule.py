"""Components talk only over the wire: each imports `protos`, never another component."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ("coordinator", "node_agent", "client")
# The client runs on users' laptops: it must stay light.
CLIENT_FORBIDDEN = {"torch", "safetensors", "transformers", "sqlite_utils"}


def _imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_components_never_import_each_other() -> None:
    violations = []
    for component in COMPONENTS:
        others = set(COMPONENTS) - {component}
        for path in (ROOT / component).rglob("*.py"):
            bad = _imported_top_levels(path) & others
            if bad:
                violations.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not violations, "\n".join(violations)


def test_client_stays_free_of_heavy_dependencies() -> None:
    violations = []
    for path in (ROOT / "client").rglob("*.py"):
        bad = _imported_top_levels(path) & CLIENT_FORBIDDEN
        if bad:
            violations.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not violations, "\n".join(violations)


def test_the_rule_checker_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "x.py"
    bad.write_text("from node_agent.runtime import StageModel\nimport torch.nn\n")
    assert _imported_top_levels(bad) == {"node_agent", "torch"}
