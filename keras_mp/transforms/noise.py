"""Noise transforms: Gaussian gradient noise."""

import numbers

import keras
from keras import ops

from keras_mp.transforms.base import Transform
from keras_mp.transforms.base import _number
from keras_mp.transforms.base import register_transform


@register_transform("gaussian_noise")
class GaussianNoise(Transform):
    """Adds zero-mean Gaussian noise to every gradient.

    With `ClipByNorm` or `ClipByGlobalNorm` before it, this is the noise step
    of differentially private SGD (the noise multiplier times the clip norm
    gives `stddev`). The noise comes from a `keras.random.SeedGenerator`
    whose state variable is one of this transform's variables, so JAX
    stateless steps carry it and checkpoints restore it: the same `seed`
    gives the same sequence of noise, step after step. A sparse gradient is
    made dense first (noise touches every element).

    Args:
        stddev: Non-negative standard deviation of the noise.
        seed: Integer seed, or None for a random one. Defaults to `None`.
        name: Defaults to `"gaussian_noise"`.

    Example:

    >>> v = keras.Variable([0.0, 0.0, 0.0])
    >>> def noisy():
    ...     noise = keras_mp.transforms.GaussianNoise(stddev=0.1, seed=7)
    ...     first = noise([(keras.ops.zeros((3,)), v)])[0][0]
    ...     second = noise([(keras.ops.zeros((3,)), v)])[0][0]
    ...     return keras.ops.convert_to_numpy(keras.ops.stack([first, second]))
    >>> a, b = noisy(), noisy()
    >>> bool(np.array_equal(a, b)), bool(np.array_equal(a[0], a[1]))
    (True, False)
    """

    def __init__(self, stddev, seed=None, name=None):
        super().__init__(name=name)
        self.stddev = _number("stddev", stddev)
        if self.stddev < 0:
            raise ValueError(
                f"`stddev` must be non-negative. Received: stddev={stddev!r}"
            )
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
        ):
            raise TypeError(
                f"`seed` must be an integer or None. Received: seed={seed!r}"
            )
        self.seed = None if seed is None else int(seed)
        self.seed_generator = None

    def build(self, var_list):
        # Created here, not in __init__, so that its variable belongs to the
        # optimizer's distribution strategy.
        self.seed_generator = keras.random.SeedGenerator(
            self.seed, name="seed_generator"
        )
        self._track_variable(self.seed_generator.state)

    def call(self, grads_and_vars):
        result = []
        for g, v in grads_and_vars:
            if g is not None:
                g = ops.convert_to_tensor(g)
                g = g + keras.random.normal(
                    ops.shape(g),
                    stddev=self.stddev,
                    dtype=g.dtype,
                    seed=self.seed_generator,
                )
            result.append((g, v))
        return result

    def get_config(self):
        """Every constructor argument, as `from_config` takes it."""
        config = super().get_config()
        config["stddev"] = self.stddev
        config["seed"] = self.seed
        return config
