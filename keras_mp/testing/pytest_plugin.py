"""pytest plugin of the keras_mp suite: backend markers and state reset.

Imports the library; the library never imports it.

Loaded with `-p keras_mp.testing.pytest_plugin` (see pyproject.toml), so that
doctests inside `keras_mp/` get the same fixtures as `tests/`.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras_mp  # noqa: E402
from keras_mp import losses as losses_module  # noqa: E402
from keras_mp.backend import devices  # noqa: E402
from keras_mp.precision import global_policy as global_policy_module  # noqa: E402


def pytest_report_header(config):
    return f"keras_mp backend: {keras.backend.backend()}"


def pytest_collection_modifyitems(config, items):
    backend = keras.backend.backend()
    _slow_modules_first(items)
    for item in items:
        marker = item.get_closest_marker("backends")
        if marker is not None and backend not in marker.args:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"runs on {marker.args}, not on {backend}"
                )
            )


def _slow_modules_first(items):
    """Orders the modules by their number of `slow` tests, most first.

    pytest-xdist hands tests to whichever worker is free, in this order:
    the scripts run in fresh interpreters (guides, examples, benchmarks)
    and the multi-process tests then start early and the short tests fill
    in behind them, instead of a 30-second test starting last while the
    other worker idles. Each module's tests keep their order and stay
    together (its module fixtures are built once), and every worker
    computes the same order.
    """
    slow = {}
    for item in items:
        count = slow.setdefault(item.path, 0)
        slow[item.path] = count + (item.get_closest_marker("slow") is not None)
    first_seen = {path: index for index, path in enumerate(slow)}
    items.sort(key=lambda item: (-slow[item.path], first_seen[item.path]))


# pytest 9.2 with pytest-xdist 3.8 silently ignores `xdist_group` marks
# (pytest-dev/pytest-xdist#1386); pyproject.toml pins pytest below it.
_LOADGROUP_BROKEN_FROM = (9, 2)


def _ignored_groups_message(detail):
    return (
        f"pytest {pytest.__version__} with pytest-xdist ignores `xdist_group` "
        f"marks (pytest-dev/pytest-xdist#1386){detail}, so module fixtures "
        "that spawn processes would be built on every worker. Install the "
        'pytest version pyproject.toml pins: pip install -e ".[test]".'
    )


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        return  # Workers are checked by `pytest_collection_finish`.
    version = tuple(int(p) for p in pytest.__version__.split(".")[:2])
    if (
        config.getoption("dist", None) == "loadgroup"
        and version >= _LOADGROUP_BROKEN_FROM
    ):
        raise pytest.UsageError(_ignored_groups_message(""))


def pytest_collection_finish(session):
    """Fails a pytest-xdist worker whose `xdist_group` marks do nothing.

    `--dist loadgroup` runs a group's tests on one worker, so that a module
    fixture (e.g. the processes of `multiprocess_test.py`) is built once.
    With pytest 9.2 and pytest-xdist 3.8 the marks are silently ignored
    (pytest-dev/pytest-xdist#1386): every worker builds those fixtures
    again, and the suite runs slower with nothing failing.
    """
    if not getattr(session.config.option, "loadgroup", False):
        return
    for item in session.items:
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
            raise pytest.UsageError(
                _ignored_groups_message(f": {item.nodeid} is in no group")
            )


@pytest.fixture(autouse=True)
def reset_global_state():
    """Each test starts with no global policy, float32 floatx, fresh names.

    The hardware check counts as done, so that building mixed layers on a
    CPU does not warn in every test; tests of the check reset it.
    """
    global_policy_module._set_global_policy_unchecked(None)
    devices._checked_policies.update(("mixed_float16", "mixed_bfloat16"))
    losses_module._warned_loss_classes.clear()
    keras.config.set_floatx("float32")
    # free_memory=False: the default gc.collect() costs 0.2-0.3 s per test.
    keras.utils.clear_session(free_memory=False)
    yield
    global_policy_module._set_global_policy_unchecked(None)
    keras.config.set_floatx("float32")


@pytest.fixture(autouse=True)
def doctest_globals(doctest_namespace):
    doctest_namespace.update(keras=keras, keras_mp=keras_mp, np=np)
