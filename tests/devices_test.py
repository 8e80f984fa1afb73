"""Tests of the hardware check in keras_mp.backend.devices, on faked devices.

As tf.keras's device_compatibility_check_test did, the device lists are
faked, so every branch runs on a CPU-only machine.
"""

import types
import warnings

import keras
import pytest

import keras_mp
from keras_mp.backend import devices


def _gpu(name, capability):
    return devices._gpu_details(name, capability)


def _cpu(name="Fake Xeon", native_bfloat16=False):
    return {
        "kind": "cpu",
        "name": name,
        "compute_capability": None,
        "native_bfloat16": native_bfloat16,
    }


def _tpu(name="TPU v4"):
    return devices._tpu_details(name)


V100 = _gpu("Tesla V100-SXM2-16GB", (7, 0))
T4 = _gpu("Tesla T4", (7, 5))
A100 = _gpu("NVIDIA A100-SXM4-40GB", (8, 0))
P100 = _gpu("Tesla P100-PCIE-16GB", (6, 0))
GTX1080 = _gpu("GeForce GTX 1080", (6, 1))
UNKNOWN_GPU = _gpu("Mystery GPU", None)


@pytest.fixture
def fake_devices(monkeypatch):
    """Fakes the device list and forgets which policies were checked."""
    monkeypatch.setattr(devices, "_checked_policies", set())

    def install(details):
        monkeypatch.setattr(devices, "device_details", lambda: list(details))

    return install


def _warnings_of(function):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        function()
    return [str(w.message) for w in caught if w.category is UserWarning]


class TestMixedFloat16:
    @pytest.mark.parametrize(
        "details",
        [[V100], [T4], [A100], [A100, A100], [V100, A100]],
        ids=["V100", "T4", "A100", "2xA100", "V100+A100"],
    )
    def test_nvidia_gpu_of_compute_capability_7_or_more_does_not_warn(
        self, details
    ):
        assert devices.compatibility_warning("mixed_float16", details) is None

    @pytest.mark.parametrize("gpu", [P100, GTX1080], ids=["P100", "GTX1080"])
    def test_older_gpu_warns_naming_the_device_and_float32(self, gpu):
        message = devices.compatibility_warning("mixed_float16", [gpu])
        assert message is not None
        assert gpu["name"] in message
        assert "7.0" in message
        assert "'float32' is the better choice" in message

    def test_one_old_gpu_among_new_ones_warns(self):
        message = devices.compatibility_warning("mixed_float16", [A100, P100])
        assert message is not None
        assert P100["name"] in message

    def test_gpu_of_unknown_capability_warns(self):
        message = devices.compatibility_warning("mixed_float16", [UNKNOWN_GPU])
        assert message is not None
        assert "Mystery GPU" in message

    def test_cpu_only_warns_naming_the_cpu_and_float32(self):
        message = devices.compatibility_warning("mixed_float16", [_cpu()])
        assert message is not None
        assert "CPU 'Fake Xeon'" in message
        assert "'float32' is the better choice" in message

    def test_bfloat16_capable_cpu_recommends_mixed_bfloat16(self):
        details = [_cpu("Sapphire Rapids", native_bfloat16=True)]
        message = devices.compatibility_warning("mixed_float16", details)
        assert "Sapphire Rapids" in message
        assert "'mixed_bfloat16' is the better choice" in message

    def test_tpu_warns_and_recommends_mixed_bfloat16(self):
        message = devices.compatibility_warning("mixed_float16", [_tpu()])
        assert "TPU 'TPU v4'" in message
        assert "'mixed_bfloat16' is the better choice" in message


class TestMixedBfloat16:
    @pytest.mark.parametrize(
        "details",
        [
            [_tpu()],
            [A100],
            [_gpu("NVIDIA H100", (9, 0))],
            [_cpu("Sapphire Rapids", native_bfloat16=True)],
        ],
        ids=["TPU", "A100", "H100", "bf16-CPU"],
    )
    def test_native_bfloat16_hardware_does_not_warn(self, details):
        assert devices.compatibility_warning("mixed_bfloat16", details) is None

    @pytest.mark.parametrize(
        "details, name",
        [
            ([_cpu("Old Xeon")], "Old Xeon"),
            ([V100], V100["name"]),
            ([T4], T4["name"]),
            ([A100, T4], T4["name"]),
        ],
        ids=["CPU", "V100", "T4", "A100+T4"],
    )
    def test_hardware_without_native_bfloat16_warns(self, details, name):
        message = devices.compatibility_warning("mixed_bfloat16", details)
        assert message is not None
        assert name in message
        assert "'float32' is the better choice" in message
        assert "'mixed_float16'" in message


