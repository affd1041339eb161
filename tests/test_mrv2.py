"""The Model Runner V2 adapter (``vllm_recycling.mrv2``) in the vLLM 0.34 CPU engine
(``make venv034``: vLLM 0.34's own Python and kernels, Triton's interpreter running vLLM's and
the plugin's Triton kernels on the CPU, so the path a GPU runs is what runs here).

The speculator alone on vLLM 0.34's ``RequestState`` (what it learns, what it drafts, with no
read back to the host), then engines without speculation and with trees on tiny-random in
float32, on vLLM's Triton attention (the GPU path, through Triton's interpreter):
greedy at batch 1 and 3, seeded sampling, a prompt answered twice so that the second answer is
drafted from what the first taught the matrix, trees verified as trees; then the server (its
CPU attention, the chain) answering an OpenAI client.
How the adapter's targets match vLLM 0.34's source: ``test_vllm_releases.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from vllm_releases import VENV034, engine034_missing, run034


@pytest.fixture(scope="module", autouse=True)
def engine034():
    """The engine, once ``make test``'s install beside the suite is done (this module runs after
    the suite's longest: conftest.py); a skip where it cannot be built here, a failure where its
    install failed."""
    missing = engine034_missing()
    if missing is not None:
        pytest.skip(missing)

SPECULATOR = '''
import torch
from types import SimpleNamespace
from vllm_recycling.mrv2.speculator import RecyclingSpeculator

V, K = 32, 3

def build(scope):
    states = SimpleNamespace(max_num_reqs=4)  # vLLM's RequestState pins host memory: CUDA only
    options = {"verify": "chain", "num_speculative_tokens": K, "matrix_init": "empty", "topk": 2,
               "matrix_scope": scope}
    config = SimpleNamespace(speculative_config=SimpleNamespace(speculator_options=options,
                                                                num_speculative_tokens=K),
                             model_config=SimpleNamespace(get_vocab_size=lambda: V))
    return states, RecyclingSpeculator(config, torch.device("cpu"), states)

def one_hot(*argmax):
    logits = torch.full((len(argmax), V), -5.0)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    logits[:, 1] = 0.0  # every row's second choice
    return logits

def refusing_reads():
    """Every way a tensor's value reaches the host raises while the step runs."""
    names = ("tolist", "item", "cpu", "numpy", "__bool__")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    def refuse(name):
        def call(*a, **k):
            raise AssertionError(f"Tensor.{name} called")
        return call
    for n in names:
        setattr(torch.Tensor, n, refuse(n))
    return lambda: [setattr(torch.Tensor, n, f) for n, f in saved.items()]

def step(scope, clear_slot=None):
    states, speculator = build(scope)
    assert getattr(states, "recycling_learner") is speculator
    # requests in request-state slots 2 and 0; slot 2 fed its root 5 and a draft 7, slot 0 its root 5
    batch = SimpleNamespace(
        num_reqs=2, idx_mapping=torch.tensor([2, 0]), expanded_idx_mapping=torch.tensor([2, 2, 0]),
        input_ids=torch.tensor([5, 7, 9, 5], dtype=torch.int32), logits_indices=torch.tensor([0, 1, 3]))
    last_sampled = torch.zeros(4, 1, dtype=torch.int64)
    last_sampled[2, 0] = last_sampled[0, 0] = 5
    restore = refusing_reads()
    try:
        speculator.learn(one_hot(7, 9, 11), batch)
        if clear_slot is not None:
            speculator.add_request(clear_slot)
        drafts = speculator.propose(batch, None, None, None, None, None, None, last_sampled, None, None, None)
    finally:
        restore()
    return drafts.tolist()

def main():
    return {"overlay": step("overlay"), "shared": step("shared"), "cleared": step("overlay", clear_slot=2),
            "per_request": step("per_request")}
