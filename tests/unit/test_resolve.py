"""Device selection, dtype gating, kernel matching, fallback recording and strict mode."""

from __future__ import annotations

import logging

import pytest
import torch

from flashllm import hookimpl
from flashllm.backends.cuda import profile_for_capability
from flashllm.registry.backend import Backend, Caps, KernelSignatureError, OpRequest
from flashllm.registry.plugins import make_plugin_manager
from flashllm.registry.precision import DeviceProfile
from flashllm.registry.resolve import (
    DeviceSelection,
    DeviceSelectionError,
    KernelResolutionError,
    PrecisionError,
    check_precision,
    resolve_ops,
    select_device,
)

FP32 = OpRequest(torch.float32, torch.float32, "none", 64, 16)


class FakeAccel(Backend):
    """A fake accelerator of device type "meta" whose availability a test controls."""

    def __init__(self, available: bool, profile: DeviceProfile, **kw) -> None:
        super().__init__(name=kw.pop("name", "fake"), device_type="meta", priority=kw.pop("priority", 60), **kw)
        self._available, self._profile = available, profile

    def is_available(self):
        return (True, "yes") if self._available else (False, "fake driver missing")

    def device_profile(self, device):
        return self._profile


class Plugin:
    def __init__(self, *backends: Backend) -> None:
        self.backends = backends

    @hookimpl
    def flashllm_register_backends(self, register):
        for backend in self.backends:
            register(backend)


def plugins_with(*backends: Backend):
    return make_plugin_manager(load_entry_points=False, extra_plugins=[Plugin(*backends)])


def test_auto_selects_cpu_here_and_cpu_backend_wins_over_reference() -> None:
    sel = select_device("auto", plugins=make_plugin_manager(load_entry_points=False))
    assert sel.device == torch.device("cpu") and sel.backend.name == "cpu"


def test_auto_prefers_an_available_accelerator_over_the_cpu() -> None:
    fake = FakeAccel(True, DeviceProfile("fake", frozenset({torch.float32})))
    sel = select_device("auto", plugins=plugins_with(fake))
    assert sel.backend is fake and sel.device.type == "meta"


def test_unavailable_device_error_lists_every_backend_with_its_reason() -> None:
    fake = FakeAccel(False, DeviceProfile("fake", frozenset()), install_hint="pip install fake-sdk")
    with pytest.raises(DeviceSelectionError) as err:
        select_device("meta", plugins=plugins_with(fake))
    text = str(err.value)
    for expected in ("fake (meta): unavailable: fake driver missing", "pip install fake-sdk", "cpu (cpu): available",
                     "cuda (cuda): unavailable"):
        assert expected in text


def test_device_index_beyond_count_is_rejected() -> None:
    with pytest.raises(DeviceSelectionError, match="cpu:3 requested.*sees 1 device"):
        select_device("cpu:3", plugins=make_plugin_manager(load_entry_points=False))


def test_unknown_backend_names_the_registered_ones() -> None:
    with pytest.raises(DeviceSelectionError, match="unknown backend 'tpu'; registered: dcu, cuda, npu, gcu, xpu, xla, ipex, cpu, ggml, reference"):
        select_device("auto", backend="tpu", plugins=make_plugin_manager(load_entry_points=False))


def test_reference_backend_runs_on_the_cpu_device_described_by_the_cpu_backend() -> None:
    plugins = make_plugin_manager(load_entry_points=False)
    sel = select_device("cpu", backend="reference", plugins=plugins)
    assert sel.backend.name == "reference" and sel.device.type == "cpu"
    assert sel.profile == plugins.backends()["cpu"].device_profile(sel.device)
    table = resolve_ops(sel, FP32, plugins=plugins)
    assert set(table.sources.values()) == {"reference"} and table.fallbacks == ()


def test_dtype_the_device_cannot_run_names_the_supported_ones() -> None:
    volta = profile_for_capability(7, 0)
    sel = DeviceSelection(torch.device("meta"), Backend("v", "meta", 1), volta, None)
    with pytest.raises(PrecisionError, match=r"bfloat16 is not supported on meta \(Volta \(sm70\)\); supported dtypes: float16, float32"):
        check_precision(sel, torch.bfloat16)
    with pytest.raises(PrecisionError, match="quantization 'fp8' is not supported"):
        check_precision(sel, torch.float16, quant="fp8")
    check_precision(sel, torch.float16, quant="w8a16")  # weight-only int8 runs everywhere


