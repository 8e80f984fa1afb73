"""The host round trips keras_mp's loss scaling adds to a `fit` step.

`keras_mp.testing.count_host_syncs` counts every tensor-to-host conversion
(the reads that make the host wait for the device). Plain Keras and keras_mp
train the same model for N and then 2N steps; the conversions per step
(the count of 2N steps minus the count of N steps, over N) are compared,
whatever the skip decisions were (Keras's own loop reads a few values per
step on some backends). TensorFlow and JAX decide the skip inside the
compiled step: keras_mp adds none. PyTorch (DESIGN.md, "The skip decision
and the host"): one read of the finite flag per step by default, none with
`skip_on_device=True`. What keras_mp adds once per epoch (the
`LossScaleLogger` reading the scale) is allowed.
"""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.testing import count_host_syncs
from keras_mp.testing import to_numpy

STEPS = 3
BATCH = 4


def _reads_per_step(skip_on_device):
    """The host reads keras_mp's optimizer may add to a step."""
    if keras.backend.backend() == "torch" and not skip_on_device:
        return 1
    return 0


def _model(optimizer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _data(steps, overflow_at=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * BATCH, 4)).astype("float32")
    y = rng.normal(size=(steps * BATCH, 1)).astype("float32")
    if overflow_at is not None:
        # float16's largest value is 65504: this batch's gradients overflow.
        x[overflow_at * BATCH] = 6e4
    return x, y


def _syncs(model, steps, overflow_at=None):
    x, y = _data(steps, overflow_at)
    with count_host_syncs() as counts:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return sum(counts.values()), dict(counts)


def _per_step_syncs(model):
    """Host syncs of 2N steps minus those of N steps, with a warm model."""
    model.fit(*_data(2), batch_size=BATCH, epochs=1, verbose=0)
    few, few_counts = _syncs(model, STEPS, overflow_at=1)
    many, many_counts = _syncs(model, 2 * STEPS, overflow_at=1)
    return many - few, (few_counts, many_counts)


@pytest.mark.parametrize("skip_on_device", [False, True])
def test_loss_scaled_fit_step_adds_at_most_the_flag_read_to_plain_keras(
    skip_on_device,
):
    keras_mp.set_global_policy("mixed_float16")
    scaled = _model(
        keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(0.01), skip_on_device=skip_on_device
        )
    )
    scaled_extra, scaled_counts = _per_step_syncs(scaled)
    keras_mp.set_global_policy(keras_mp.Policy("mixed_float16", None))
    plain = _model(keras.optimizers.SGD(0.01))
    assert not isinstance(plain.optimizer, keras.optimizers.LossScaleOptimizer)
    plain_extra, plain_counts = _per_step_syncs(plain)
    added = scaled_extra - plain_extra
    assert 0 <= added <= STEPS * _reads_per_step(skip_on_device), (
        scaled_counts,
        plain_counts,
    )
    # The injected overflows were skipped on the device: one per `fit`.
    assert int(to_numpy(scaled.optimizer.skipped_steps)) == 2
    if keras.backend.backend() == "jax":
        assert scaled.jit_compile  # One jitted step: no branch on the host.
    elif keras.backend.backend() == "tensorflow":
        assert not scaled.run_eagerly  # One tf.function step.


@pytest.mark.backends("torch")
@pytest.mark.parametrize("skip_on_device", [False, True])
def test_torch_eager_loss_scaled_step_reads_the_flag_once_or_never(
    skip_on_device,
):
    # On torch `fit` runs each step eagerly: every conversion is a round
    # trip, so the optimizer's own count is checked: the one read of the
    # finite flag by default, none when the skip is decided on the device.
    keras_mp.set_global_policy("mixed_float16")
    model = _model(
        keras_mp.LossScaleOptimizer(
            keras.optimizers.Adam(0.01), skip_on_device=skip_on_device
        )
    )
    model.fit(*_data(2), batch_size=BATCH, epochs=1, verbose=0)
    optimizer = model.optimizer
    apply = optimizer.apply
    counts = []

    def counting_apply(*args, **kwargs):
        with count_host_syncs() as syncs:
            apply(*args, **kwargs)
        counts.append(sum(syncs.values()))

    optimizer.apply = counting_apply
    try:
        model.fit(*_data(STEPS, 1), batch_size=BATCH, epochs=1, verbose=0)
    finally:
        del optimizer.apply
    assert counts == [_reads_per_step(skip_on_device)] * STEPS
    assert int(to_numpy(optimizer.skipped_steps)) == 1