'''


def test_the_speculator_learns_and_drafts_on_the_device():
    """In vLLM 0.34's Python (its request state, whose constructor pins host memory, stood in
    for by its ``max_num_reqs``): after one step's logits (slot 2 fed 5 then 7, whose
    rows' argmax were 7 and 9; slot 0 fed 5, argmax 11) each request drafts its chain from its
    last sampled token, from its own rows first (overlay), the last writer's shared rows
    (shared), its own matrix (per_request); a slot a new request takes starts empty of its own
    rows. Nothing is read back to the host while it learns and drafts."""
    found = run034(SPECULATOR, timeout=300)
    # rows no step wrote hold token 0 (matrix_init "empty"), whose row holds 0 again
    assert found == {
        "overlay": [[7, 9, 0], [11, 0, 0]],
        "shared": [[11, 0, 0], [11, 0, 0]],
        "cleared": [[11, 0, 0], [11, 0, 0]],
        "per_request": [[7, 9, 0], [11, 0, 0]],
    }


ENGINES = '''
import sys
from vllm import LLM, SamplingParams
from vllm_recycling.mrv2.speculator import RecyclingSpeculator

sys.path.insert(0, {tests!r})
from interpreter import skip_discarded_overflow_checks

skip_discarded_overflow_checks()  # the engine runs in this process
MODEL = {model!r}
PROMPTS = [[1, 5, 9, 13, 5, 9, 13, 5, 9], [1, 7, 7, 7, 30, 31, 32], [2, 40, 41]]
EMPTY = {{"method": "recycling", "matrix_init": "empty"}}
SPECS = {{"none": None,
         # 12 nodes at batch 1, the first 5 (the root's children: still a tree) at 2 to 4
         "tree": {{**EMPTY, "verify": "tree", "num_speculative_tokens": 12,
                  "num_speculative_tokens_per_batch_size": [[1, 1, 12], [2, 4, 5]]}}}}
PATHS = []  # every step's accepted paths (local indices), read here only
WIDTHS = []  # every tree step's rows per request (root and nodes)

def keep_paths(end_step):
    def wrapper(self, input_batch):
        if self.step is not None:
            step = self.step[0]
            PATHS.extend(self.paths[input_batch.idx_mapping[step.req_index].long()].tolist())
            WIDTHS.extend(step.num_rows_np.tolist())
        return end_step(self, input_batch)
    return wrapper

RecyclingSpeculator.end_step = keep_paths(RecyclingSpeculator.end_step)

def counters(llm):
    found = {{m.name: getattr(m, "value", None) for m in llm.get_metrics()}}
    return {{k.rsplit("_", 2)[-2] + "_" + k.rsplit("_", 1)[-1]: found.get(k) or 0 for k in (
        "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}}

def run(spec):
    PATHS.clear(), WIDTHS.clear()
    llm = LLM(MODEL, speculative_config=spec, dtype="float32", enforce_eager=True, max_model_len=256,
              max_num_seqs=4, seed=0, disable_log_stats=False)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.9, seed=7 + i, max_tokens=10, ignore_eos=True) for i in range(3)]
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]
    prompts = [{{"prompt_token_ids": p}} for p in PROMPTS]
    batch3 = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
    result = {{"batch1": ids(llm.generate(prompts[:1], greedy)), "batch3": ids(batch3),
              "seeded": ids(llm.generate(prompts, seeded)),
              "logprobs": [[sorted((t, lp.logprob) for t, lp in step.items()) for step in o.outputs[0].logprobs]
                           for o in batch3]}}
    result["counters"] = counts = [counters(llm)]
    fresh = [{{"prompt_token_ids": [3, 50, 51, 52]}}]
    result["first"] = ids(llm.generate(fresh, greedy))
    counts.append(counters(llm))
    result["again"] = ids(llm.generate(fresh, greedy))  # drafted from what the first taught
    counts.append(counters(llm))
    result["impls"] = llm.collective_rpc(lambda worker: sorted({{
        type(layer.impl).__name__ for layer in
        worker.model_runner.vllm_config.compilation_config.static_forward_context.values()
        if hasattr(layer, "impl")}}))[0]
    if spec is not None:
        result["tree_steps"] = llm.collective_rpc(lambda worker: worker.model_runner.speculator.tree_steps)[0]
        result["paths"] = [p for p in PATHS if p[0] >= 0]
        result["widths"] = sorted(set(WIDTHS))
    return result

def main():
    return {{name: run(spec) for name, spec in SPECS.items()}}
