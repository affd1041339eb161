"""The initial matrix's computation beside a server (``warm.py``, ``warm_checks.py``): what is
checked before a child is started (memory, a failure recorded, the context's length), what
the child inherits, and what it does under its lock, without building an engine."""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
from types import SimpleNamespace

import pytest
import torch

from vllm_recycling import warm_checks as checks
from vllm_recycling.prior import PriorError, load_prior, save_prior

GIB = 1 << 30


def _prior(vocab=16, k=4):
    table = torch.stack([(torch.arange(vocab) + d) % vocab for d in range(1, k + 1)], 1).int()
    return table, torch.full((vocab, k), 0.125, dtype=torch.float16)


# -- pure checks ------------------------------------------------------------------------------------

def test_mem_available_is_read_from_meminfo():
    text = "MemTotal:       16318412 kB\nMemFree:          123456 kB\nMemAvailable:    2048 kB\n"
    assert checks.mem_available(text) == 2048 * 1024
    assert checks.mem_available("MemTotal: 1 kB\n") is None
    assert checks.read_mem_available("/nonexistent/meminfo") is None


def test_memory_problem_below_one_and_a_half_checkpoints_and_the_kv_cache():
    """Review B1: the background computation needs 1.5 x the checkpoint plus its 1 GiB KV cache."""
    checkpoint = 4 * GIB
    need = 6 * GIB + checks.PRIOR_KV_CACHE_BYTES
    assert checks.memory_needed(checkpoint) == need
    assert checks.memory_problem(need, checkpoint) is None
    assert checks.memory_problem(need - 1, checkpoint) == (
        "computing it beside the server needs about 7.0 GiB of memory (1.5 x the checkpoint's 4.0 GiB "
        "and a 1.0 GiB KV cache) and 7.0 GiB is available"
    )
    assert checks.memory_problem(None, checkpoint) is None and checks.memory_problem(GIB, None) is None


def test_a_bfloat16_model_computed_in_float32_counts_its_weights_twice():
    checkpoint = 4 * GIB
    need = 12 * GIB + checks.PRIOR_KV_CACHE_BYTES
    assert checks.memory_needed(checkpoint, upcast=2.0) == need
    assert checks.memory_problem(need - 1, checkpoint, upcast=2.0) == (
        "computing it beside the server needs about 13.0 GiB of memory (1.5 x 2 x the checkpoint's 4.0 GiB "
        "and a 1.0 GiB KV cache) and 13.0 GiB is available"
    )


def test_the_prior_of_a_bfloat16_model_is_computed_in_float32_on_cpus_without_bfloat16(tmp_path):
    """Issue 72: on an AVX2-only CPU vLLM's bfloat16 rows cost 5.8x float32's (SmolLM2,
    benchmarks/results/prior_rows_cost_smollm2.md); where the CPU has AVX512-BF16 or AMX, or on
    an accelerator, or for another dtype, the model's own dtype is kept."""
    avx2 = {"fpu", "sse2", "avx", "avx2", "fma"}
    assert checks.prior_dtype("bfloat16", True, avx2) == "float32"
    assert checks.prior_dtype("bfloat16", True, avx2 | {"avx512f", "avx512_bf16"}) is None
    assert checks.prior_dtype("bfloat16", True, avx2 | {"amx_bf16", "amx_tile"}) is None
    assert checks.prior_dtype("bfloat16", False, avx2) is None  # a GPU
    assert checks.prior_dtype("float32", True, avx2) is None and checks.prior_dtype("float16", True, avx2) is None
    assert checks.prior_dtype("bfloat16", True, None) is None  # flags unknown: the model's own
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert checks.cpu_flags(cpuinfo) == {"fpu", "sse2", "avx2"}
    assert checks.cpu_flags(tmp_path / "missing") is None


