"""Tests of keras_mp.backend.gradients: the torch skip paths.

By default the skip is decided on the host after one fused check-and-unscale
pass (one read of the flag per step); with `skip_on_device=True` the update
runs in place on saved buffers and is selected on the device (no read).
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_mp
from keras_mp.testing import count_host_syncs
from keras_mp.testing import to_numpy


def _model_and_optimizer(skip_on_device=False, inner=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)]
    )
    optimizer = keras_mp.LossScaleOptimizer(
        inner or keras.optimizers.Adam(0.1, weight_decay=0.01),
        loss_scale=keras_mp.DynamicLossScale(1024.0, increment_period=100),
        transform_gradients=["clip_by_global_norm"],
        skip_on_device=skip_on_device,
    )
    optimizer.build(model.trainable_variables)
    return model, optimizer


def _grads(model, poison=None):
    grads = [
        ops.ones_like(v.value) * (i + 1) * 1024.0
        for i, v in enumerate(model.trainable_variables)
    ]
    if poison is not None:
        grads[-1] = ops.where(
            ops.arange(grads[-1].shape[-1]) == 0, poison, grads[-1]
        )
    return grads


@pytest.mark.backends("torch")
@pytest.mark.parametrize("skip_on_device", [False, True])
@pytest.mark.parametrize("poison", [None, np.inf, np.nan])
def test_torch_apply_reads_the_flag_once_or_never(poison, skip_on_device):
    import torch

    model, optimizer = _model_and_optimizer(skip_on_device)
    with torch.no_grad():
        optimizer.apply(_grads(model))
        with count_host_syncs() as syncs:
            for _ in range(3):
                optimizer.apply(_grads(model, poison))
    expected = {} if skip_on_device else {"_local_scalar_dense": 3}
    assert dict(syncs) == expected
    expected = 1 if poison is None else 0
    assert int(to_numpy(optimizer.iterations)) == 1 + 3 * expected


@pytest.mark.backends("torch")
@pytest.mark.parametrize("skip_on_device", [False, True])
def test_torch_minimize_with_a_callable_reads_the_flag_once_or_never(
    skip_on_device,
):
    import torch

    model, optimizer = _model_and_optimizer(skip_on_device)
    x = torch.ones((3, 4))
    optimizer.minimize(lambda: ops.sum(model(x)), model.trainable_variables)
    with count_host_syncs() as syncs:
        optimizer.minimize(lambda: ops.sum(model(x)), model.trainable_variables)
    assert sum(syncs.values()) == (0 if skip_on_device else 1), dict(syncs)
    assert int(to_numpy(optimizer.iterations)) == 2


def test_count_host_syncs_sees_a_python_bool_of_a_tensor():
    if keras.backend.backend() != "torch":
        pytest.skip("counts torch.Tensor conversions")
    import torch

    with count_host_syncs() as syncs:
        bool(torch.tensor(True))
        torch.ones(2).sum().item()
        float(torch.ones(()))
        torch.ones(3).tolist()
    assert syncs == {"_local_scalar_dense": 3, "tolist": 1}


@pytest.mark.backends("torch")
@pytest.mark.parametrize("skip_on_device", [False, True])
@pytest.mark.parametrize("poison", [np.inf, -np.inf, np.nan])
def test_torch_skipped_step_keeps_weights_and_adam_state_torch_equal(
    poison, skip_on_device
):
    import torch

    model, optimizer = _model_and_optimizer(skip_on_device)
    with torch.no_grad():
        for _ in range(2):
            optimizer.apply(_grads(model))
    variables = model.weights + optimizer.inner_optimizer.variables
    variables += list(optimizer.transforms.variables)
    before = [v.value.clone() for v in variables]
    with torch.no_grad():
        optimizer.apply(_grads(model, poison))
    for variable, value in zip(variables, before):
        assert torch.equal(variable.value, value), variable.path
    assert int(to_numpy(optimizer.iterations)) == 2
    assert int(to_numpy(optimizer.skipped_steps)) == 1
    assert float(to_numpy(optimizer.loss_scale())) == 512.0


@pytest.mark.backends("torch")
def test_torch_rfc293_loop_matches_backward_and_apply_through_an_overflow():
    import torch

    x = np.random.default_rng(0).normal(size=(6, 4)).astype("float32")
    batches = [x, x, x * np.inf, x]
    results = []
    for style in ("rfc293", "keras3"):
        model, optimizer = _model_and_optimizer()
        variables = model.trainable_variables
        for batch in batches:
            batch = torch.as_tensor(batch)
            if style == "rfc293":
                loss = ops.mean(ops.square(model(batch)))
                scaled_grads = torch.autograd.grad(
                    optimizer.get_scaled_loss(loss),
                    [v.value for v in variables],
                )
                grads = optimizer.get_unscaled_gradients(scaled_grads)
                with torch.no_grad():
                    optimizer.apply_gradients(zip(grads, variables))
            else:
                model.zero_grad()
                loss = ops.mean(ops.square(model(batch)))
                optimizer.scale_loss(loss).backward()
                with torch.no_grad():
                    optimizer.apply([v.value.grad for v in variables])
        assert int(to_numpy(optimizer.skipped_steps)) == 1
        assert int(to_numpy(optimizer.iterations)) == 3
        results.append([to_numpy(v) for v in model.weights])
    for rfc293, keras3 in zip(*results):
        np.testing.assert_allclose(rfc293, keras3, rtol=1e-6, atol=1e-7)


@pytest.mark.backends("torch")
def test_torch_skip_saves_into_the_same_buffers_every_step():
    # The saved copy of the state is reused, not allocated afresh each step
    # (allocations of the whole state's size fault their pages in again).
    import torch

    # Keras's Adam would take torch's fused kernel, which saves nothing.
    model, optimizer = _model_and_optimizer(
        skip_on_device=True, inner=keras.optimizers.SGD(0.1, momentum=0.9)
    )
    with torch.no_grad():
        optimizer.apply(_grads(model))
        first = [b.data_ptr() for b in optimizer._skip_backups._buffers]
        for poison in (None, np.nan, None):
            optimizer.apply(_grads(model, poison))
    assert [b.data_ptr() for b in optimizer._skip_backups._buffers] == first
    assert int(to_numpy(optimizer.iterations)) == 3
    assert int(to_numpy(optimizer.skipped_steps)) == 1


@pytest.mark.backends("torch")
def test_skip_backups_reallocate_when_shapes_or_dtypes_change():
    import torch

    from keras_mp.backend.gradients import SkipBackups

    backups = SkipBackups()
    values = [torch.ones(3), torch.zeros((2, 2), dtype=torch.bfloat16)]
    first = backups.like(values)
    assert [(b.shape, b.dtype) for b in first] == [
        (v.shape, v.dtype) for v in values
    ]
    assert backups.like([v + 1 for v in values]) is first
    resized = backups.like([torch.ones(4), values[1]])
    assert resized is not first and resized[0].shape == (4,)
    retyped = backups.like([torch.ones(4, dtype=torch.float16), values[1]])
    assert retyped is not resized and retyped[0].dtype == torch.float16
    assert len(backups.like(values[:1])) == 1
