"""benchmarks/soak.py, short: the request plan (no server), absurd speculative configs, and 96
requests of the soak's mix against two tiny-random servers started side by side: recycling
verifying the whole default tree every step (``"budget": "fixed"``: on 2 CPU cores the default
budget verifies few drafts on tiny-random, and trees are what a soak should stress) and no
speculation. ``python benchmarks/soak.py`` runs the long form, with the default config.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from vllm_recycling.config import RecyclingConfig, RecyclingConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak  # noqa: E402
import soak_requests  # noqa: E402

REQUESTS = 96
SPECS = [{"method": "recycling", "budget": "fixed"}]
# What vLLM 0.32 answers to each bad input, with speculation or without.
BAD_STATUS = {
    "token id >= vocab": 400,
    "negative token id": 400,
    "empty prompt": 400,
    "empty token list": 400,
    "max_tokens > context": 400,
    "prompt > context": 400,
    "prompt fills context": 400,
    "chat max_tokens > context": 400,
    "chat no messages": 400,
    "malformed JSON": 400,
    "chat malformed JSON": 400,
    "unknown model": 404,
    "chat unknown model": 404,
    "logprobs > 20": 400,
    "negative temperature": 400,
}


def test_plan_is_seeded_and_has_every_kind():
    plan = soak_requests.build_plan(REQUESTS, seed=0)
    assert [(r.kind, r.body, r.action) for r in plan] == [
        (r.kind, r.body, r.action) for r in soak_requests.build_plan(REQUESTS, seed=0)]
    assert [r.body for r in plan] != [r.body for r in soak_requests.build_plan(REQUESTS, seed=1)]
    assert [r.index for r in plan] == list(range(REQUESTS))
    kinds = {r.kind for r in plan}
    assert set(soak_requests.KINDS) <= kinds
    assert {k[len("bad: "):] for k in kinds if k.startswith("bad: ")} == set(BAD_STATUS)
    assert soak_requests.EXPECTED_STATUS == BAD_STATUS
    bodies = [r.body for r in plan if r.expect_status == 200]
    assert any(b.get("n", 1) > 1 for b in bodies) and any("seed" in b for b in bodies)
    assert any("cache_salt" in b for b in bodies) and any("stop" in b for b in bodies)
    assert any(b.get("stream") for b in bodies) and any(not b.get("stream") for b in bodies)
    assert any("messages" in b for b in bodies) and any("prompt" in b for b in bodies)
    assert any(b.get("max_tokens") == 1 for b in bodies)
    assert any(b.get("top_k", -1) > 0 and b["top_p"] == 1.0 for b in bodies)  # top-k without top-p
    for r in plan:
        if r.kind in ("long prompt", "sampled long"):
            assert len(r.body["prompt"]) >= 900
            assert len(r.body["prompt"]) + r.body["max_tokens"] <= soak_requests.MAX_MODEL_LEN
        if r.greedy:  # compared token by token, with the top-2 for near-ties
            assert r.body["temperature"] == 0 and r.body["ignore_eos"] and r.action == "complete"
            assert r.body.get("logprobs") in (2, True) and r.body["return_token_ids"]
    assert any(len(r.body["prompt"]) + r.body["max_tokens"] == soak_requests.MAX_MODEL_LEN
               for r in soak_requests.build_plan(1000, seed=0) if r.kind == "long prompt")


def test_server_names():
    assert soak.spec_name(None) == "no speculation"
    assert soak.spec_name({"method": "recycling"}) == "recycling"
    assert [soak.spec_name(s) for s in SPECS] == ["recycling budget=fixed"]
    assert soak.spec_name({"method": "ngram", "num_speculative_tokens": 3}) == "ngram num_speculative_tokens=3"


@pytest.mark.parametrize(("spec", "key"), [
    ({"tree": {"paths": {"nested": [[0]]}}}, "tree"),
    ({"topk": 10**12}, "topk"),
    ({"matrix_snapshot_interval": -5}, "matrix_snapshot_interval"),
    ({"num_speculative_tokens": 10**9}, "num_speculative_tokens"),
    ({"method": {"recycling": True}}, "method"),
])
def test_absurd_speculative_configs_are_refused(spec, key):
    with pytest.raises(RecyclingConfigError, match="^" + re.escape(f'speculative_config["{key}"] = ')):
        RecyclingConfig.from_dict({"method": "recycling", **spec})


def test_absurd_speculative_config_text_is_refused():
    with pytest.raises(RecyclingConfigError, match="is not valid"):
        RecyclingConfig.from_dict('{"method": "recycling", "topk": 1e400}')  # JSON's infinity
    with pytest.raises(RecyclingConfigError, match=re.escape("unknown key(s) 'extra'")):
        RecyclingConfig.from_dict({"method": "recycling", "extra": {"a": [1, {"b": None}]}})


@pytest.mark.slow
def test_soak_short(tiny_model, tmp_path):
    pytest.importorskip("vllm")
    report = soak.run_soak(requests=REQUESTS, concurrency=8, specs=SPECS, seed=0, rss_interval=1.0,
                           log_dir=tmp_path)
    report["problems"] = found = soak.problems(report)
    print("\n" + soak.tables(report))
    assert found == [], "\n".join([*found, f"server logs in {tmp_path}"])

    plan = soak_requests.build_plan(REQUESTS, seed=0)
    kinds = report["plan"]
    assert list(report["servers"]) == ["recycling budget=fixed", "no speculation"]
    for name, r in report["servers"].items():
        assert r["5xx"] == 0 and r["failures"] == [], name
        assert sum(r["outcomes"].values()) == REQUESTS  # every request accounted for
        assert {k: v["requests"] for k, v in r["by_kind"].items()} == kinds
        assert set(r["statuses"]) <= {"200", "400", "404", "client gave up"}
        assert r["statuses"].get("client gave up", 0) == r["outcomes"].get("aborted", 0)
        assert r["outcomes"].get("rejected") == kinds["bad input"] == len(BAD_STATUS)
        assert r["by_kind"]["disconnect"].get("disconnected") == kinds["disconnect"]
        assert r["health_after"] == 200 and r["final_request"] == "ok"
    assert report["servers"]["recycling budget=fixed"]["outcomes"].get("aborted", 0) > 0
    assert set(report["bad_input"]) == set(BAD_STATUS)
    for bad, entry in report["bad_input"].items():  # each case once in 96 requests
        assert all(statuses == [BAD_STATUS[bad]] for statuses in entry["answers"].values()), (bad, entry)

    for name, greedy in report["greedy"].items():
        assert greedy["compared"] == sum(r.greedy for r in plan) and greedy["not_compared"] == 0, name
        assert greedy["different"] == 0 and greedy["identical"] + greedy["near_ties"] == greedy["compared"]
        assert greedy["final_request"] in ("identical", "near-tie"), name
    fixed = report["servers"]["recycling budget=fixed"]["spec_decode"]
    assert fixed["drafts"] > 0 and fixed["accepted"] > 0  # trees were verified, and some drafts accepted

    for name, r in report["servers"].items():
        assert r["rss"]["growth_pct"] < 15, (name, r["rss"])
