"""Dtype-aware losses: float32 by default, whatever the global policy.

Imports nothing from keras_mp.

Under a mixed precision policy a model's outputs are float16 or bfloat16.
Computing the loss in that dtype loses the small differences that training
feeds on, and reducing a large batch in float16 can overflow. RFC 293
therefore computes losses in float32. `keras_mp.losses.Loss` casts `y_true`
and `y_pred` to its `dtype` (float32 unless told otherwise) before `call`,
reduces in it, and saves it in its config. Every Loss class of
`keras.losses` has a counterpart here under the same name, with the same
arguments, defaults and values.

A cross-entropy given float16 or bfloat16 *probabilities* (`from_logits=False`)
warns once per loss class and process: probabilities rounded to 16 bits
saturate at exactly 0 or 1, where the loss clips them and passes back no
gradient. Casting afterwards cannot undo that rounding; computing the final
activation in float32 or passing logits can.

Example:

>>> loss = keras_mp.losses.MeanSquaredError()
>>> y_true = np.array([[0.0, 1.0]], dtype="float16")
>>> y_pred = np.array([[1.0, 1.0]], dtype="float16")
>>> value = loss(y_true, y_pred)
>>> keras.backend.standardize_dtype(value.dtype), float(value)
('float32', 0.5)
"""

import inspect
import textwrap
import warnings

import keras

__all__ = [
    "BinaryCrossentropy",
    "BinaryFocalCrossentropy",
    "CTC",
    "CategoricalCrossentropy",
    "CategoricalFocalCrossentropy",
    "CategoricalGeneralizedCrossEntropy",
    "CategoricalHinge",
    "Circle",
    "CosineSimilarity",
    "Dice",
    "Hinge",
    "Huber",
    "KLDivergence",
    "LogCosh",
    "Loss",
    "MeanAbsoluteError",
    "MeanAbsolutePercentageError",
    "MeanSquaredError",
    "MeanSquaredLogarithmicError",
    "Poisson",
    "SparseCategoricalCrossentropy",
    "SquaredHinge",
    "Tversky",
]

# float8 types are floats too, but far too coarse to reduce a loss in.
_LOSS_DTYPES = ("float32", "float64", "bfloat16", "float16")
_LOW_PRECISION_DTYPES = ("float16", "bfloat16")

# Loss classes that already warned about low precision probabilities.
# Once per class and process: the prediction dtype is fixed when a step is
# traced, so repeating the warning on every trace would add nothing.
_warned_loss_classes = set()


def _standardize_loss_dtype(dtype):
    """The name of a dtype a loss may compute in; None means float32."""
    if dtype is None:
        return "float32"
    expected = (
        "Expected `dtype` to be the float dtype the loss computes in, one of "
        f"{', '.join(repr(name) for name in _LOSS_DTYPES)}. "
        f"Received: dtype={dtype!r}. "
    )
    try:
        standardized = keras.backend.standardize_dtype(dtype)
    except (ValueError, TypeError, AttributeError):
        error = ValueError if isinstance(dtype, str) else TypeError
        raise error(
            expected + 'Pass a dtype name such as dtype="float32" (the '
            "default); a loss takes a dtype, not a dtype policy."
        ) from None
    if standardized not in _LOSS_DTYPES:
        raise ValueError(
            expected + 'Leave the default dtype="float32" unless you need '
            "another float dtype; integer labels are cast for you."
        )
    return standardized


def _low_precision_dtype(y_pred):
    """The name of the first float16/bfloat16 dtype in `y_pred`, or None.

    Reads static dtypes only, so it answers the same while a step is traced
    (tf.function, jax.jit) as when it runs eagerly.
    """
    for value in keras.tree.flatten(y_pred):
        dtype = getattr(value, "dtype", None)
        if dtype is None:
            continue
        try:
            name = keras.backend.standardize_dtype(dtype)
        except (ValueError, TypeError, AttributeError):
            continue
        if name in _LOW_PRECISION_DTYPES:
            return name
    return None


