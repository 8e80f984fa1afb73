"""The pytest plugin of `.ci/keras_tests`: Keras's own tests, keras_mp imported.

Importing keras_mp is the whole point; besides, the few Keras tests that
assert a behaviour keras_mp changes on purpose are marked as expected
failures, strict (they fail the run once they pass), each with its reason
and the keras_mp test that asserts what keras_mp does instead.
"""

import pytest

import keras_mp  # noqa: F401

_SAVING = "keras/src/saving/saving_lib_test.py::SavingTest::"
_CUSTOM_COMPILE = (
    "by design (issue 48): load_model calls a custom compile() with the "
    "saved optimizer and arguments, so Keras's warning that compile() was "
    "not called is not given; tests/checkpoint_test.py::"
    "test_a_task_reloaded_with_load_model_resumes_exactly"
)
CHANGED_ON_PURPOSE = {
    _SAVING + "test_compile_overridden_warnings_sequential": _CUSTOM_COMPILE,
    _SAVING + "test_compile_overridden_warnings_subclassed": _CUSTOM_COMPILE,
}


def pytest_collection_modifyitems(items):
    for item in items:
        reason = CHANGED_ON_PURPOSE.get(item.nodeid)
        if reason is not None:
            item.add_marker(
                pytest.mark.xfail(
                    raises=AssertionError, strict=True, reason=reason
                )
            )