def test_checkpoint_bytes_counts_the_weights_vllm_loads(tmp_path):
    both = tmp_path / "both"
    both.mkdir()
    (both / "model-00001.safetensors").write_bytes(b"x" * 10)
    (both / "model-00002.safetensors").write_bytes(b"x" * 5)
    (both / "pytorch_model.bin").write_bytes(b"x" * 100)  # vLLM takes the safetensors files
    (both / "config.json").write_text("{}")
    assert checks.checkpoint_bytes(str(both)) == 15
    bins = tmp_path / "bins"
    bins.mkdir()
    (bins / "pytorch_model.bin").write_bytes(b"x" * 100)
    assert checks.checkpoint_bytes(str(bins)) == 100
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 7)
    assert checks.checkpoint_bytes(str(gguf)) == 7
    empty = tmp_path / "empty"
    empty.mkdir()
    assert checks.checkpoint_bytes(str(empty)) is None
    # a hub id not in the (empty) Hugging Face cache: its weights are not on disk
    assert checks.checkpoint_bytes("org/not-downloaded", download_dir=str(tmp_path / "hf")) is None


def test_checkpoint_bytes_of_a_hub_id_in_the_cache(tmp_path):
    """A hub id's snapshot in the Hugging Face cache, its files links to blobs."""
    pytest.importorskip("huggingface_hub")
    repo = tmp_path / "hf" / "models--org--m"
    snapshot = repo / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    (repo / "blobs").mkdir()
    (repo / "blobs" / "1").write_text("{}")
    (repo / "blobs" / "2").write_bytes(b"x" * 42)
    (snapshot / "config.json").symlink_to(repo / "blobs" / "1")
    (snapshot / "model.safetensors").symlink_to(repo / "blobs" / "2")
    assert checks.checkpoint_bytes("org/m", download_dir=str(tmp_path / "hf")) == 42