'''


@pytest.fixture(scope="module")
def engines(tiny_model):
    """No speculation and trees (the first 12 nodes of "2.2.2") on tiny-random, both on vLLM's
    Triton attention through Triton's interpreter: the path GPUs run. (The chain's acceptance
    rule, ``verify.accept_chain``, is ``tests/test_mrv2_verify.py``'s; the chain against no
    speculation on a real model: ``benchmarks/studies/mrv2_parity.py``.)"""
    return run034(ENGINES.format(model=tiny_model, tests=str(Path(__file__).parent)), timeout=1200,
                  env={"VLLM_RECYCLING_GPU_PATH_ON_CPU": "1"})


@pytest.mark.slow
def test_greedy_output_is_no_speculations_at_batch_1_and_3(engines):
    assert engines["tree"]["impls"] == engines["none"]["impls"] == ["TritonAttentionImpl"]
    for batch in ("batch1", "batch3"):
        assert engines["tree"][batch] == engines["none"][batch]
    assert engines["tree"]["counters"][0]["num_drafts"] > 0  # the speculator drafted


@pytest.mark.slow
def test_logprobs_are_no_speculations(engines):
    """A greedy request's logprobs (the sampled token and the top 2, each position): a tree
    node's token is scored with the row it was sampled at, not the row vLLM's chain layout
    would read (``verify.emitted_rows``); values to float32 rounding (the tree rows come from
    the tree kernel, plain rows from vLLM's)."""
    for got, want in zip(engines["tree"]["logprobs"], engines["none"]["logprobs"], strict=True):
        assert [[t for t, _ in step] for step in got] == [[t for t, _ in step] for step in want]
        assert all(abs(a[1] - b[1]) < 1e-4 for g, w in zip(got, want) for a, b in zip(g, w))


@pytest.mark.slow
def test_seeded_output_is_no_speculations(engines):
    """Seeded sampled requests (temperature 0.9, a seed each) give the tokens they give without
    speculation: every row is sampled as a plain step samples it (``mrv2.verify``), a tree
    node at its depth's position."""
    assert engines["tree"]["seeded"] == engines["none"]["seeded"]


@pytest.mark.slow
def test_a_second_answer_is_drafted_from_what_the_first_taught(engines):
    """A new prompt answered twice (greedy: the same tokens): the first answer wrote the
    matrix's rows along it, so the second drafts it back and many more drafts are accepted
    (a random model: the first answer drafts from rows other contexts wrote)."""
    found = engines["tree"]
    assert found["first"] == found["again"] == engines["none"]["first"]
    start, first, again = found["counters"]
    accepted_first = first["accepted_tokens"] - start["accepted_tokens"]
    accepted_again = again["accepted_tokens"] - first["accepted_tokens"]
    steps_again = again["num_drafts"] - first["num_drafts"]
    assert steps_again > 0
    assert accepted_again >= steps_again and accepted_again >= 3 * max(accepted_first, 1)


@pytest.mark.slow
def test_trees_are_verified_as_trees(engines):
    """The tree engine's steps were tree steps, as wide as vLLM's batch-size schedule says (tree positions, the tree attention pass, the
    accepted nodes' KV moved), and among the accepted paths are nodes that are not their
    parent's first child (local 2, the root's second child, or deeper nodes under it), whose
    acceptance leaves the output exact only if all three are right."""
    from vllm_recycling.config import RecyclingConfig

    template = RecyclingConfig.from_dict({"method": "recycling", "verify": "tree",
                                         "num_speculative_tokens": 12}).draft_template()
    rank = template.rank.tolist()
    tree = engines["tree"]
    assert tree["tree_steps"] > 0
    # vLLM's batch-size schedule: all 12 nodes alone, the first 5 with others (batch 3)
    assert tree["widths"] == [6, 13]
    assert any(rank[node] > 0 for path in tree["paths"] for node in path if node >= 0), tree["paths"]
    assert max(sum(node >= 0 for node in path) for path in tree["paths"]) >= 2  # two levels deep


FRONT_END = '''
import os
from types import SimpleNamespace
from vllm import SamplingParams
from vllm_recycling import mrv2
from vllm_recycling.config import RecyclingConfigError
from vllm_recycling.mrv2.patches import speculator_spec

mrv2.apply_all()

