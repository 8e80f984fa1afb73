"""The package's floors: no import cycle, and no import from a lower floor
to a higher one (ARCHITECTURE.md draws them).

Read from the source with `ast`, every `import` and `from ... import` of a
keras_mp module, including those inside functions (a lazy import still ties
two modules together).
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "keras_mp"

# What each lower floor may import from keras_mp, by module prefix; a
# module of the floor may always import the floor's own modules.
_ALLOWED = {
    "keras_mp._keras_internals": (),
    "keras_mp._random_bits": (),
    "keras_mp._config": (),
    "keras_mp.backend": (
        "keras_mp._keras_internals",
        "keras_mp._random_bits",
        "keras_mp._supported_backends",
    ),
    "keras_mp.transforms": (
        "keras_mp._config",
        "keras_mp._keras_internals",
        "keras_mp.backend",
    ),
    "keras_mp._fp8": (
        "keras_mp._config",
        "keras_mp._keras_internals",
        "keras_mp._random_bits",
        "keras_mp.backend",
    ),
    "keras_mp.optimizers": (
        "keras_mp._config",
        "keras_mp._keras_internals",
        "keras_mp._random_bits",
        "keras_mp.backend",
        "keras_mp.transforms",
        "keras_mp.loss_scale",
        "keras_mp._fp8",
    ),
}


def _module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path, name, modules):
    """The modules of `modules` that `path`, the module `name`, imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                # `from keras_mp.optimizers import wrapper` imports a
                # module; `from keras_mp.policy import Policy` a name.
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    return {m for m in found if m in modules and m != name}


def _graph():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: _imports(path, name, modules)
        for name, path in modules.items()
        # Helpers of the tests, above every floor.
        if not name.startswith("keras_mp.testing")
    }


def test_the_package_has_no_import_cycle():
    graph = _graph()
    state = {}

    def visit(module, stack):
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycle = stack[stack.index(target) :] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, stack + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("floor", sorted(_ALLOWED))
def test_a_lower_floor_imports_nothing_from_a_higher_one(floor):
    graph = _graph()
    members = [m for m in graph if m == floor or m.startswith(floor + ".")]
    assert members, floor
    allowed = _ALLOWED[floor] + (floor,)
    for module in members:
        for target in graph[module]:
            if target == "keras_mp":
                # The package's face re-exports everything: importing it
                # from inside would import every floor.
                pytest.fail(f"{module} imports the keras_mp package itself")
            assert any(
                target == prefix or target.startswith(prefix + ".")
                for prefix in allowed
            ), f"{module} imports {target}, above its floor ({floor})"


def test_the_reader_sees_lazy_and_relative_imports(tmp_path):
    # The old cycle was a lazy import inside a method: the reader must see
    # imports inside functions, or these tests guard nothing.
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import keras\n"
        "from . import gradients\n"
        "def f():\n"
        "    from keras_mp.optimizers import wrapper\n"
    )
    modules = {
        "keras_mp",
        "keras_mp.backend",
        "keras_mp.backend.gradients",
        "keras_mp.optimizers",
        "keras_mp.optimizers.wrapper",
    }
    assert _imports(probe, "keras_mp.backend.probe", modules) == {
        "keras_mp.backend.gradients",
        "keras_mp.optimizers.wrapper",
    }


def test_no_module_docstring_restates_its_imports():
    # The floors are this module's to check: a docstring's list of what its
    # module imports went stale as the code moved (issue 47).
    stale = []
    for path in sorted(PACKAGE.rglob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        if "imports only" in " ".join(docstring.lower().split()):
            stale.append(str(path.relative_to(PACKAGE)))
    assert not stale, f"docstrings restating their imports: {stale}"


def test_no_module_writes_into_another_at_import():
    # `keras_mp/__init__.py` once put `adopt` and `freeze` into
    # `keras_mp.fp8` at import, where static tools and the API reference
    # could not see them (issue 47): a face re-exports instead.
    writes = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        imported = set()
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                base = getattr(node, "module", None) or ""
                for alias in node.names:
                    full = f"{base}.{alias.name}" if base else alias.name
                    if full.startswith("keras_mp") or base.startswith(
                        "keras_mp"
                    ):
                        imported.add(alias.asname or alias.name.split(".")[0])
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id in imported
                ):
                    writes.append(
                        f"{path.relative_to(PACKAGE)}:{node.lineno} "
                        f"{target.value.id}.{target.attr}"
                    )
    assert not writes, f"modules written into at import: {writes}"


def test_the_fp8_face_lists_the_same_names_statically_and_at_run_time():
    import keras_mp

    tree = ast.parse((PACKAGE / "fp8.py").read_text())
    (static,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "__all__" for t in node.targets)
    ]
    assert static == keras_mp.fp8.__all__
    assert {"adopt", "freeze"} <= set(static)
    for name in static:
        assert getattr(keras_mp.fp8, name) is not None, name
