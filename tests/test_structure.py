"""The architecture the folders show: lower layers never import higher ones, and nothing imports an entry point."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENTRY_POINTS = {"train", "sample"}
# what each layer may import from the project: model/ and data/ nothing above them, training/ both
ALLOWED = {"model": {"model"}, "data": {"data"}, "training": {"model", "data", "training"},
           "bench": {"model", "data", "training", "bench"}}


def project_imports(path: Path) -> set[str]:
    """The top-level project packages and modules that a file imports."""
    project = {"model", "data", "training", "bench", *ENTRY_POINTS}
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & project


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_what_is_below_it_and_never_an_entry_point(layer):
    files = sorted((REPO / layer).glob("*.py"))
    assert files
    for path in files:
        imported = project_imports(path)
        assert imported <= ALLOWED[layer], f"{path.relative_to(REPO)} imports {sorted(imported - ALLOWED[layer])}"
