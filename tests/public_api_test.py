"""Tests of the public API surface: names, registration, version, doctests."""

import doctest
import importlib.metadata
import inspect
import os
import pathlib
import re
import types
import warnings

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.backend import devices
from keras_mp.testing import run_python
from keras_mp.testing import without_modules

# Abstract bases: they declare get_config for subclasses and are never
# serialized themselves (checked below: their get_config raises).
_ABSTRACT_BASES = {"LossScale"}


def _public_modules():
    return [
        value
        for value in vars(keras_mp).values()
        if isinstance(value, types.ModuleType)
        and value.__name__.split(".")[-1] in keras_mp.__all__
    ]


def _exported():
    """(qualified name, object) of everything exported, subpackages included."""
    exported = [
        (f"keras_mp.{n}", getattr(keras_mp, n)) for n in keras_mp.__all__
    ]
    for module in _public_modules():
        for name in getattr(module, "__all__", []):
            exported.append(
                (f"{module.__name__}.{name}", getattr(module, name))
            )
    return exported


def _exported_classes():
    seen = {}
    for qualified, value in _exported():
        if inspect.isclass(value):
            seen.setdefault(value, qualified)
    return [(qualified, cls) for cls, qualified in seen.items()]


def test_every_name_in_all_exists_once():
    assert len(set(keras_mp.__all__)) == len(keras_mp.__all__)
    for name in keras_mp.__all__:
        assert hasattr(keras_mp, name), name


