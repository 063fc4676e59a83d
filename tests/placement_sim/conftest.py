"""bench/ is not an installed package: make `placement_sim` (and only it) importable, plus
`coordinator` and this folder's `placement_toy` helpers.

Putting all of bench/ on sys.path would shadow test packages with bench scripts of the same
name (bench/training.py vs tests/training/), so the package is registered by its location.
"""

import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
for path in (REPO_ROOT, Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

if "placement_sim" not in sys.modules:
    _package = REPO_ROOT / "bench" / "placement_sim"
    _spec = importlib.util.spec_from_file_location(
        "placement_sim", _package / "__init__.py", submodule_search_locations=[str(_package)]
    )
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["placement_sim"] = _module
    _spec.loader.exec_module(_module)
