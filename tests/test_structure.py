"""The architecture the folders show: lower layers never import higher ones, and nothing imports an entry point."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENTRY_POINTS = ("train.py", "sample.py", "export.py", "serve.py")
PACKAGES = ("model", "data", "runtime", "exporting", "sampling", "training", "server", "bench")  # every folder of code but tests/
# The rooms, each with the rooms it stands on. A module imports from its own room and from the rooms below it (those
# its room stands on, theirs, and so on down), never from a room above it or beside it. A folder is a room, and so
# is each folder inside model/; model/__init__.py, the package's face, names what the rooms inside hold.
ROOMS = {
    "model": (),  # the core (attention.py, gpt.py, kv_cache.py), the protocols, and the type checks every room shares
    "model/designs": ("model",),
    "model/caches": ("model/designs",),
    "model/decoding": ("model/caches",),
    "model/serving": ("model/decoding",),
    "model/measuring": ("model/decoding",),
    "model/__init__.py": ("model/serving", "model/measuring"),
    "data": (),
    "runtime": ("model/__init__.py", "data"),
    "exporting": ("runtime",),
    "sampling": ("runtime",),
    "training": ("runtime",),
    "server": ("runtime",),
    "bench": ("sampling", "training"),
    "train.py": ("training",),
    "sample.py": ("sampling",),
    "export.py": ("exporting",),
    "serve.py": ("server",),
}


def imported_modules(path: Path) -> set[str]:
    """Every project module a file imports, anywhere in it (inside functions too), as dotted names."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            modules |= {f"{base}.{alias.name}" for alias in node.names} | {base}
    return modules


def project_modules() -> dict[str, Path]:
    """The project's modules by dotted name: every package's, the bench's and the entry points; tests aside."""
    files = [*(REPO / name for name in ENTRY_POINTS),
             *(path for package in PACKAGES for path in (REPO / package).rglob("*.py"))]
    return {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p for p in files}


def room(path: Path) -> str:
    """The room a file is in: the file itself where it is one (an entry point, model's face), else its folder."""
    relative = path.relative_to(REPO)
    return relative.as_posix() if relative.as_posix() in ROOMS else relative.parent.as_posix()


def below(name: str) -> set[str]:
    """The rooms under a room: those it stands on, and theirs, down to the floor."""
    under = set(ROOMS[name])
    for lower in ROOMS[name]:
        under |= below(lower)
    return under


def room_imports() -> dict[tuple[str, str], str]:
    """(room, room it imports from) -> one such import, "file imports module", for every pair of distinct rooms."""
    modules = project_modules()
    pairs = {}
    for name, path in sorted(modules.items()):
        for imported in sorted(m for m in imported_modules(path) if m in modules):
            pair = room(path), room(modules[imported])
            if pair[0] != pair[1]:
                pairs.setdefault(pair, f"{path.relative_to(REPO)} imports {imported}")
    return pairs


def test_every_folder_of_code_is_a_room_in_the_order():
    """A new folder (or a new package beside the others) takes its place in ROOMS before its imports are judged."""
    folders = {d.name for d in REPO.iterdir() if d.is_dir() and not d.name.startswith(".")
               and (any(d.glob("*.py")) or any(d.glob("*/*.py")))} - {"tests"}
    assert folders <= set(PACKAGES), sorted(folders - set(PACKAGES))
    rooms = {room(path) for path in project_modules().values()}
    assert rooms <= set(ROOMS), sorted(rooms - set(ROOMS))
    assert "model/caches" in rooms and "exporting" in rooms and "sampling" in rooms
    for name in ROOMS:
        assert name not in below(name), f"{name} stands on itself"


def test_no_two_folders_import_each_other():
    """Every door is one-way: lazy imports inside functions count, and each folder inside model/ is a folder."""
    pairs = room_imports()
    both_ways = [f"{a} and {b}: {pairs[a, b]}; {pairs[b, a]}" for a, b in sorted(pairs) if a < b and (b, a) in pairs]
    assert not both_ways, "folders that import each other:\n" + "\n".join(both_ways)
    assert len(pairs) > 15


