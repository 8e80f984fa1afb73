"""The pytest plugin of `.ci/keras_tests`: Keras's own tests, keras_mp imported."""

import keras_mp  # noqa: F401
