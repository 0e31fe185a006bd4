from types import SimpleNamespace

import pytest

from ascend_core import registry
from ascend_core.registry import Registry, RegistryError


def make_entry():
    def entry():
        return "ok"
    return entry


def test_register_get_and_list():
    reg = Registry("widget")
    first, second = make_entry(), make_entry()
    reg.register("beta", first)
    reg.register("alpha", second)
    assert reg.get("beta") is first
    assert reg.names() == ["alpha", "beta"] == list(reg)
    assert "alpha" in reg and "gamma" not in reg and len(reg) == 2
    assert reg.find("gamma") is None


def test_registering_the_same_entry_again_is_a_no_op():
    reg = Registry("widget")
    entry = make_entry()
    reg.register("a", entry)
    reg.register("a", entry)
    assert reg.names() == ["a"]


def test_replacing_an_entry_is_refused_with_both_named():
    reg = Registry("widget")
    reg.register("a", make_entry())
    with pytest.raises(RegistryError, match=r"widget 'a' is already registered as .*make_entry"):
        reg.register("a", make_entry())


def test_unknown_name_lists_known_and_suggests():
    reg = Registry("speculative method")
    reg.register("medusa", make_entry())
    reg.register("eagle3", make_entry())
    with pytest.raises(RegistryError) as err:
        reg.get("medusaa")
    message = str(err.value)
    assert "unknown speculative method 'medusaa'" in message
    assert "known: eagle3, medusa" in message
    assert "Did you mean 'medusa'?" in message


def test_empty_name_is_refused():
    with pytest.raises(RegistryError, match="non-empty strings"):
        Registry("widget").register("", make_entry())


def test_decorator_and_unregister():
    reg = Registry("widget")

    @reg.decorator("w")
    def widget():
        return 1

    assert reg.get("w") is widget
    assert reg.unregister("w") is widget
    assert "w" not in reg


def test_core_defines_the_registries_leaf_packages_fill():
    kinds = {r.kind for r in (registry.SPECULATIVE_PROPOSERS, registry.QUANT_SCHEMES,
                              registry.QUANT_CONFIGS, registry.EPLB_POLICIES,
                              registry.CUSTOM_OPS, registry.CONFIG_HOOKS)}
    assert kinds == {"speculative method", "quantization scheme", "quantization config",
                     "EPLB policy", "custom op", "vLLM config hook"}


def test_platforms_run_the_config_hooks_in_name_order():
    from ascend_core.platform.common import AscendPlatformMixin

    calls = []
    first, second = (lambda cfg: calls.append(("a", cfg))), (lambda cfg: calls.append(("b", cfg)))
    registry.CONFIG_HOOKS.register("b-hook", second)
    registry.CONFIG_HOOKS.register("a-hook", first)
    try:
        AscendPlatformMixin.run_config_hooks("config")
    finally:
        registry.CONFIG_HOOKS.unregister("a-hook")
        registry.CONFIG_HOOKS.unregister("b-hook")
    assert calls == [("a", "config"), ("b", "config")]


def test_platforms_run_the_request_checks_after_vllms():
    import pytest

    from ascend_core.platform.host import AscendHostPlatform

    seen = []

    def refuse_penalties(params):
        seen.append(params)
        if getattr(params, "presence_penalty", 0):
            raise ValueError("penalties are not served here")

    registry.REQUEST_CHECKS.register("test-check", refuse_penalties)
    try:
        ok, bad = SimpleNamespace(presence_penalty=0.0), SimpleNamespace(presence_penalty=1.0)
        AscendHostPlatform.validate_request({}, ok)
        with pytest.raises(ValueError, match="penalties are not served here"):
            AscendHostPlatform.validate_request({}, bad)
    finally:
        registry.REQUEST_CHECKS.unregister("test-check")
    assert seen == [ok, bad]