def test_each_room_imports_only_the_rooms_below_it():
    """The order of ROOMS, import by import (inside functions too): never up, never sideways."""
    upward = [f"{a} imports {b}, which is not below it: {how}" for (a, b), how in sorted(room_imports().items())
              if b not in below(a)]
    assert not upward, "\n".join(upward)


def test_no_module_beside_the_caches_asks_for_a_caches_class():
    """The decoding loop, serving, sampling and the rest read a cache's abilities and shape (model/protocol.py:
    Abilities, model/caches/ring.py: CacheShape): none asks isinstance or issubclass of a cache class."""
    import importlib
    import inspect

    classes = set()
    for name, path in project_modules().items():
        if name == "model.kv_cache" or name.startswith("model.caches."):
            module = importlib.import_module(name)
            classes |= {n for n, c in inspect.getmembers(module, inspect.isclass) if hasattr(c, "begin")}
    assert {"KVCache", "RingKVCache", "WindowedKVCache", "Int8KVCache", "LowBitKVCache", "Uncached"} <= classes
    asked = []
    for name, path in project_modules().items():
        if name.startswith("model.caches."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("isinstance", "issubclass") and len(node.args) == 2:
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & classes
                asked += [f"{path.relative_to(REPO)}:{node.lineno} asks for {', '.join(sorted(named))}"] if named else []
    assert not asked, "\n".join(asked)


CORE = ("model/attention.py", "model/gpt.py", "model/kv_cache.py")  # the plain path, read first
CORE_MAX_LINES = 430
README_MAX_LINES = 200
BENCHMARKS_MAX_LINES = 400


def test_the_core_holds_at_most_430_lines_and_imports_no_lab_anywhere():
    """The core reads in one sitting, and knows nothing of the folders beside it: not even inside a function."""
    assert sum(len((REPO / path).read_text().splitlines()) for path in CORE) <= CORE_MAX_LINES
    core = {"model." + Path(path).stem for path in CORE}
    for path in CORE:
        imported = {name for name in imported_modules(REPO / path) if name.startswith("model")}
        assert {".".join(name.split(".")[:2]) for name in imported} <= core | {"model"}, (path, imported)


def test_no_module_imports_itself_through_a_circle():
    """Following each module's imports (inside functions too) never leads back to it."""
    modules = project_modules()
    edges = {name: {m for m in imported_modules(path) if m in modules and m != name} for name, path in modules.items()}
    state = {}

    def visit(name, trail):
        state[name] = "open"
        for nxt in sorted(edges[name]):
            assert state.get(nxt) != "open", " -> ".join([*trail, name, nxt])
            if nxt not in state:
                visit(nxt, [*trail, name])
        state[name] = "done"

    for name in sorted(modules):
        if name not in state:
            visit(name, [])
    assert len(modules) > 40 and any(edges.values())


def dotted(node: ast.AST) -> str | None:
    """The dotted name an expression spells ("logging.Handler"), or None where it is no plain name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def imported_names(tree: ast.Module) -> dict[str, str]:
    """Each name a file's absolute imports bind, with the dotted name it stands for: `import logging.handlers`
    binds logging, `from logging import Handler as H` binds H to logging.Handler."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0]: alias.name if alias.asname else alias.name.split(".")[0]
                      for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names |= {alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names}
    return names


def found(name: str):
    """The object a dotted name of an imported module stands for, or None."""
    import importlib

    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found_object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            found_object = getattr(found_object, part, None)
        return found_object
    return None


def private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def test_no_module_reaches_into_hydras_internals():
    """hydra._internal, and any name of Hydra's that begins with an underscore, may change in any release, and
    requirements.txt takes any hydra-core from 1.3: the project and its tests read flags and configs, and write the
    run's record, through Hydra's public API alone, neither importing such a name nor reaching it as an
    attribute."""
    files = [*project_modules().values(), *(REPO / "tests").glob("*.py")]
    reached = []
    for path in files:
        tree = ast.parse(path.read_text())
        names = imported_names(tree)
        imports = [name for name in names.values() if name.split(".")[0] == "hydra" and private(name)]
        attributes = []
        for node in ast.walk(tree):
            spelled = dotted(node) if isinstance(node, ast.Attribute) else None
            root, _, rest = (spelled or "").partition(".")
            full = f"{names.get(root, root)}.{rest}"
            if spelled and names.get(root, "").split(".")[0] == "hydra" and private(full):
                attributes.append(f"{node.lineno}: {spelled}")
        reached += [f"{path.relative_to(REPO)}: {how}" for how in [*imports, *attributes]]
    assert not reached, "\n".join(reached)
    assert len(files) > 100


def test_no_module_changes_a_standard_library_class():
    """A class of the standard library is every module's: an attribute assigned or deleted on it (logging.Handler's
    handleError, say) changes it for the whole process, beyond the module that meant it."""
    import inspect
    import sys

    changed = []
    for name, path in sorted(project_modules().items()):
        tree = ast.parse(path.read_text())
        names = imported_names(tree)
        targets = [n.value for n in ast.walk(tree) if isinstance(n, ast.Attribute) and
                   isinstance(n.ctx, (ast.Store, ast.Del))]
        targets += [n.args[0] for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                    and n.func.id in ("setattr", "delattr") and n.args]
        for target in targets:
            spelled = dotted(target)
            head, _, rest = (spelled or "").partition(".")
            if head not in names:  # self, a local, a parameter: not a class imported from elsewhere
                continue
            value = found(f"{names[head]}.{rest}" if rest else names[head])
            if inspect.isclass(value) and value.__module__.split(".")[0] in sys.stdlib_module_names:
                changed.append(f"{path.relative_to(REPO)}:{target.lineno} changes {value.__module__}.{value.__name__}")
    assert not changed, "\n".join(changed)


def texts(tree: ast.Module) -> list[str]:
    """Every string a file spells out: its literals, and the literal parts of its f-strings."""
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def opening(message: ast.expr) -> str:
    """The words a message starts with: a literal's, or an f-string's before its first field."""
    first = message.values[0] if isinstance(message, ast.JoinedStr) and message.values else message
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""


def test_every_refusal_of_a_hydra_flag_or_setting_is_a_row_of_the_gate():
    """training/hydra_gate.py's REFUSALS holds them all: no other module refuses with a message that opens on a Hydra
    setting (hydra.run.dir ...) or flag (--package ...), nor holds the words of one of its rows."""
    import re

    from training.hydra_gate import HYDRA_FLAGS, REFUSALS
    flags = {name for names, _ in HYDRA_FLAGS for name in names}
    words = {piece for refusal in REFUSALS for piece in re.split(r"\{\w+\}", refusal.says) if len(piece) >= 20}
    elsewhere, refusals = [], 0
    for path in project_modules().values():
        if path == REPO / "training/hydra_gate.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and dotted(node.func) in ("UsageError", "ConfigError") and node.args:
                refusals += 1
                subject = re.split(r"[\s=:;,]", opening(node.args[0]))[0]
                if subject.startswith("hydra.") or subject in flags:
                    elsewhere.append(f"{path.relative_to(REPO)}:{node.lineno} refuses {subject}")
        elsewhere += [f"{path.relative_to(REPO)} holds {piece!r}" for piece in words
                      if any(piece in text for text in texts(tree))]
    assert not elsewhere, "\n".join(elsewhere)
    assert refusals > 50 and len(words) >= len(REFUSALS)


def test_no_cache_class_chain_is_deeper_than_three_and_no_class_is_made_at_run_time():
    """Caches compose (a budget's rules are mixed in, a windowed cache holds two rings): at most three cache classes
    from KVCache down. Every attention class is written out, never made by type()."""
    import importlib
    import inspect

    from model import KVCache
    classes = set()
    for name in project_modules():
        if name.startswith("model."):
            module = importlib.import_module(name)
            classes |= {c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == name}
    caches = [c for c in classes if issubclass(c, KVCache)]
    assert len(caches) >= 8
    for cls in caches:
        assert sum(issubclass(base, KVCache) for base in cls.__mro__) <= 3, cls.__mro__
    for path in (REPO / "model").rglob("*.py"):
        calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Name) and n.func.id == "type" and len(n.args) == 3]
        assert not calls, path