class TestWarningText:
    @pytest.mark.parametrize(
        "policy, details",
        [
            ("mixed_float16", [P100]),
            ("mixed_float16", [_cpu()]),
            ("mixed_bfloat16", [_cpu()]),
        ],
    )
    def test_warning_names_only_public_keras_mp_api(self, policy, details):
        message = devices.compatibility_warning(policy, details)
        for word in message.replace("(", " ").split():
            if word.startswith("keras_mp."):
                name = word.removeprefix("keras_mp.").strip(".,;)")
                assert name in keras_mp.__all__, word

    @pytest.mark.parametrize("policy", ["float32", "float16", "bfloat16"])
    def test_non_mixed_policies_have_no_hardware_warning(self, policy):
        assert devices.compatibility_warning(policy, [_cpu()]) is None
        assert devices.compatibility_warning(policy, [P100]) is None


def _build_under(name):
    keras.layers.Dense(1, dtype=name).build((None, 2))


class TestCheckOncePerProcess:
    def test_mixed_float16_warns_once_per_process(self, fake_devices):
        fake_devices([GTX1080])
        first = _warnings_of(lambda: _build_under("mixed_float16"))
        assert len(first) == 1
        assert "GeForce GTX 1080" in first[0]
        again = _warnings_of(
            lambda: _build_under(keras_mp.Policy("mixed_float16"))
        )
        assert again == []

    def test_each_policy_is_checked_once(self, fake_devices):
        fake_devices([_cpu("Old Xeon")])
        caught = _warnings_of(
            lambda: [
                _build_under(name)
                for name in ["mixed_float16", "mixed_bfloat16"] * 3
            ]
        )
        assert len(caught) == 2
        assert "(mixed_float16)" in caught[0]
        assert "(mixed_bfloat16)" in caught[1]

    def test_suitable_hardware_does_not_warn(self, fake_devices):
        fake_devices([A100])
        for name in ("mixed_float16", "mixed_bfloat16"):
            assert _warnings_of(lambda n=name: _build_under(n)) == []

    def test_setting_or_scoping_a_policy_does_not_check(self, fake_devices):
        fake_devices([P100])

        def set_and_scope():
            keras_mp.set_global_policy("mixed_float16")
            with keras_mp.policy_scope("mixed_bfloat16"):
                pass

        assert _warnings_of(set_and_scope) == []
        assert _warnings_of(lambda: keras.layers.Dense(1).build((None, 2)))

    def test_device_lookup_is_skipped_once_checked(
        self, fake_devices, monkeypatch
    ):
        calls = []

        def count():
            calls.append(1)
            return [A100]

        monkeypatch.setattr(devices, "device_details", count)
        _build_under("mixed_float16")
        _build_under("mixed_float16")
        assert len(calls) == 1

    def test_warning_points_at_the_line_that_built_the_layer(
        self, fake_devices
    ):
        fake_devices([P100])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layer = keras.layers.Dense(1, dtype="mixed_float16")
            layer.build((None, 2))
        assert caught[0].filename == __file__