def test_the_child_does_not_inherit_the_servers_core_binding():
    env = {"PATH": "/bin", "OMP_NUM_THREADS": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-3", "OMP_PLACES": "{0,1}",
           "OMP_PROC_BIND": "true", "GOMP_CPU_AFFINITY": "0 1", "KMP_AFFINITY": "explicit",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert checks.child_env(env) == {"PATH": "/bin", "OMP_NUM_THREADS": "4", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                     "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    # without the variable vLLM binds ("auto", vllm/envs.py:53): the child says nobind either way
    assert checks.child_env({})["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_the_child_takes_its_own_kv_cache_not_the_servers():
    """vLLM's CPU platform replaces kv_cache_memory_bytes with VLLM_CPU_KVCACHE_SPACE whenever it
    is set (the Docker image sets 4 GiB): the child's engine takes PRIOR_KV_CACHE_BYTES, what
    memory_needed counts, only without it."""
    env = checks.child_env({"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "4"})
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["PATH"] == "/bin"


def test_prefer_oom_kill_writes_1000_and_says_why_it_could_not(tmp_path):
    adj = tmp_path / "oom_score_adj"
    assert checks.prefer_oom_kill(adj) is None and adj.read_text() == "1000\n"
    assert "No such file" in checks.prefer_oom_kill(tmp_path / "missing" / "oom_score_adj")


def test_prior_max_model_len_fits_the_model_and_its_context():
    """Review C2: the child's engine has at most the model's own length; a context that does not
    fit is refused before any engine is built."""
    assert checks.prior_max_model_len(32768, 31, "m") == checks.PRIOR_MAX_MODEL_LEN == 1024
    assert checks.prior_max_model_len(512, 31, "m") == 512
    assert checks.prior_max_model_len(32, 31, "m") == 32
    with pytest.raises(PriorError, match=r"^the initial matrix of m cannot be computed: its context \(the chat "
                       r"template's opening, 32 tokens, and the token\) does not fit in the 32 positions of its "
                       r"engine \(the model's 32, at most 1024\)$"):
        checks.prior_max_model_len(32, 32, "m")


def test_warm_command_names_what_differs_from_vllms_defaults():
    kwargs = {"model": "org/m", "tokenizer": "org/m", "dtype": "bfloat16", "trust_remote_code": True, "seed": 0,
              "hf_overrides": {"a": 1}, "revision": None}
    defaults = {"dtype": "auto", "seed": 0, "trust_remote_code": False, "hf_overrides": {}}
    assert checks.warm_command(kwargs, 8, defaults, 8) == (
        "vllm-recycling warm org/m --dtype bfloat16 --trust-remote-code --hf-overrides '{\"a\": 1}'")
    assert checks.warm_command({"model": "/a b"}, 4, {}, 8) == (
        "vllm-recycling warm '/a b' --speculative-config '{\"method\": \"recycling\", \"topk\": 4}'")


def test_the_warm_command_parses_as_the_same_settings(tmp_path, monkeypatch):
    """The command in the log lines is one `vllm-recycling warm` takes, for the same model settings."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    from vllm_recycling import cli
    from vllm_recycling.warm_launch import engine_kwargs_of

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "spawn"))
    model = tmp_path / "model"
    model.mkdir()
    args = EngineArgs(str(model), dtype="bfloat16", seed=3, hf_overrides={"max_position_embeddings": 64},
                      trust_remote_code=True)
    kwargs = engine_kwargs_of(args)
    words = shlex.split(checks.warm_command_of(kwargs, 4))
    assert words[:3] == ["vllm-recycling", "warm", str(model)]
    _, parsed = cli.serve_arguments(words[2:])
    again = engine_kwargs_of(EngineArgs.from_cli_args(parsed))
    assert again == kwargs and parsed.speculative_config == {"method": "recycling", "topk": 4}


def test_a_recorded_failure_holds_until_its_retry_time(tmp_path):
    path = tmp_path / "priors" / "k.safetensors"
    assert checks.recorded_failure(path) is None
    checks.record_failure(path, "ValueError: boom", now=1000.0)
    assert checks.failed_path(path) == tmp_path / "priors" / "k.failed"
    want = {"error": "ValueError: boom", "failed_at": 1000.0, "retry_after": 1000.0 + checks.FAILED_RETRY_S}
    assert checks.recorded_failure(path, now=1000.0 + checks.FAILED_RETRY_S - 1) == want
    assert checks.recorded_failure(path, now=1000.0 + checks.FAILED_RETRY_S) is None
    assert sorted(p.name for p in path.parent.iterdir()) == ["k.failed"]
    checks.failed_path(path).write_text("{torn")
    assert checks.recorded_failure(path, now=0.0) is None
    checks.clear_failure(path)
    checks.clear_failure(path)
    assert list(path.parent.iterdir()) == []


# -- the front end ----------------------------------------------------------------------------------

@pytest.fixture()
def front_end(tmp_path, monkeypatch, caplog):
    """start_prior's surroundings: a cache of its own, a model "m" of 16 tokens, its log."""
    pytest.importorskip("vllm")
    from vllm_recycling import LOGGER_NAME
    from vllm_recycling import warm_launch as warm

    monkeypatch.setenv("VLLM_RECYCLING_CACHE", str(tmp_path))
    logger = logging.getLogger(LOGGER_NAME)
    monkeypatch.setattr(logger, "propagate", True)
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    config = SimpleNamespace(model="m", revision=None, get_vocab_size=lambda: 16, dtype=torch.float32)
    return warm, SimpleNamespace(model="m"), config, warm._path_of(config, 4)


def test_a_failed_computation_on_a_gpu_is_logged_and_the_server_goes_on(front_end, monkeypatch, caplog):
    """Review C2: with a synchronous computation (on a GPU) a failure no longer refuses to start;
    review B4: the child gets this process as its parent, so it stops when the front end does."""
    warm, args, config, _ = front_end
    runs = []

    def run(argv, env):
        runs.append(argv)
        return subprocess.CompletedProcess(argv, 1)

    monkeypatch.setattr(warm.subprocess, "run", run)
    assert warm.start_prior(args, config, 4, background=False) is None
    assert len(runs) == 1 and runs[0][runs[0].index("--parent") + 1] == str(os.getpid())
    assert ("computing the initial matrix of m failed (exit 1, see the log above); serving goes on with matrix "
            "rows learnt from traffic only (to compute it: vllm-recycling warm m --speculative-config "
            "'{\"method\": \"recycling\", \"topk\": 4}')") in caplog.text


def test_no_child_where_the_memory_it_needs_is_not_available(front_end, monkeypatch, caplog):
    """Review B1: on the CPU the background child is not started where MemAvailable is below
    1.5 x the checkpoint and its KV cache; the log says what it needs, what there is, and the
    command that computes it ahead of time."""
    warm, args, config, _ = front_end
    monkeypatch.setattr(warm.subprocess, "Popen", lambda *a, **k: pytest.fail("a child without the memory for it"))
    monkeypatch.setattr(warm, "read_mem_available", lambda: 2 * GIB)
    monkeypatch.setattr(warm, "checkpoint_bytes", lambda model, revision, download_dir: GIB)
    assert warm.start_prior(args, config, 4, background=True) is None
    assert ("the initial matrix of m is not computed: computing it beside the server needs about 2.5 GiB of memory "
            "(1.5 x the checkpoint's 1.0 GiB and a 1.0 GiB KV cache) and 2.0 GiB is available; matrix rows are "
            "learnt from traffic only. To compute it ahead of time, with the server stopped: vllm-recycling warm m "
            "--speculative-config '{\"method\": \"recycling\", \"topk\": 4}'") in caplog.text


def test_the_background_child_starts_where_the_memory_is_there(front_end, monkeypatch):
    warm, args, config, _ = front_end
    started = []

    class Child:
        def __init__(self, argv, env, stdin):
            started.append((argv, env))

        def wait(self):
            return 0

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    monkeypatch.setattr(warm.subprocess, "Popen", Child)
    monkeypatch.setattr(warm, "read_mem_available", lambda: 3 * GIB)
    monkeypatch.setattr(warm, "checkpoint_bytes", lambda model, revision, download_dir: GIB)
    assert isinstance(warm.start_prior(args, config, 4, background=True), Child)
    (argv, env), = started
    assert argv[argv.index("--parent") + 1] == str(os.getpid()) and argv[argv.index("--nice") + 1] == "10"
    assert argv[argv.index("--rows") + 1] == "pay"  # beside a server: the rows that pay (warm.RowPlan)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_a_prior_stopped_on_purpose_starts_no_child(front_end, monkeypatch, caplog):
    """Issue 72: once a computation beside a server stopped after the rows that pay, later
    starts take it as it is (saying so, with the command that computes the rest) and start no
    child; a bfloat16 model computed in float32 on an AVX2-only CPU counts its weights twice."""
    warm, args, config, path = front_end
    table, probs = _prior()
    table[8:], probs[8:] = 0, 0
    save_prior(path, table, probs, "m", 1.0, rows=8, stopped=True)
    monkeypatch.setattr(warm.subprocess, "Popen", lambda *a, **k: pytest.fail("a child was started"))
    assert warm.start_prior(args, config, 4, background=True) is None
    assert "holds the first 8 of 16 rows (its computation stopped there on purpose" in caplog.text
    path.unlink()
    config.dtype = torch.bfloat16
    monkeypatch.setattr(warm, "cpu_flags", lambda: {"avx2"})
    monkeypatch.setattr(warm, "read_mem_available", lambda: int(3.5 * GIB))  # 2.5 GiB in bfloat16
    monkeypatch.setattr(warm, "checkpoint_bytes", lambda model, revision, download_dir: GIB)
    assert warm.start_prior(args, config, 4, background=True) is None
    assert "(1.5 x 2 x the checkpoint's 1.0 GiB and a 1.0 GiB KV cache) and 3.5 GiB is available" in caplog.text


def test_the_background_child_runs_on_one_rank(front_end, monkeypatch):
    """A server over several ranks (tensor parallel) starts a child on one: over several its
    executor would bind the server ranks' cores and hold a copy per rank beyond the memory
    check's; one rank computes the same prior. On a GPU (synchronous) the ranks are kept: the
    model may not fit one."""
    warm, _, config, _ = front_end
    args = SimpleNamespace(model="m", tensor_parallel_size=2, dtype="bfloat16")
    started = []

    class Child:
        def __init__(self, argv, env, stdin):
            started.append(argv)

        def wait(self):
            return 0

    monkeypatch.setattr(warm.subprocess, "Popen", Child)
    monkeypatch.setattr(warm, "read_mem_available", lambda: 3 * GIB)
    monkeypatch.setattr(warm, "checkpoint_bytes", lambda model, revision, download_dir: GIB)
    warm.start_prior(args, config, 4, background=True)
    (argv,) = started
    assert json.loads(argv[argv.index("--engine-args") + 1]) == {"model": "m", "dtype": "bfloat16"}
    runs = []
    monkeypatch.setattr(warm.subprocess, "run", lambda argv, env: runs.append(argv) or
                        subprocess.CompletedProcess(argv, 1))
    warm.start_prior(args, config, 4, background=False)
    (argv,) = runs
    assert json.loads(argv[argv.index("--engine-args") + 1])["tensor_parallel_size"] == 2


@pytest.mark.parametrize("background", [True, False])
def test_a_recorded_failure_stops_every_start_from_trying_again(front_end, monkeypatch, caplog, background):
    """Review C2: a computation that failed is not started again by a server before its retry
    time (on the CPU or a GPU); the log says when and how to compute it now."""
    warm, args, config, path = front_end
    monkeypatch.setattr(warm.subprocess, "Popen", lambda *a, **k: pytest.fail("started again"))
    monkeypatch.setattr(warm.subprocess, "run", lambda *a, **k: pytest.fail("started again"))
    checks.record_failure(path, "ValueError: the model cannot")
    assert warm.start_prior(args, config, 4, background=background) is None
    assert "the initial matrix of m is not computed: computing it failed on " in caplog.text
    assert "(ValueError: the model cannot); a start tries again after " in caplog.text
    assert "or now: vllm-recycling warm m --speculative-config" in caplog.text


def test_warm_ignores_a_recorded_failure(front_end, monkeypatch):
    """``vllm-recycling warm`` (ensure_prior) is an explicit request: it computes anyway."""
    warm, args, config, path = front_end
    checks.record_failure(path, "ValueError: earlier")

    def run(argv, env):
        save_prior(path, *_prior(), "m", 1.0)
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(warm.subprocess, "run", run)
    assert warm.ensure_prior(args, config, 4) == path


# -- the child --------------------------------------------------------------------------------------

def _main(warm, path, *extra):
    return warm.main(["--engine-args", json.dumps({"model": "m"}), "--topk", "4", "--out", str(path), *extra])


@pytest.fixture()
def child(tmp_path, monkeypatch):
    from vllm_recycling import warm

    monkeypatch.setattr(warm, "prefer_oom_kill", lambda: None)  # not this test process
    return warm, tmp_path / "priors" / "k.safetensors"


def test_the_child_removes_what_killed_saves_left_under_its_lock(child):
    """Review B2: temporary files of a save that was killed are removed by the next computation
    (under the lock, where no save can be under way); a complete prior also clears a failure."""
    warm, path = child
    save_prior(path, *_prior(), "m", 1.0)
    stale = [path.with_name(f".{path.name}.{tag}.tmp") for tag in ("x1", "y2")]
    for tmp in stale:
        tmp.write_bytes(b"half a file")
    checks.record_failure(path, "earlier")
    assert _main(warm, path) == 0
    assert not any(tmp.exists() for tmp in stale) and checks.recorded_failure(path) is None
    assert load_prior(path, 16, 4).complete


def test_a_child_waiting_for_the_lock_stops_when_its_parent_is_gone(child, monkeypatch):
    """Review D8: a child waiting while another process computes the prior checks its parent."""
    from vllm_recycling import files
    from vllm_recycling.files import FileLock

    warm, path = child
    monkeypatch.setattr(files, "LOCK_POLL_S", 0.0)
    monkeypatch.setattr(warm, "exit_with_parent", lambda parent, log: None)  # it would end this test process
    with FileLock(warm.lock_path(path)):
        with pytest.raises(SystemExit) as stopped:
            _main(warm, path, "--parent", str(os.getpid()))  # this process is nobody's parent here
    assert stopped.value.code == 3


# A child whose engine takes minutes to start (warm.warm stubbed: LLM(...) calls nothing of ours),
# started by a parent that prints its pid
_SLOW_CHILD = """
import sys, time
from pathlib import Path
from vllm_recycling import warm

def starting(kwargs, topk, path, progress=None, resume=None, pay_only=False):
    progress.engine_starting()
    Path(sys.argv[1]).touch()
    time.sleep(300)

warm.warm = starting
sys.exit(warm.main(sys.argv[2:]))
"""
_PARENT = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:], "--parent", str(os.getpid())])
print(child.pid, flush=True)
child.wait()
"""


def _gone(pid):
    """Whether process ``pid`` has ended (a zombie nobody reaped counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_child_whose_engine_is_starting_stops_when_its_parent_is_gone(tmp_path):
    """A server stopped while the child builds its engine (no batch yet to look for the parent):
    the child ends within seconds instead of loading a model for nobody."""
    import signal
    import sys
    import time

    flag, log = tmp_path / "engine-starting", tmp_path / "child.log"
    argv = [sys.executable, "-c", _PARENT, _SLOW_CHILD, str(flag), "--engine-args", json.dumps({"model": "m"}),
            "--topk", "4", "--out", str(tmp_path / "priors" / "k.safetensors")]
    with open(log, "wb") as stderr:
        parent = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True)
    pid = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 120  # the child imports torch first
        while not flag.exists() and time.monotonic() < deadline and not _gone(pid):
            time.sleep(0.1)
        assert flag.exists(), log.read_text()
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(pid), "the child still runs with its parent gone"
        assert "the server stopped; the initial matrix was not finished" in log.read_text()
    finally:
        parent.kill()
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_model_whose_context_does_not_fit_is_not_computed(child, monkeypatch, caplog):
    """Review C2: a model with fewer positions than the context is refused before any engine is
    built, with the reason logged and recorded, so that starts do not try again."""
    pytest.importorskip("vllm")
    import vllm

    from vllm_recycling.tools.models import ModelUnavailableError, prepare_model

    warm, path = child
    try:
        model = str(prepare_model("tiny-random"))
    except ModelUnavailableError as e:
        pytest.skip(str(e))
    monkeypatch.setattr(vllm, "LLM", lambda *a, **k: pytest.fail("an engine was built"))
    kwargs = {"model": model, "dtype": "float32", "hf_overrides": {"max_position_embeddings": 16}}
    log = logging.getLogger("vllm_recycling.warm")  # the child's own lines (_Progress)
    log.addHandler(caplog.handler)
    try:
        code = warm.main(["--engine-args", json.dumps(kwargs), "--topk", "4", "--out", str(path)])
    finally:
        log.removeHandler(caplog.handler)
    assert code == 2
    error = checks.recorded_failure(path)["error"]
    assert error == (f"the initial matrix of {model} cannot be computed: its context (the chat template's opening, "
                     "32 tokens, and the token) does not fit in the 16 positions of its engine (the model's 16, "
                     "at most 1024)")
    assert error in caplog.text and not path.exists()
