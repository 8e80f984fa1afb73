"""The documentation site (guides/mkdocs.yml) covers the guides and the API.

File checks only: `.ci/run` builds the site with `mkdocs build --strict`,
which fails on a broken link or a page left out of the navigation; these
catch, in the ordinary test run, a guide without a page and a public name
missing from the API reference.
"""

import pathlib
import re

import pytest

import keras_mp

pytestmark = pytest.mark.backends("jax")  # file checks: one backend is enough

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "guides" / "docs"
CONFIG = (ROOT / "guides" / "mkdocs.yml").read_text()


def test_every_guide_has_a_page_in_the_navigation():
    guides = sorted(path.stem for path in (ROOT / "guides").glob("*.py"))
    assert guides
    missing = [g for g in guides if f"- guides/{g}.md" not in CONFIG]
    assert not missing, (
        f"Guides without a page in guides/mkdocs.yml's nav: {missing}. "
        "Add `- guides/<name>.md` under Guides (site_tools/hooks.py makes "
        "the page)."
    )


def _documented(page):
    """The objects `page` renders (`::: path` lines and `heading:` names)."""
    text = (DOCS / "api" / page).read_text()
    return set(re.findall(r"^::: ([\w.]+)$", text, re.MULTILINE)) | set(
        re.findall(r"^\s+heading: ([\w.]+)$", text, re.MULTILINE)
    )


@pytest.mark.parametrize(
    "module, pages",
    [
        (keras_mp, ["keras_mp.md", "optimizers.md"]),
        (keras_mp.fp8, ["fp8.md"]),
        (keras_mp.transforms, ["transforms.md"]),
        (keras_mp.callbacks, ["callbacks.md"]),
        (keras_mp.optimizers, ["optimizers.md"]),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_every_public_name_is_in_the_api_reference(module, pages):
    documented = set().union(*(_documented(page) for page in pages))
    names = {p.rpartition(".")[2] for p in documented}
    public = [
        name
        for name in module.__all__
        if not isinstance(getattr(module, name), type(keras_mp))
    ]
    missing = [name for name in public if name not in names]
    # Each by its public path (a `keras_mp._fp8...` line renders the private
    # module of the same name, as `keras_mp._fp8.dot` once did).
    private = sorted(p for p in documented if p.startswith("keras_mp._fp8"))
    assert not private, f"the API reference names private paths: {private}"
    assert not missing, (
        f"{module.__name__}.{missing} are public (in __all__) but not in "
        f"guides/docs/api/{pages[0]}. Add a `::: {module.__name__}.<name>` "
        "line there."
    )
    # Every module with public names has its page.
    modules = [
        name
        for name in keras_mp.__all__
        if isinstance(getattr(keras_mp, name), type(keras_mp))
        and name != "models"  # Keras's Model methods, patched: no names
    ]
    for name in modules:
        assert (DOCS / "api" / f"{name}.md").exists(), name