def test_count_host_syncs_sees_each_way_a_tensor_reaches_the_host():
    x = keras.ops.ones((3,))
    with count_host_syncs() as counts:
        bool(keras.ops.all(x > 0))
        float(keras.ops.sum(x))
        np.asarray(x)
        keras.ops.convert_to_numpy(keras.Variable(1.0).value)
        np.asarray([1.0, 2.0])  # not a tensor
        keras.ops.add(x, 1.0)  # stays on the device
    assert sum(counts.values()) == 4, dict(counts)


@pytest.mark.backends("torch")
def test_a_host_copy_then_its_numpy_read_count_once(monkeypatch):
    """Keras's PyTorch `convert_to_numpy` of a device tensor calls `cpu()`,
    then `np.array` on the copy: one sync, which the H100's runs counted
    twice (a plain step read 2, Keras's loss read alone). A copy is
    simulated here (a CPU's `cpu()` returns the tensor itself, whose later
    reads still count)."""
    import torch

    monkeypatch.setattr(torch.Tensor, "cpu", lambda self: self.clone())
    x = torch.ones(3)
    with count_host_syncs() as counts:
        np.array(x.cpu())  # a device tensor's read: one sync
        np.asarray(x)  # the tensor itself read again: a second
    assert sum(counts.values()) == 2, dict(counts)
    monkeypatch.undo()
    with count_host_syncs() as counts:
        np.array(x.cpu())  # the CPU's own `cpu()`: x itself, read once more
    assert sum(counts.values()) == 2, dict(counts)


def _mlp(policy, fp8, widths, optimizer):
    """A 64-input MLP of Dense layers of `widths` (the first with relu),
    built and compiled (MSE) under `set_global_policy(policy, fp8=fp8)`."""
    keras_mp.set_global_policy(policy, fp8=fp8)
    try:
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(widths[0], activation="relu")]
        layers += [keras.layers.Dense(width) for width in widths[1:]]
        model = keras.Sequential([keras.Input((64,)), *layers])
        model.compile(optimizer, loss="mse")
    finally:
        keras_mp.set_global_policy(None)
    return model


@pytest.mark.backends("torch")
@pytest.mark.parametrize(
    "recipe",
    [{}, {"scaling": "delayed"}, {"granularity": "rowwise"}],
    ids=["current", "delayed", "rowwise"],
)
def test_torch_fp8_step_adds_no_host_sync(recipe, monkeypatch):
    # On a GPU each host read stalls the eager step's queue. Delayed
    # scaling once read 8 more a step (torch's `one_hot` checks its
    # indices on the host), which made the delayed FP8 decoder step of
    # an H100 1.7x slower than current scaling's.
    from keras_mp.backend import fp8 as backend_fp8

    monkeypatch.setattr(backend_fp8, "SCALED_MM_ON_CPU", True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * BATCH * 8, 64)).astype("float32")
    per_step = {}
    for name, fp8 in (("mixed", None), ("fp8", keras_mp.fp8.Recipe(**recipe))):
        model = _mlp(
            "mixed_bfloat16",
            fp8,
            (128, 64),
            keras_mp.LossScaleOptimizer(keras.optimizers.Adam(0.01)),
        )
        fp8_layers = [
            layer
            for layer in model.layers
            if layer.dtype_policy.fp8 is not None
        ]
        # The output layer keeps the compute dtype (`fp8.Rules`).
        assert len(fp8_layers) == (0 if fp8 is None else 1)
        model.fit(x, x, batch_size=8, epochs=1, verbose=0)
        with count_host_syncs() as one:
            model.fit(x[:8], x[:8], batch_size=8, epochs=1, verbose=0)
        with count_host_syncs() as many:
            model.fit(x, x, batch_size=8, epochs=1, verbose=0)
        per_step[name] = sum(many.values()) - sum(one.values())
    assert per_step["fp8"] == per_step["mixed"], per_step