class TestDeviceDetails:
    def test_this_machine_is_described(self):
        details = devices.device_details()
        assert details
        for detail in details:
            assert set(detail) == {
                "kind",
                "name",
                "compute_capability",
                "native_bfloat16",
            }
            assert detail["kind"] in ("cpu", "gpu", "tpu")
            assert isinstance(detail["native_bfloat16"], bool)

    def test_cpu_details_read_bfloat16_flags(self, monkeypatch, tmp_path):
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(
            "processor\t: 0\nmodel name\t: Fake Sapphire Rapids\n"
            "flags\t\t: fpu sse avx512f avx512_bf16 amx_bf16\n"
        )
        real_open = open
        monkeypatch.setattr(
            "builtins.open",
            lambda path, *a, **k: real_open(
                cpuinfo if path == "/proc/cpuinfo" else path, *a, **k
            ),
        )
        detail = devices._cpu_details()
        assert detail["name"] == "Fake Sapphire Rapids"
        assert detail["native_bfloat16"] is True

    @pytest.mark.parametrize(
        "value, expected",
        [
            ("7.0", (7, 0)),
            ("8.6", (8, 6)),
            ("9", (9, 0)),
            ((7, 5), (7, 5)),
            (None, None),
            ("gfx90a", None),
        ],
    )
    def test_compute_capability_parsing(self, value, expected):
        assert devices._parse_capability(value) == expected

    @pytest.mark.backends("tensorflow")
    def test_tensorflow_gpus_are_listed_with_compute_capability(
        self, monkeypatch
    ):
        import tensorflow as tf

        fake = [
            types.SimpleNamespace(name="/physical_device:GPU:0"),
            types.SimpleNamespace(name="/physical_device:GPU:1"),
        ]
        info = {
            fake[0].name: {
                "device_name": "Tesla V100-SXM2-16GB",
                "compute_capability": (7, 0),
            },
            fake[1].name: {"device_name": "Tesla P100-PCIE-16GB"},
        }
        monkeypatch.setattr(
            tf.config,
            "list_physical_devices",
            lambda kind=None: fake if kind == "GPU" else [],
        )
        monkeypatch.setattr(
            tf.config, "list_logical_devices", lambda kind=None: []
        )
        monkeypatch.setattr(
            tf.config.experimental,
            "get_device_details",
            lambda device: info[device.name],
        )
        details = devices.device_details()
        assert [d["name"] for d in details] == [
            "Tesla V100-SXM2-16GB",
            "Tesla P100-PCIE-16GB",
        ]
        assert details[0]["compute_capability"] == (7, 0)
        assert details[1]["compute_capability"] is None
        assert devices.compatibility_warning("mixed_float16", details)

    @pytest.mark.backends("jax")
    def test_jax_gpus_and_tpus_are_listed(self, monkeypatch):
        import jax

        fake = [
            types.SimpleNamespace(
                platform="gpu",
                device_kind="NVIDIA A100-SXM4-40GB",
                compute_capability="8.0",
            ),
            types.SimpleNamespace(
                platform="rocm",
                device_kind="AMD MI250",
                compute_capability="gfx90a",
            ),
            types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite"),
        ]
        monkeypatch.setattr(jax, "devices", lambda: fake)
        details = devices.device_details()
        assert [(d["kind"], d["compute_capability"]) for d in details] == [
            ("gpu", (8, 0)),
            ("gpu", None),
            ("tpu", None),
        ]
        assert details[0]["native_bfloat16"] and details[2]["native_bfloat16"]
        message = devices.compatibility_warning("mixed_float16", details)
        assert "AMD MI250" in message

    @pytest.mark.backends("torch")
    def test_torch_cuda_gpus_are_listed_with_compute_capability(
        self, monkeypatch
    ):
        import torch

        names = ["NVIDIA H100 80GB HBM3", "Tesla P100-PCIE-16GB"]
        capabilities = [(9, 0), (6, 0)]
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names[i])
        monkeypatch.setattr(
            torch.cuda, "get_device_capability", lambda i: capabilities[i]
        )
        details = devices.device_details()
        assert [(d["kind"], d["name"]) for d in details] == [
            ("gpu", "NVIDIA H100 80GB HBM3"),
            ("gpu", "Tesla P100-PCIE-16GB"),
        ]
        assert details[0]["compute_capability"] == (9, 0)
        assert details[0]["native_bfloat16"]
        message = devices.compatibility_warning("mixed_float16", details)
        assert "Tesla P100" in message

    def test_cpu_is_listed_only_without_accelerators(self, monkeypatch):
        backend = keras.backend.backend()
        lookup = {
            "tensorflow": "_tensorflow_accelerators",
            "jax": "_jax_accelerators",
            "torch": "_torch_accelerators",
        }.get(backend)
        if lookup is None:
            pytest.skip(f"no accelerator lookup on {backend}")
        monkeypatch.setattr(devices, lookup, lambda: [A100])
        assert devices.device_details() == [A100]
        monkeypatch.setattr(devices, lookup, lambda: [])
        assert [d["kind"] for d in devices.device_details()] == ["cpu"]


def test_warnings_point_to_recommend_policy():
    cpu = {
        "kind": "cpu",
        "name": "test cpu",
        "compute_capability": None,
        "native_bfloat16": False,
    }
    for name in ("mixed_float16", "mixed_bfloat16"):
        message = devices.compatibility_warning(name, [cpu])
        assert "keras_mp.recommend_policy()" in message


H100 = _gpu("NVIDIA H100 80GB HBM3", (9, 0))
L4 = _gpu("NVIDIA L4", (8, 9))
B200 = _gpu("NVIDIA B200", (10, 0))
_TENSORWISE = keras_mp.fp8.Recipe()
_ROWWISE = keras_mp.fp8.Recipe(granularity="rowwise")
_MXFP8 = keras_mp.fp8.Recipe(formats="mxfp8")
_NVFP4 = keras_mp.fp8.Recipe(formats="nvfp4")