def test_a_cache_is_one_module_and_one_line_in_the_factory():
    """The window cache is the smallest: only the factory names it, in one line of CACHES."""
    users = [p for p in (REPO / "model").rglob("*.py") if "caches.window" in (text := p.read_text())
             or "from .window" in text]
    assert [p.relative_to(REPO).as_posix() for p in users] == ["model/caches/factory.py"]
    factory = (REPO / "model/caches/factory.py").read_text()
    assert len([line for line in factory.splitlines() if "WindowKVCache" in line and "import" not in line]) == 1


def test_the_readme_holds_at_most_200_lines_and_the_benchmarks_at_most_400():
    """The README teaches and points to docs/; docs/benchmarks.md holds current tables, not every run."""
    assert len((REPO / "README.md").read_text().splitlines()) <= README_MAX_LINES
    assert len((REPO / "docs/benchmarks.md").read_text().splitlines()) <= BENCHMARKS_MAX_LINES


def test_a_plain_cached_decode_step_runs_only_the_core():
    """Every Python function of the project that a plain model's greedy_decode calls is in the three core files:
    the reading path is what runs (eagerly, on the CPU, the default model)."""
    import sys

    import torch

    from model import GPT, GPTConfig, greedy_decode
    for pos_emb in ("learned", "rope"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=8, pos_emb=pos_emb)).eval()
        called = set()

        def trace(frame, event, arg):
            path = Path(frame.f_code.co_filename).resolve()
            if event == "call" and path.suffix == ".py" and REPO in path.parents and not {"tests", ".venv"} & set(path.parts):
                called.add(str(path.relative_to(REPO)))

        sys.setprofile(trace)
        try:
            greedy_decode(model, torch.randint(0, 11, (2, 5)), 8)
        finally:
            sys.setprofile(None)
        assert called == set(CORE), sorted(called)


