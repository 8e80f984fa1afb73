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
from keras_mp import policy as policy_module  # noqa: E402
from keras_mp.backend import devices  # noqa: E402


def pytest_report_header(config):
    return f"keras_mp backend: {keras.backend.backend()}"


def pytest_collection_modifyitems(config, items):
    backend = keras.backend.backend()
    for item in items:
        marker = item.get_closest_marker("backends")
        if marker is not None and backend not in marker.args:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"runs on {marker.args}, not on {backend}"
                )
            )


@pytest.fixture(autouse=True)
def reset_global_state():
    """Each test starts with no global policy, float32 floatx, fresh names.

    The hardware check counts as done, so that building mixed layers on a
    CPU does not warn in every test; tests of the check reset it.
    """
    policy_module._set_global_policy_unchecked(None)
    devices._checked_policies.update(("mixed_float16", "mixed_bfloat16"))
    losses_module._warned_loss_classes.clear()
    keras.config.set_floatx("float32")
    # free_memory=False: the default gc.collect() costs 0.2-0.3 s per test.
    keras.utils.clear_session(free_memory=False)
    yield
    policy_module._set_global_policy_unchecked(None)
    keras.config.set_floatx("float32")


@pytest.fixture(autouse=True)
def doctest_globals(doctest_namespace):
    doctest_namespace.update(keras=keras, keras_mp=keras_mp, np=np)