@pytest.mark.parametrize(
    ("capability", "bf16", "fp8"),
    [((7, 0), False, False), ((7, 5), False, False), ((8, 0), True, False), ((8, 6), True, False),
     ((8, 9), True, True), ((9, 0), True, True), ((10, 0), True, True)],
)
def test_cuda_precision_rules_by_compute_capability(capability, bf16, fp8) -> None:
    profile = profile_for_capability(*capability)
    assert (torch.bfloat16 in profile.dtypes) == bf16
    assert ("fp8" in profile.quant) == fp8
    assert torch.float16 in profile.dtypes


def test_fallbacks_are_recorded_logged_once_and_strict_raises(caplog) -> None:
    fake = FakeAccel(True, DeviceProfile("fake", frozenset({torch.float32})))
    fake.kernel("rms_norm", Caps(dtypes=frozenset({torch.float32})))(_rms_norm_like)
    plugins = plugins_with(fake)
    sel = select_device("meta", plugins=plugins)
    with caplog.at_level(logging.WARNING):
        table = resolve_ops(sel, FP32, plugins=plugins)
    assert table.sources["rms_norm"] == "fake"
    fallen = {f.op: f.reason for f in table.fallbacks}
    assert set(fallen) == set(table.sources) - {"rms_norm"}
    assert all("no kernel registered" in r for r in fallen.values())
    assert caplog.text.count("ops running the reference kernel") == 1
    assert "paged_attention" in caplog.text
    with pytest.raises(KernelResolutionError, match="strict-kernels"):
        resolve_ops(sel, FP32, plugins=plugins, strict=True)


def test_kernel_caps_mismatch_is_the_recorded_reason() -> None:
    fake = FakeAccel(True, DeviceProfile("fake", frozenset({torch.float32, torch.float16}), kv_dtypes=frozenset()))
    caps = Caps(dtypes=frozenset({torch.float16}), kv_dtypes=frozenset({torch.float16}), block_sizes=frozenset({64}))
    from flashllm.ops import op_specs

    fake.kernel("paged_attention", caps)(op_specs()["paged_attention"].reference)
    plugins = plugins_with(fake)
    sel = select_device("meta", plugins=plugins)
    table = resolve_ops(sel, FP32, plugins=plugins)
    reason = {f.op: f.reason for f in table.fallbacks}["paged_attention"]
    assert "dtype float32 not in {float16}" in reason
    half = OpRequest(torch.float16, torch.float16, "none", 64, 16)
    reason = {f.op: f.reason for f in resolve_ops(sel, half, plugins=plugins).fallbacks}["paged_attention"]
    assert "block size 16 not in [64]" in reason
    ok = resolve_ops(sel, OpRequest(torch.float16, torch.float16, "none", 64, 64), plugins=plugins)
    assert ok.sources["paged_attention"] == "fake"


def test_op_table_is_frozen_and_names_unknown_ops() -> None:
    plugins = make_plugin_manager(load_entry_points=False)
    table = resolve_ops(select_device("cpu", plugins=plugins), FP32, plugins=plugins)
    with pytest.raises(AttributeError, match="frozen"):
        table.rms_norm = None
    with pytest.raises(AttributeError, match="no op 'flash_attn'"):
        table.flash_attn  # noqa: B018


def _rms_norm_like(x, weight, eps, residual=None):
    return x


def test_kernel_signature_must_match_the_op_spec() -> None:
    backend = Backend("sig", "cpu", 1)

    def wrong_name(x, weight, epsilon, residual=None):
        return x

    def missing_default(x, weight, eps, residual):
        return x

    for fn in (wrong_name, missing_default):
        with pytest.raises(KernelSignatureError, match="op 'rms_norm'.*requires \\(x, weight, eps, residual=None\\)"):
            backend.kernel("rms_norm", Caps(dtypes=frozenset({torch.float32})))(fn)
    with pytest.raises(KeyError, match="unknown op 'rms_nrom'"):
        backend.kernel("rms_nrom", Caps(dtypes=frozenset({torch.float32})))(_rms_norm_like)
    backend.kernel("rms_norm", Caps(dtypes=frozenset({torch.float32})))(_rms_norm_like)
    assert backend.kernels["rms_norm"][0].fn is _rms_norm_like