class TestFp8IsAvailable:
    @pytest.mark.parametrize(
        "details, available",
        [
            # Transformer Engine's rules: FP8 GEMMs from compute
            # capability 8.9, MXFP8 and NVFP4 from 10.0 (Blackwell).
            ([B200], {"e4m3": True, "mxfp8": True, "nvfp4": True}),
            ([H100], {"e4m3": True, "mxfp8": False, "nvfp4": False}),
            ([L4], {"e4m3": True, "mxfp8": False, "nvfp4": False}),
            ([A100], {"e4m3": False, "mxfp8": False, "nvfp4": False}),
            ([H100, A100], {"e4m3": False, "mxfp8": False, "nvfp4": False}),
            ([_cpu()], {"e4m3": False, "mxfp8": False, "nvfp4": False}),
            ([_tpu()], {"e4m3": False, "mxfp8": False, "nvfp4": False}),
        ],
    )
    def test_each_format_asks_for_its_own_tensor_cores(
        self, fake_devices, details, available
    ):
        fake_devices(details)
        recipes = {
            "e4m3": (_TENSORWISE, _ROWWISE, True),
            "mxfp8": (_MXFP8, keras_mp.fp8.Recipe(formats="mxfp8_hybrid")),
            "nvfp4": (_NVFP4,),
        }
        for family, family_recipes in recipes.items():
            for recipe in family_recipes:
                answer, reason = keras_mp.fp8.is_available(
                    recipe, return_reason=True
                )
                assert answer is available[family], (family, recipe)
                assert keras_mp.fp8.is_available(recipe) is answer
                assert (reason == "") is answer
                if not answer:
                    assert details[-1]["name"] in reason
                    capability = "8.9" if family == "e4m3" else "10.0"
                    assert f"compute capability {capability}" in reason

    def test_block_formats_name_themselves_and_blackwell(self, fake_devices):
        fake_devices([H100])
        _, reason = keras_mp.fp8.is_available(_NVFP4, return_reason=True)
        assert "NVFP4" in reason and "Blackwell" in reason
        _, reason = keras_mp.fp8.is_available(_MXFP8, return_reason=True)
        assert "MXFP8" in reason

    def test_this_machine_answers_with_a_reason(self):
        available, reason = keras_mp.fp8.is_available(return_reason=True)
        assert isinstance(available, bool) and isinstance(reason, str)
        if not available:
            assert "compute capability 8.9" in reason

    def test_config_dict_is_accepted(self, fake_devices):
        fake_devices([B200])
        assert keras_mp.fp8.is_available(_NVFP4.get_config())

    @pytest.mark.parametrize("recipe", [None, False])
    def test_no_recipe_is_refused(self, recipe):
        with pytest.raises(ValueError, match="Received: recipe="):
            keras_mp.fp8.is_available(recipe)

    def test_return_reason_must_be_a_bool(self):
        with pytest.raises(TypeError, match="return_reason"):
            keras_mp.fp8.is_available(return_reason="yes")


class TestBlockScaledWarningOnce:
    def _build(self, recipe, units=32):
        layer = keras.layers.Dense(
            units, dtype=keras_mp.Policy("mixed_bfloat16", fp8=recipe)
        )
        layer.build((None, 64))

    @pytest.mark.parametrize(
        "recipe, name", [(_MXFP8, "MXFP8"), (_NVFP4, "NVFP4")]
    )
    def test_hopper_warns_once_that_block_gemms_are_emulated(
        self, fake_devices, recipe, name
    ):
        fake_devices([H100])
        first = _warnings_of(lambda: self._build(recipe))
        fp8_warnings = [m for m in first if "FP8 compatibility check" in m]
        assert len(fp8_warnings) == 1
        assert name in fp8_warnings[0] and "NVIDIA H100" in fp8_warnings[0]
        assert "keras_mp.fp8.is_available" in fp8_warnings[0]
        again = _warnings_of(lambda: self._build(recipe))
        assert not [m for m in again if "FP8 compatibility check" in m]

    @pytest.mark.parametrize(
        "details, recipe",
        [([B200], _MXFP8), ([H100], _TENSORWISE), ([_cpu()], _NVFP4)],
    )
    def test_no_warning_where_nothing_is_emulated_on_a_gpu(
        self, fake_devices, details, recipe
    ):
        # A CPU emulates every FP8 GEMM, which is_available says; the
        # warning is for a GPU that has FP8 tensor cores but not these.
        fake_devices(details)
        caught = _warnings_of(lambda: self._build(recipe))
        assert not [m for m in caught if "FP8 compatibility check" in m]