def _warn_once_about_low_precision_probabilities(loss, dtype):
    loss_class = type(loss)
    if loss_class in _warned_loss_classes:
        return
    _warned_loss_classes.add(loss_class)
    binary = (
        keras.losses.BinaryCrossentropy,
        keras.losses.BinaryFocalCrossentropy,
    )
    activation = "sigmoid" if isinstance(loss, binary) else "softmax"
    warnings.warn(
        f"{loss_class.__name__} received {dtype} probabilities "
        "(from_logits=False). Probabilities rounded to "
        f"{dtype} saturate at exactly 0 or 1, where the loss clips them and "
        "passes back no gradient; casting them to float32 afterwards cannot "
        "restore what was rounded away. Compute the final activation in "
        "float32, e.g. end the model with "
        f'keras.layers.Activation("{activation}", dtype="float32"), or '
        "output logits and pass from_logits=True. This warning is shown "
        f"once per process for {loss_class.__name__}.",
        UserWarning,
        stacklevel=3,
    )


@keras.saving.register_keras_serializable(package="keras_mp")
class Loss(keras.losses.Loss):
    """Loss base class that computes and reduces in `dtype`, float32 by default.

    Keras losses compute in `keras.config.floatx()` unless given a dtype,
    and leave `dtype` out of their config, so a reloaded loss forgets it.
    This base class computes in `dtype`, which is float32 unless told
    otherwise, whatever the global policy or floatx: `y_true` and `y_pred`
    are cast to it before `call`, and the reduction runs in it. `dtype` is
    saved by `get_config`. Subclass it and implement `call` as for
    `keras.losses.Loss`.

    Args:
        name: Optional name for the loss instance. Defaults to a name
            derived from the class name.
        reduction: Reduction applied to the per-sample losses, as in
            `keras.losses.Loss`. Defaults to `"sum_over_batch_size"`.
        dtype: Float dtype the loss computes and reduces in: `"float32"`,
            `"float64"`, `"bfloat16"` or `"float16"`; `None` means
            `"float32"`. Defaults to `"float32"`.

    Example:

    >>> class MeanFourthPower(keras_mp.losses.Loss):
    ...     def call(self, y_true, y_pred):
    ...         return keras.ops.mean((y_pred - y_true) ** 4, axis=-1)
    >>> loss = MeanFourthPower()
    >>> y_true = np.array([[0.0, 0.0]], dtype="float16")
    >>> y_pred = np.array([[1.0, 3.0]], dtype="float16")
    >>> value = loss(y_true, y_pred)
    >>> keras.backend.standardize_dtype(value.dtype), float(value)
    ('float32', 41.0)
    """

    # Set on the cross-entropy counterparts, whose `from_logits=False` path
    # takes probabilities that lose their tails when rounded to 16 bits.
    _warns_on_low_precision_probabilities = False

    def __init__(
        self, name=None, reduction="sum_over_batch_size", dtype="float32"
    ):
        super().__init__(
            name=name,
            reduction=reduction,
            dtype=_standardize_loss_dtype(dtype),
        )

    def __call__(self, y_true, y_pred, sample_weight=None):
        if self._warns_on_low_precision_probabilities and not self.from_logits:
            dtype = _low_precision_dtype(y_pred)
            if dtype is not None:
                _warn_once_about_low_precision_probabilities(self, dtype)
        value = super().__call__(y_true, y_pred, sample_weight=sample_weight)
        # Keras's torch `divide_no_nan` (keras 3.10 - 3.15), which the mean
        # reductions end with, returns float32 for float64 operands; the sum
        # before it is taken in `dtype`.
        return keras.tree.map_structure(
            lambda x: keras.ops.cast(x, self.dtype), value
        )

    def get_config(self):
        """Every constructor argument, as `from_config` takes it."""
        config = super().get_config()
        config["dtype"] = self.dtype
        return config


def _counterpart_docstring(name, keras_signature, warns):
    """The docstring of the keras_mp counterpart of `keras.losses.<name>`."""
    arguments = ", ".join(
        f"`{parameter.name}={parameter.default!r}`"
        for parameter in keras_signature.parameters.values()
        if parameter.name not in ("self", "dtype")
    )
    paragraphs = [
        f"Dtype-aware counterpart of `keras.losses.{name}`.",
        "Casts `y_true` and `y_pred` to `dtype`, float32 unless told "
        "otherwise, before computing the loss, reduces in it, and saves it in "
        "the config, so that under a mixed precision policy the loss keeps "
        "float32 precision. The other arguments, their defaults and the loss "
        f"value are those of `keras.losses.{name}`: {arguments}.",
    ]
    if warns:
        paragraphs.append(
            "Given float16 or bfloat16 probabilities (`from_logits=False`) it "
            "warns once per process for this class and names the fix: a "
            "float32 final activation, or logits with `from_logits=True`."
        )
    paragraphs = [
        textwrap.fill(paragraph, width=76, subsequent_indent="    ")
        for paragraph in paragraphs
    ]
    return (
        "\n\n    ".join(paragraphs)
        + f"""

    Args:
        dtype: Float dtype the loss computes and reduces in: `"float32"`,
            `"float64"`, `"bfloat16"` or `"float16"`; `None` means
            `"float32"`. Defaults to `"float32"`, whatever the global policy.

    Example:

    >>> loss = keras_mp.losses.{name}(dtype="bfloat16")
    >>> loss.get_config()["dtype"]
    'bfloat16'
    """
    )


