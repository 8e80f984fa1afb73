"""RFC 234's own examples, written with keras_mp, as tests."""

import keras
import numpy as np
from keras import ops

import keras_mp
from keras_mp.testing import to_numpy


def _fit_kernel_delta(optimizer):
    x = np.arange(12, dtype="float32").reshape(4, 3)
    y = np.full((4, 1), 100.0, "float32")
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(1, kernel_initializer="zeros")]
    )
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    return to_numpy(model.layers[0].kernel)[:, 0]


def _clip_by_norm(grads_and_vars):
    # RFC 234: `transform_gradients=[clip_fn]`, a plain callable.
    return [
        (g * ops.minimum(1.0, 1.0 / ops.sqrt(ops.sum(ops.square(g)))), v)
        for g, v in grads_and_vars
    ]


class ClippingOptimizer(keras_mp.OptimizerWrapper):
    """RFC 234's subclassing form of the same example."""

    def transform_gradients(self, grads_and_vars):
        return _clip_by_norm(super().transform_gradients(grads_and_vars))


def test_rfc_clipping_example_clips_every_gradient_to_unit_norm():
    by_argument = _fit_kernel_delta(
        keras_mp.OptimizerWrapper(
            keras.optimizers.SGD(1.0), transform_gradients=[_clip_by_norm]
        )
    )
    by_subclass = _fit_kernel_delta(
        ClippingOptimizer(keras.optimizers.SGD(1.0))
    )
    by_keras = _fit_kernel_delta(keras.optimizers.SGD(1.0, clipnorm=1.0))
    np.testing.assert_allclose(np.linalg.norm(by_argument), 1.0, rtol=1e-5)
    np.testing.assert_allclose(by_argument, by_keras, rtol=1e-5)
    np.testing.assert_allclose(by_subclass, by_keras, rtol=1e-5)


class FakeHorovod:
    """`hvd.allreduce` averaging with a second worker whose gradients are 0."""

    def __init__(self):
        self.calls = 0

    def allreduce(self, grads_and_vars):
        self.calls += 1
        return [(g / 2.0, v) for g, v in grads_and_vars]


class HorovodOptimizer(keras_mp.OptimizerWrapper):
    """RFC 234's Horovod example: only `aggregate_gradients` changes."""

    def __init__(self, optimizer, hvd, **kwargs):
        super().__init__(optimizer, **kwargs)
        self.hvd = hvd

    def aggregate_gradients(self, grads_and_vars):
        return self.hvd.allreduce(grads_and_vars)


def test_rfc_horovod_example_aggregates_through_the_override_in_fit():
    hvd = FakeHorovod()
    plain = _fit_kernel_delta(keras.optimizers.SGD(1e-3))
    averaged = _fit_kernel_delta(
        HorovodOptimizer(keras.optimizers.SGD(1e-3), hvd)
    )
    np.testing.assert_allclose(averaged, plain / 2.0, rtol=1e-5)
    # Traced once per compiled function, not called per replica or per step.
    assert hvd.calls >= 1


def test_horovod_example_composes_with_loss_scaling():
    hvd = FakeHorovod()
    optimizer = keras_mp.LossScaleOptimizer(
        HorovodOptimizer(keras.optimizers.SGD(1e-3), hvd), loss_scale=1024
    )
    plain = _fit_kernel_delta(keras.optimizers.SGD(1e-3))
    averaged = _fit_kernel_delta(optimizer)
    # The outer wrapper's aggregation stage defers to the inner wrapper's.
    np.testing.assert_allclose(averaged, plain / 2.0, rtol=1e-5)
