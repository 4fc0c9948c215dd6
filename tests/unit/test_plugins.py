"""Plugin loading: entry points, allow/block lists, duplicates, broken imports, misspelt hooks."""

from __future__ import annotations

import logging

import pytest

from flashllm.registry.plugins import PluginError, make_plugin_manager

GOOD = """
from flashllm import hookimpl
from flashllm.registry.backend import Backend

@hookimpl
def flashllm_register_backends(register):
    register(Backend(name="{name}", device_type="cpu", priority=5))
"""


def test_builtin_backends_register_through_the_hook() -> None:
    plugins = make_plugin_manager(load_entry_points=False)
    assert list(plugins.backends()) == ["dcu", "cuda", "npu", "gcu", "xpu", "xla", "ipex", "cpu", "ggml", "reference"]  # by priority
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM"} <= set(plugins.model_targets())


def test_entry_point_plugin_is_loaded(install_dist) -> None:
    install_dist("fl-good", {"fl_good": GOOD.format(name="good")}, {"good": "fl_good"})
    plugins = make_plugin_manager()
    assert "good" in plugins.backends()
    assert "good" in plugins.plugin_names()


def test_allow_list_keeps_only_named_plugins(install_dist, monkeypatch) -> None:
    install_dist("fl-a", {"fl_a": GOOD.format(name="a")}, {"a": "fl_a"})
    install_dist("fl-b", {"fl_b": GOOD.format(name="b")}, {"b": "fl_b"}, version="0.2")
    monkeypatch.setenv("FLASHLLM_PLUGINS", "b")
    backends = make_plugin_manager().backends()
    assert "b" in backends and "a" not in backends
    monkeypatch.setenv("FLASHLLM_PLUGINS", "")
    backends = make_plugin_manager().backends()
    assert "a" not in backends and "b" not in backends and "cpu" in backends


def test_block_list_skips_named_plugins(install_dist, monkeypatch) -> None:
    install_dist("fl-a", {"fl_a": GOOD.format(name="a")}, {"a": "fl_a"})
    monkeypatch.setenv("FLASHLLM_DISABLE_PLUGINS", "a, other")
    assert "a" not in make_plugin_manager().backends()


def test_two_backends_with_one_name_is_an_error(install_dist) -> None:
    install_dist("fl-dup", {"fl_dup": GOOD.format(name="cpu")}, {"dup": "fl_dup"})
    with pytest.raises(PluginError, match="two backends are named 'cpu'"):
        make_plugin_manager().backends()


def test_broken_plugin_is_reported_by_name_and_version(install_dist, caplog) -> None:
    install_dist("fl-broken", {"fl_broken": "raise ImportError('vendor SDK missing')"}, {"broken": "fl_broken"}, "1.2.3")
    with caplog.at_level(logging.WARNING):
        plugins = make_plugin_manager()
    assert [f.name for f in plugins.failures] == ["broken"]
    message = plugins.failures[0].describe()
    assert "fl-broken 1.2.3" in message and "vendor SDK missing" in message
    assert "fl-broken 1.2.3" in caplog.text
    assert "cpu" in plugins.backends()  # the rest keeps working


def test_broken_plugin_that_was_asked_for_is_fatal(install_dist, monkeypatch) -> None:
    install_dist("fl-broken", {"fl_broken": "raise ImportError('nope')"}, {"broken": "fl_broken"})
    monkeypatch.setenv("FLASHLLM_PLUGINS", "broken")
    with pytest.raises(PluginError, match="broken.*nope.*FLASHLLM_PLUGINS"):
        make_plugin_manager()


def test_misspelt_hook_is_caught(install_dist) -> None:
    source = "from flashllm import hookimpl\n@hookimpl\ndef flashllm_register_backend(register):\n    pass\n"
    install_dist("fl-typo", {"fl_typo": source}, {"typo": "fl_typo"})
    with pytest.raises(PluginError, match="flashllm_register_backend"):
        make_plugin_manager()


def test_register_rejects_non_backend_objects(install_dist) -> None:
    source = "from flashllm import hookimpl\n@hookimpl\ndef flashllm_register_backends(register):\n    register('cpu')\n"
    install_dist("fl-bad", {"fl_bad": source}, {"bad": "fl_bad"})
    with pytest.raises(PluginError, match="expects a flashllm Backend, got str"):
        make_plugin_manager().backends()


def test_every_hookspec_is_documented_and_prefixed() -> None:
    import inspect

    from flashllm.registry import hookspecs

    specs = [f for n, f in vars(hookspecs).items() if n.startswith("flashllm_")]
    assert len(specs) == 3
    for spec in specs:
        assert inspect.getdoc(spec) and len(inspect.getdoc(spec)) > 80, spec.__name__
        assert all(p.annotation is not inspect.Parameter.empty for p in inspect.signature(spec).parameters.values())