def test_every_name_in_public_subpackages_exists():
    for module in _public_modules():
        names = getattr(module, "__all__", [])
        assert len(set(names)) == len(names), module.__name__
        for name in names:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_every_public_non_module_attribute_is_in_all():
    public = {
        name
        for name, value in vars(keras_mp).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public <= set(keras_mp.__all__)


@pytest.mark.parametrize(
    "name",
    [
        "Policy",
        "set_global_policy",
        "global_policy",
        "policy_scope",
        "AutoCastVariable",
        "enable_autocast",
        "LossScale",
        "FixedLossScale",
        "DynamicLossScale",
        "precision_rules",
        "DEFAULT_FLOAT32_ISLANDS",
        "explain_precision",
    ],
)
def test_design_contract_names_are_exported(name):
    assert name in keras_mp.__all__


def test_every_exported_class_with_get_config_is_registered():
    checked = []
    for qualified, cls in _exported_classes():
        if not hasattr(cls, "get_config") or cls.__name__ in _ABSTRACT_BASES:
            continue
        expected = f"keras_mp>{cls.__name__}"
        assert keras.saving.get_registered_name(cls) == expected, qualified
        assert keras.saving.get_registered_object(expected) is cls, qualified
        checked.append(cls.__name__)
    assert {"Policy", "FixedLossScale", "DynamicLossScale"} <= set(checked)


def test_abstract_bases_are_exported_and_not_serializable():
    exported = {cls.__name__: cls for _, cls in _exported_classes()}
    for name in _ABSTRACT_BASES:
        with pytest.raises(NotImplementedError):
            exported[name]().get_config()


def test_version_is_a_release_string_with_one_source():
    version = keras_mp.__version__
    assert isinstance(version, str)
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", version)
    # pyproject reads the version from keras_mp/__init__.py, and the
    # changelog's newest release heading names it (above it, an
    # "Unreleased" heading may gather what the next release will say).
    root = pathlib.Path(keras_mp.__file__).resolve().parent
    pyproject = root.parent / "pyproject.toml"
    if pyproject.exists():  # a checkout, not an installed wheel
        text = pyproject.read_text()
        assert 'dynamic = ["version"]' in text
        assert 'version = { attr = "keras_mp.__version__" }' in text
        assert not re.search(r'^version = "', text, re.MULTILINE)
    changelog = (root / "CHANGELOG.md").read_text()
    newest = re.search(r"^## (?!Unreleased$)(\S+)", changelog, re.MULTILINE)
    assert newest.group(1) == version


def test_installed_distribution_has_the_packages_version():
    # The installed metadata (an editable install or the wheel) says the
    # same version; without an install (PYTHONPATH) there is none to check.
    try:
        installed = importlib.metadata.distribution("keras_mp")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("keras_mp is not installed (run from PYTHONPATH)")
    located = pathlib.Path(installed.locate_file("keras_mp")).resolve()
    here = pathlib.Path(keras_mp.__file__).resolve().parent
    if located.is_dir() and located != here:
        pytest.skip(f"the installed keras_mp is {located}, not {here}")
    assert installed.version == keras_mp.__version__


def test_the_package_ships_its_type_marker_and_changelog():
    root = pathlib.Path(keras_mp.__file__).resolve().parent
    assert (root / "py.typed").is_file()
    pyproject = root.parent / "pyproject.toml"
    if pyproject.exists():
        text = pyproject.read_text()
        assert 'keras_mp = ["py.typed", "CHANGELOG.md"]' in text


def _unannotated(qualified, function):
    signature = inspect.signature(function)
    missing = [
        name
        for name, parameter in signature.parameters.items()
        if name not in ("self", "cls")
        and parameter.annotation is inspect.Parameter.empty
    ]
    if signature.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return [f"{qualified}({name})" for name in missing]


def test_top_level_api_has_type_hints():
    # The surface of keras_mp/__init__.py that type checkers read through
    # py.typed: each function, and each class's constructor and the public
    # methods and properties it defines, annotated in full. CI checks a
    # user's code against them with mypy --strict (tests/typing_test.py).
    missing = []
    for name in keras_mp.__all__:
        value = getattr(keras_mp, name)
        if inspect.isfunction(value):
            missing += _unannotated(name, inspect.unwrap(value))
        elif inspect.isclass(value):
            for attribute, member in vars(value).items():
                if attribute.startswith("_") and attribute not in (
                    "__init__",
                    "__new__",
                ):
                    continue
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                elif isinstance(member, property):
                    member = member.fget
                if inspect.isfunction(member):
                    missing += _unannotated(f"{name}.{attribute}", member)
    assert missing == []


def test_exported_objects_have_docstrings():
    for qualified, value in _exported():
        if isinstance(value, types.ModuleType):
            continue
        assert inspect.getdoc(value), qualified


def _docstring_examples():
    finder = doctest.DocTestFinder(recurse=False)
    modules = {
        "keras_mp.policy",
        "keras_mp.precision.global_policy",
        "keras_mp.loss_scale",
        "keras_mp.autocast",
        "keras_mp.precision.rules",
        "keras_mp.explain",
        "keras_mp._fp8.rules",
    }
    examples = []
    for qualified, value in _exported():
        if getattr(value, "__module__", None) not in modules:
            continue
        for test in finder.find(value, qualified):
            if test.examples:
                examples.append(test)
    return examples


@pytest.mark.parametrize(
    "test", _docstring_examples(), ids=lambda test: test.name
)
def test_docstring_example_runs(test, monkeypatch):
    # The examples must pass on any hardware, warnings or not.
    monkeypatch.setattr(
        devices, "_checked_policies", {"mixed_float16", "mixed_bfloat16"}
    )
    test.globs.update(keras=keras, keras_mp=keras_mp, np=np)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.run(test)
    assert runner.failures == 0, test.name


@pytest.mark.slow
def test_import_under_an_unsupported_backend_names_the_supported_ones():
    output = run_python(
        """
        try:
            import keras_mp
        except ImportError as error:
            print(error)
        """,
        env={"KERAS_BACKEND": "numpy"},
    )
    assert "Received: KERAS_BACKEND='numpy'" in output
    assert "tensorflow, jax, torch" in output


@pytest.mark.slow
def test_every_module_imports_without_the_other_backends_frameworks():
    """A user of one backend may have neither of the other two frameworks
    installed (the quickstart's install has TensorFlow and JAX, no torch):
    every keras_mp module, `keras_mp.testing` included, imports with them
    hidden. keras_mp 0.3.4's first build imported torch at the top of
    `backend/torch_delayed.py`, and only the quickstart found it: the
    suite's machines have all three."""
    backend = keras.backend.backend()
    hidden = without_modules(
        *sorted({"tensorflow", "jax", "torch"} - {backend})
    )
    root = pathlib.Path(keras_mp.__file__).resolve().parent.parent
    output = run_python(
        """
        import importlib
        import pkgutil

        import keras_mp

        names = [
            module.name
            for module in pkgutil.walk_packages(keras_mp.__path__, "keras_mp.")
        ]
        for name in names:
            importlib.import_module(name)
        print(len(names), "modules")
        """,
        env={
            "KERAS_BACKEND": backend,
            "PYTHONPATH": os.pathsep.join([hidden, str(root)]),
        },
    )
    assert int(output.split()[0]) > 50, output


def test_readme_ci_pyproject_and_docstring_name_the_same_backends():
    from keras_mp import _supported_backends

    root = pathlib.Path(keras_mp.__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    ci = (root / ".ci" / "run").read_text()
    pyproject = (root / "pyproject.toml").read_text()
    start_page = (root / "guides" / "docs" / "index.md").read_text()
    command = next(line for line in ci.splitlines() if "for backend in" in line)
    assert command in readme
    assert command in start_page  # the site's install section
    loop = " ".join(_supported_backends.SUPPORTED_BACKENDS)
    assert f"for backend in {loop};" in command
    for extra in _supported_backends.SUPPORTED_BACKENDS:
        assert re.search(rf"^{extra} = \[", pyproject, re.MULTILINE), extra
    described = "the TensorFlow, JAX and PyTorch backends"
    assert described in " ".join(readme.split())
    assert described in " ".join(start_page.split())
    assert described in " ".join(pyproject.split())
    assert described in " ".join(keras_mp.__doc__.split())