def _counterpart(keras_class, warns_on_low_precision_probabilities=False):
    """A registered keras_mp Loss computing `keras_class`'s loss in `dtype`.

    The class inherits from `Loss` first, for the float32 default, the
    warning and `dtype` in the config, then from `keras_class`, for the
    loss itself, so instances are also `keras_class` instances.
    """
    name = keras_class.__name__
    keras_signature = inspect.signature(keras_class.__init__)
    signature = keras_signature.replace(
        parameters=[
            parameter.replace(default="float32")
            if parameter.name == "dtype"
            else parameter
            for parameter in keras_signature.parameters.values()
        ]
    )

    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        del arguments["self"]
        arguments["dtype"] = _standardize_loss_dtype(arguments["dtype"])
        keras_class.__init__(self, **arguments)
        # Some Keras losses leave arguments out of their config (`delta` of
        # Huber, `axis` of CosineSimilarity and SparseCategoricalCrossentropy
        # in keras 3.15); keeping every argument makes round trips complete.
        self._constructor_arguments = arguments

    def get_config(self):
        """Every constructor argument, as `from_config` takes it."""
        config = dict(self._constructor_arguments)
        config.update(super(counterpart, self).get_config())
        return config

    __init__.__signature__ = signature
    __init__.__qualname__ = f"{name}.__init__"
    get_config.__qualname__ = f"{name}.get_config"

    doc = _counterpart_docstring(
        name, keras_signature, warns_on_low_precision_probabilities
    )
    counterpart = type(
        name,
        (Loss, keras_class),
        {
            "__init__": __init__,
            "get_config": get_config,
            "__doc__": doc,
            "__module__": __name__,
            "__qualname__": name,
            "_warns_on_low_precision_probabilities": (
                warns_on_low_precision_probabilities
            ),
        },
    )
    return keras.saving.register_keras_serializable(package="keras_mp")(
        counterpart
    )


BinaryCrossentropy = _counterpart(
    keras.losses.BinaryCrossentropy, warns_on_low_precision_probabilities=True
)
BinaryFocalCrossentropy = _counterpart(
    keras.losses.BinaryFocalCrossentropy,
    warns_on_low_precision_probabilities=True,
)
CategoricalCrossentropy = _counterpart(
    keras.losses.CategoricalCrossentropy,
    warns_on_low_precision_probabilities=True,
)
CategoricalFocalCrossentropy = _counterpart(
    keras.losses.CategoricalFocalCrossentropy,
    warns_on_low_precision_probabilities=True,
)
SparseCategoricalCrossentropy = _counterpart(
    keras.losses.SparseCategoricalCrossentropy,
    warns_on_low_precision_probabilities=True,
)
CTC = _counterpart(keras.losses.CTC)
CategoricalGeneralizedCrossEntropy = _counterpart(
    keras.losses.CategoricalGeneralizedCrossEntropy
)
CategoricalHinge = _counterpart(keras.losses.CategoricalHinge)
Circle = _counterpart(keras.losses.Circle)
CosineSimilarity = _counterpart(keras.losses.CosineSimilarity)
Dice = _counterpart(keras.losses.Dice)
Hinge = _counterpart(keras.losses.Hinge)
Huber = _counterpart(keras.losses.Huber)
KLDivergence = _counterpart(keras.losses.KLDivergence)
LogCosh = _counterpart(keras.losses.LogCosh)
MeanAbsoluteError = _counterpart(keras.losses.MeanAbsoluteError)
MeanAbsolutePercentageError = _counterpart(
    keras.losses.MeanAbsolutePercentageError
)
MeanSquaredError = _counterpart(keras.losses.MeanSquaredError)
MeanSquaredLogarithmicError = _counterpart(
    keras.losses.MeanSquaredLogarithmicError
)
Poisson = _counterpart(keras.losses.Poisson)
SquaredHinge = _counterpart(keras.losses.SquaredHinge)
Tversky = _counterpart(keras.losses.Tversky)