def test_sample_py_loads_checkpoints_without_the_run_machinery():
    """sample.py reads checkpoints through runtime/, the format's home: neither training/ nor hydra is imported."""
    import subprocess
    import sys
    code = ("import sys; sys.argv = ['sample.py']; import sample; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'training', 'hydra', 'omegaconf', 'tensorboard'}))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_the_default_suite_hides_the_gpu_from_itself_and_the_processes_it_starts():
    """Tests that check what a run on the CPU records pass alike on a CUDA machine; `-m cuda` runs the GPU's own."""
    import os

    import torch
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == "" and not torch.cuda.is_available()


def test_sample_py_holds_at_most_150_lines_and_no_function_over_40():
    """sample.py is the entry's wiring, read in one sitting: its modes and helpers live in sampling/."""
    source = (REPO / "sample.py").read_text()
    assert len(source.splitlines()) <= 150
    lengths = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    long = [(name, lines) for name, lines in lengths if lines > 40]
    assert not long, f"sample.py's functions over 40 lines: {long}"


def test_the_engines_books_import_no_torch():
    """model/serving/blocks.py keeps the pool's books in plain Python: neither it nor anything it imports from the
    project (followed to the end) imports torch."""
    modules = project_modules()
    seen, todo = set(), ["model.serving.blocks"]
    while todo:
        name = todo.pop()
        seen.add(name)
        imported = imported_modules(modules[name])
        assert not any(m == "torch" or m.startswith("torch.") for m in imported), f"{name} imports torch"
        todo += [m for m in imported if m in modules and m not in seen]


def test_the_server_reads_the_engine_through_its_census():
    """server/ draws the engine from engine.census(): it reads nothing of the pool, and a Request (what engine.add
    returns, or engine.running and engine.waiting hold) it only keeps, hands back to engine.cancel, or reads the
    name of; of the two queues it asks only whether they are empty."""
    read = []
    for path in sorted((REPO / "server").glob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or node.attr not in ("pool", "request", "running", "waiting"):
                continue
            up = parents[node]
            stored, tested = isinstance(node.ctx, ast.Store), isinstance(up, ast.BoolOp)  # kept; empty or not
            cancelled = isinstance(up, ast.Call) and node in up.args and getattr(up.func, "attr", "") == "cancel"
            named = isinstance(up, ast.Attribute) and up.attr == "name"
            if node.attr == "pool" or not (stored or tested or cancelled or named):
                read.append(f"{path.relative_to(REPO)}:{node.lineno} reads {ast.unparse(node)}")
    assert not read, "\n".join(read)


def test_every_entry_point_ends_through_the_one_run_command():
    """Each entry point hands its command to runtime/command.py's run_command: where it starts (main(), or the
    `__main__` block), none readies the streams, catches a closed pipe or reports an error itself."""
    for name in ENTRY_POINTS:
        tree = ast.parse((REPO / name).read_text())
        starts = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main" or
                  isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
        nodes = [n for start in starts for n in ast.walk(start)]
        called = {n.func.id for n in nodes if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        caught = {n.id for h in nodes if isinstance(h, ast.ExceptHandler) and h.type is not None
                  for n in ast.walk(h.type) if isinstance(n, ast.Name)}
        assert "run_command" in called, name
        assert not called & {"ready_standard_streams", "flush_standard_output", "fail", "silence"}, name
        assert not caught & {"BrokenPipeError", "KeyboardInterrupt", "Exception", "OSError"}, name


def test_the_trainer_is_one_class_with_no_base():
    """The Trainer's methods are all in training/loop.py: what it reads is what it defines there, nothing mixed in."""
    tree = ast.parse((REPO / "training/loop.py").read_text())
    trainer, = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Trainer"]
    assert not trainer.bases and not trainer.keywords, ast.unparse(trainer).splitlines()[0]


# What a library's base class sets on its instances, which a subclass reads as the library documents it
LIBRARY_STATE = {"torch.optim.Muon": {"param_groups", "state"}}  # torch's Optimizer.__init__ sets both


def defined_by(cls: ast.ClassDef) -> set[str]:
    """The names a class defines itself: its methods and properties, its class attributes and fields (a dataclass's,
    a NamedTuple's), and every self.X its methods assign."""
    body = cls.body
    names = {node.name for node in body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    names |= {target.id for node in body if isinstance(node, ast.Assign)
              for target in node.targets if isinstance(target, ast.Name)}
    names |= {node.target.id for node in body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    return names | {node.attr for node in ast.walk(cls) if isinstance(node, ast.Attribute) and
                    isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) and node.value.id == "self"}


def test_no_training_class_reads_an_attribute_it_does_not_define():
    """Every self.X a class in training/ reads, it defines itself (defined_by): no mixin reads its host's state, and
    following a name never leaves the class."""
    read = []
    for path in sorted((REPO / "training").glob("*.py")):
        for cls in (node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)):
            own = defined_by(cls).union(*(LIBRARY_STATE.get(ast.unparse(base), ()) for base in cls.bases))
            read += sorted({f"{path.relative_to(REPO)}: {cls.name} reads self.{node.attr}" for node in ast.walk(cls)
                            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                            and isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr not in own})
    assert not read, "\n".join(read)