def front_end(spec, engine_args=None):
    try:
        found = speculator_spec(spec, engine_args)
        options = found["speculator_options"]
        return [found["num_speculative_tokens"], options["verify"], options["context_match"]]
    except RecyclingConfigError as e:
        return f"{type(e).__name__}: {e}"

def params(**kw):
    tree = SimpleNamespace(custom_method="recycling", speculator_options={"verify": "tree"})
    try:
        SamplingParams(**kw)._validate_spec_decode(tree)
        return None
    except Exception as e:  # vLLM's VLLMValidationError, a client error
        return f"{type(e).__name__}: {e}"

def main():
    found = {"cpu_attention": [front_end({"method": "recycling"}), front_end({"method": "recycling", "verify": "tree"})]}
    os.environ["VLLM_RECYCLING_GPU_PATH_ON_CPU"] = "1"
    found["triton"] = [front_end({"method": "recycling"}),
                       front_end({"method": "recycling", "num_speculative_tokens": 12, "context_match": False}),
                       front_end({"method": "recycling", "context_match": True}),
                       front_end({"method": "recycling"}, SimpleNamespace(pipeline_parallel_size=2))]
    found["schedule"] = speculator_spec({"method": "recycling", "num_speculative_tokens_per_batch_size": [[1, 4, 8]]})
    found["params"] = [params(temperature=0.5), params(repetition_penalty=1.2), params(bad_words=["x"]),
                       params(min_p=0.1)]
    return found
'''


def test_the_front_end_decides_trees_and_refuses_what_they_cannot_run():
    """On the 0.34 CPU engine: its CPU attention has no tree pass (an unset verify drafts the
    chain, "tree" is refused with the reason); on vLLM's Triton attention trees are the default
    (the template's 80 nodes, the context branch off, an explicit one refused), pipeline
    parallelism is refused with them; per request, the sampling parameters vLLM applies along
    the drafts as a chain are refused by name, vLLM's own refusals stand."""
    found = run034(FRONT_END, timeout=300)
    chain, refused = found["cpu_attention"]
    assert chain == [6, "chain", True]
    assert refused.startswith("TreesUnsupported: speculative_config verify='tree' is not available here: "
                              "vLLM 0.34's CPU attention has no tree pass in vllm-recycling")
    default, twelve, context, pipeline = found["triton"]
    assert default == [80, "tree", False] and twelve == [12, "tree", False]
    assert context.startswith("RecyclingConfigError: speculative_config context_match=true is not available "
                              "on vLLM 0.34 yet")
    assert pipeline == [6, "chain", True]  # unset verify: the chain, with a warning naming why
    # vLLM's own batch-size schedule passes through to vLLM
    assert found["schedule"]["num_speculative_tokens_per_batch_size"] == [[1, 4, 8]]
    assert found["schedule"]["num_speculative_tokens"] == 80
    plain, penalty, bad_words, min_p = found["params"]
    assert plain is None
    assert penalty.startswith("VLLMValidationError: repetition_penalty is not supported with speculative "
                              "method 'recycling' verifying trees")
    assert bad_words.startswith("VLLMValidationError: bad_words is not supported")
    assert min_p.startswith("VLLMValidationError: The min_p and logit_bias")


@pytest.mark.slow
def test_the_server_answers_an_openai_client(tiny_model, tmp_path):
    """``vllm-recycling serve`` of the 0.34 engine with ``{"method": "recycling"}``: a chat
    request answered, drafts counted on /metrics."""
    import openai

    from test_server import free_port, stop, tail

    port = free_port()
    log_path = tmp_path / "server.log"
    argv = [str(VENV034 / "bin" / "vllm-recycling"), "serve", tiny_model, "--served-model-name", "tiny",
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--host", "127.0.0.1",
            "--port", str(port), "--speculative-config",
            json.dumps({"method": "recycling", "matrix_init": "empty"})]
    env = {**os.environ, "TRITON_INTERPRET": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"the server exited ({proc.returncode})\n{tail(log_path)}"
            assert time.monotonic() < deadline, f"no /health after 300 s\n{tail(log_path)}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        answer = client.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=12,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 12
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        drafts = [float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("vllm:spec_decode_num_drafts_total")]
        assert drafts and sum(drafts) > 0
        assert "Model Runner V2, the matrix's top-1 chain" in Path(log_path).read_text(errors="replace")
    finally:
        stop(proc)