@pytest.mark.backends("torch")
def test_torch_delayed_layers_read_their_fold_count_only_until_they_fold(
    monkeypatch,
):
    """A delayed FP8 layer on PyTorch reads its fold count on the host
    (`fp8_layers/state.py`) until it has folded a carrier: at most once a
    layer in each of the first two steps, and in the first step after its
    count is written (here `set_weights`); then never, and its calls make
    no current scale."""
    from keras_mp.backend import fp8 as backend_fp8
    from keras_mp.backend.torch import delayed as torch_delayed

    monkeypatch.setattr(backend_fp8, "SCALED_MM_ON_CPU", True)
    firsts = []
    select = torch_delayed.select

    def recording(first, *args):
        firsts.append(first is False)
        return select(first, *args)

    monkeypatch.setattr(torch_delayed, "select", recording)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 64)).astype("float32")
    models = {
        name: _mlp(
            "mixed_bfloat16", fp8, (128, 64, 64, 16), keras.optimizers.Adam()
        )
        for name, fp8 in (
            ("current", keras_mp.fp8.Recipe()),
            ("delayed", keras_mp.fp8.Recipe(scaling="delayed")),
        )
    }
    layers = sum(
        layer.dtype_policy.fp8 is not None for layer in models["delayed"].layers
    )
    assert layers == 3  # the output layer keeps the compute dtype
    initial = models["delayed"].get_weights()

    def extra_reads():
        counts = {}
        for name, model in models.items():
            with count_host_syncs() as counted:
                model.train_on_batch(x, x[:, :16])
            counts[name] = sum(counted.values())
        return counts["delayed"] - counts["current"]

    reads = [extra_reads() for _ in range(4)]
    firsts.clear()
    reads.append(extra_reads())
    assert all(firsts) and len(firsts) == 2 * layers, firsts
    models["delayed"].set_weights(initial)
    reads += [extra_reads() for _ in range(4)]
    assert reads == [layers, layers, 0, 0, 0, layers, layers, 0, 0], reads


@pytest.mark.backends("torch")
@pytest.mark.parametrize(
    "policy, recipe, optimizer",
    [
        ("mixed_bfloat16", None, {}),
        ("mixed_bfloat16", None, {"skip_on_device": True}),
        ("mixed_float16", None, None),
        ("mixed_bfloat16", {}, None),
        ("mixed_bfloat16", {"scaling": "delayed"}, None),
        ("mixed_bfloat16", {"stats": True}, None),
        ("mixed_bfloat16", {"granularity": "rowwise"}, None),
        ("mixed_bfloat16", {"scaling": "delayed", "stats": True}, {}),
    ],
    ids=[
        "lso",
        "lso-on-device",
        "float16",
        "fp8-current",
        "fp8-delayed",
        "fp8-stats",
        "fp8-rowwise",
        "fp8-delayed-stats-lso",
    ],
)
def test_torch_step_makes_no_tensor_from_host_data(
    policy, recipe, optimizer, monkeypatch
):
    """keras_mp's code in a `fit` step hands `keras.ops` no Python number
    that becomes a tensor (`count_host_copies`): on a GPU each is a copy
    from the host that waits for the queued kernels. An H100's FP8 decoder
    step made 147 (the power-of-two scales' bit masks and clips, the
    statistics' sizes, delayed scaling's folds), and ran at 0.96x the
    bfloat16 step with its kernels 1.24x faster in sum."""
    from keras_mp.backend import fp8 as backend_fp8
    from keras_mp.testing import count_host_copies

    monkeypatch.setattr(backend_fp8, "SCALED_MM_ON_CPU", True)
    fp8 = None if recipe is None else keras_mp.fp8.Recipe(**recipe)
    inner = keras.optimizers.Adam(0.01)
    if optimizer is not None:
        inner = keras_mp.LossScaleOptimizer(inner, **optimizer)
    model = _mlp(policy, fp8, (64, 64, 16), inner)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 64)).astype("float32")
    y = rng.normal(size=(16, 16)).astype("float32")
    for _ in range(2):
        model.train_on_batch(x, y)
    with count_host_copies() as copies:
        for _ in range(2):
            model.train_on_batch(x, y)
    assert not copies, dict(copies)


@pytest.mark.backends("torch")
def test_count_host_copies_names_the_keras_mp_line():
    from keras_mp.testing import count_host_copies

    with count_host_copies() as copies:
        keras.ops.add(keras.ops.ones(()), 1.0)  # the test's own: not counted
        # An unbuilt scale converts its initial value from the host.
        keras_mp.DynamicLossScale()()
    (where,) = copies
    assert where.startswith("keras_mp/loss_scale.py:"), dict(copies)
