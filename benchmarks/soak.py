"""Soak test of vLLM's OpenAI server with Token Recycling: a long, seeded mix of requests
against servers with speculation and one without, greedy answers compared token by token.

    python benchmarks/soak.py                                  # 1000 requests, the default config
    python benchmarks/soak.py --requests 200 --spec '{"method": "recycling", "matrix_scope": "salt"}' \\
        --out soak_cpu_salt
    python benchmarks/soak.py --spec '{"method": "recycling"}' \\
        --spec '{"method": "recycling", "budget": "fixed"}'   # two speculative servers

One ``vllm-recycling serve tiny-random`` server per ``--spec`` (its ``--speculative-config``)
and one without speculation start side by side, all with the arguments of
tests/test_server.py (``--dtype float32 --enforce-eager --max-model-len 1024``,
``VLLM_CPU_KVCACHE_SPACE=1``). Each server in turn, the speculative ones first, gets the same
``--requests`` requests drawn with ``--seed``, in the same order, from ``--concurrency`` clients
(``httpx``, a connection per request): greedy and sampled (temperature 1, a seed, top-p, top-k,
``n`` up to 3), streaming and not, completions (token-id prompts) and chat, logprobs, stop
strings, ``max_tokens`` 1, prompts of 900-1000 tokens up to the end of the context, a
``cache_salt`` from three tenants on a third of them, clients that close a stream after a few
chunks, clients that give up on a long answer after a short timeout (a fast server may answer
some of them in full first), and bad input (vLLM must answer it with its usual 4xx).

Every greedy answer of a speculative server must have the token ids of the no-speculation
server's. A random-weight model in float32 has exact near-ties that a different batch or step
shape can flip: a divergence passes only where the no-speculation answer's top-2 logprobs at
the first differing token are within 1e-4 and the other answer took the other one
(``near_ties``). Every HTTP status is counted; no 5xx is allowed. At the end every server must
answer ``/health`` and one more greedy request. The resident memory of each server's process
group (API server, engine core, worker: the sum of their VmRSS) is sampled every
``--rss-interval`` seconds under its own load; the report gives it once 10% of the requests
have completed (warm), once half have, and after the last one (end).

Writes ``benchmarks/results/<--out>.{json,md}``; exits with status 1 if a check failed. The
plan of requests, how each is sent and the checks of its answer alone are in
``soak_requests.py``; the servers, the comparisons between them and the report are here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server import Server  # noqa: E402
from soak_requests import (  # noqa: E402
    KINDS, MAX_MODEL_LEN, MODEL, Load, Outcome, Request, build_plan, run_load,
)
from spec_bench import RESULTS, run_header  # noqa: E402


SERVER_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN)]
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
DEFAULT_SPEC = '{"method": "recycling"}'
BASELINE = "no speculation"
NEAR_TIE = 1e-4
WARM_FRACTION = 0.1

# -- the servers ---------------------------------------------------------------------------------

def spec_name(spec: dict | None) -> str:
    """A server's name in the report: "no speculation", "recycling", or the method and the keys
    that differ from ``{"method": "recycling"}`` ("recycling budget=fixed")."""
    if spec is None:
        return BASELINE
    keys = " ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}"
                    for k, v in spec.items() if k != "method")
    return f"{spec.get('method')} {keys}".strip()


# -- comparing and summing up --------------------------------------------------------------------

def compare_greedy(answer: Outcome, base: Outcome) -> tuple[str, dict | None]:
    """"identical", "near-tie" or "different", and where they part (None if identical)."""
    ids, ref = answer.choices[0]["ids"], base.choices[0]["ids"]
    if ids == ref:
        return "identical", None
    j = next((t for t, (a, b) in enumerate(zip(ref, ids, strict=False)) if a != b), min(len(ref), len(ids)))
    info = {"index": answer.index, "kind": answer.kind, "position": j,
            "token": ids[j] if j < len(ids) else None, "no_speculation": ref[j] if j < len(ref) else None}
    if j >= min(len(ref), len(ids)):
        return "different", {**info, "why": f"one answer is a prefix of the other ({len(ids)} and "
                                            f"{len(ref)} tokens)"}
    (tok1, lp1), (tok2, lp2) = base.choices[0]["top"][j][:2]
    info.update(top2=[[tok1, lp1], [tok2, lp2]], gap=lp1 - lp2)
    near = lp1 - lp2 < NEAR_TIE and ids[j] in (tok1, tok2)
    return ("near-tie" if near else "different"), info


PROCESS_ROLES = {"vllm-recycling": "API server", "VLLM::EngineCor": "engine core", "VLLM::Worker": "worker",
                 "python3": "resource tracker"}


def _mib(kib: int) -> float:
    return round(kib / 1024, 1)


def rss_summary(samples: list[tuple[float, int, dict[str, int]]], total: int) -> dict:
    """A server's RSS (MiB) when WARM_FRACTION of the ``total`` requests were done (the first
    sample from then on), when half were, at the end (the last sample) and at its highest, and
    the samples ``[seconds, requests done, MiB]``."""
    samples = [s for s in samples if s[2]]
    if not samples:
        return {}
    warm = next((s for s in samples if s[1] >= WARM_FRACTION * total), samples[-1])
    half = next((s for s in samples if s[1] >= total / 2), samples[-1])
    end = samples[-1]
    warm_kib, half_kib, end_kib = (sum(s[2].values()) for s in (warm, half, end))

    def by_process(sample):
        names = {k: k.rsplit(" ", 1)[0] for k in sample[2]}
        return {PROCESS_ROLES.get(names[k], names[k]): _mib(v) for k, v in sample[2].items()}

    return {"warm_mib": _mib(warm_kib), "end_mib": _mib(end_kib),
            "max_mib": _mib(max(sum(s[2].values()) for s in samples)),
            "growth_pct": round(100 * (end_kib - warm_kib) / warm_kib, 2), "warm_done": warm[1],
            "half_mib": _mib(half_kib), "second_half_growth_pct": round(100 * (end_kib - half_kib) / half_kib, 2),
            "warm_by_process": by_process(warm), "end_by_process": by_process(end),
            "series": [[s[0], s[1], _mib(sum(s[2].values()))] for s in samples]}


def by_kind(plan: list[Request], outcomes: list[Outcome]) -> dict:
    rows: dict[str, Counter] = {}
    for r, o in zip(plan, outcomes, strict=True):
        kind = "bad input" if r.kind.startswith("bad: ") else r.kind
        rows.setdefault(kind, Counter())["requests"] += 1
        rows[kind][o.outcome] += 1
    return {k: dict(rows[k]) for k in [*KINDS, "bad input"] if k in rows}


def server_report(server: Server, plan: list[Request], load: Load, final: Outcome, metrics: dict) -> dict:
    """One server's figures: statuses, outcomes by kind, throughput, RSS, and after the load."""
    out = load.outcomes
    tokens = sum(o.tokens for o in out if o.outcome == "ok")
    generated, accepted = metrics.get("tokens", 0.0), metrics.get("accepted", 0.0)
    statuses = Counter(str(o.status) if o.status is not None
                       else "client gave up" if o.outcome == "aborted" else "no response" for o in out)
    return {
        "speculative_config": server.spec,
        "start_s": server.start_s,
        "statuses": dict(sorted(statuses.items())),
        "5xx": sum(1 for o in out if o.status is not None and o.status >= 500),
        "outcomes": dict(Counter(o.outcome for o in out)),
        "by_kind": by_kind(plan, out),
        "seconds": round(load.seconds, 1),
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / load.seconds, 1),
        "tokens_per_step": round(generated / (generated - accepted), 3) if generated > accepted else None,
        "spec_decode": {k: int(v) for k, v in metrics.items()},
        "rss": rss_summary(load.samples, len(plan)),
        "health_after": server.health(),
        "final_request": final.outcome if final.error is None else final.error,
        "failures": [{"index": o.index, "kind": o.kind, "status": o.status, "error": o.error}
                     for o in out if o.outcome == "failed"],
    }


FINAL_REQUEST = Request(-1, "completion", "/v1/completions",
                        {"model": MODEL, "prompt": list(range(10, 42)), "max_tokens": 32, "temperature": 0,
                         "ignore_eos": True, "logprobs": 2, "return_tokens_as_token_ids": True,
                         "return_token_ids": True})


def run_soak(requests: int = 1000, concurrency: int = 8, specs: list[dict] | None = None, seed: int = 0,
             rss_interval: float = 2.0, log_dir: Path | None = None, say=print) -> dict:
    """Starts a server per speculative config in ``specs`` (default: the default config) and
    one without speculation side by side, sends each the plan in turn, and returns the report
    (``problems`` lists what failed)."""
    specs = [json.loads(DEFAULT_SPEC)] if specs is None else specs
    log_dir = Path(tempfile.mkdtemp(prefix="soak_")) if log_dir is None else log_dir
    plan = build_plan(requests, seed)
    servers: dict[str, Server] = {}
    for spec in [*specs, None]:
        name = spec_name(spec)
        if name in servers:
            raise ValueError(f"the speculative config {spec} is given twice")
        servers[name] = Server(MODEL, SERVER_ARGS, spec,
                               log_dir / f"{name.replace(' ', '_').replace('/', '_')}.log", SERVER_ENV)
    load_average = [round(x, 2) for x in os.getloadavg()]  # other work on the machine skews the timings
    start = time.monotonic()
    loads, finals, reports = {}, {}, {}
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_ready()
        say("servers up in " + ", ".join(f"{s.start_s} s ({name})" for name, s in servers.items())
            + f"; logs in {log_dir}", flush=True)
        for name, server in servers.items():
            counts = Counter()

            def tick(out: Outcome, name=name, counts=counts) -> None:
                counts[out.outcome] += 1
                done = sum(counts.values())
                if done % max(1, len(plan) // 10) == 0 or done == len(plan):
                    say(f"  {name}: {done}/{len(plan)} {dict(counts)}", flush=True)

            loads[name] = asyncio.run(run_load(server.url, plan, concurrency, server.rss_kib, rss_interval, tick))
        for name, server in servers.items():  # after every load: each server idled through the others'
            finals[name] = asyncio.run(run_load(server.url, [FINAL_REQUEST], 1)).outcomes[0]
            try:
                metrics = server.metrics()
            except OSError:  # a server that died under the load still gets its report
                metrics = {}
            reports[name] = server_report(server, plan, loads[name], finals[name], metrics)
    finally:
        for server in servers.values():
            server.stop()

    base = loads[BASELINE].outcomes
    greedy = {}
    for name in servers:
        if name == BASELINE:
            continue
        counts, divergences = Counter(), []
        for request, out, ref in zip(plan, loads[name].outcomes, base, strict=True):
            if not request.greedy:
                continue
            if out.outcome != "ok" or ref.outcome != "ok":
                counts["not compared"] += 1
                continue
            verdict, info = compare_greedy(out, ref)
            counts[verdict] += 1
            if info:
                divergences.append({**info, "verdict": verdict})
        final = "not compared"
        if finals[name].outcome == finals[BASELINE].outcome == "ok":
            final = compare_greedy(finals[name], finals[BASELINE])[0]
        greedy[name] = {"compared": counts["identical"] + counts["near-tie"] + counts["different"],
                        "identical": counts["identical"], "near_ties": counts["near-tie"],
                        "different": counts["different"], "not_compared": counts["not compared"],
                        "final_request": final, "divergences": divergences}
    bad_input = {}
    for i, request in enumerate(plan):
        if request.kind.startswith("bad: "):
            entry = bad_input.setdefault(request.kind[len("bad: "):], {
                "expected": request.expect_status, "answers": {name: [] for name in servers}})
            for name in servers:
                entry["answers"][name].append(loads[name].outcomes[i].status)
    return {
        "requests": len(plan),
        "concurrency": concurrency,
        "seed": seed,
        "plan": {k: v["requests"] for k, v in by_kind(plan, base).items()},
        "servers": reports,
        "greedy": greedy,
        "bad_input": bad_input,
        "rss_interval_s": rss_interval,
        "load_average_at_start": load_average,
        "wall_s": round(time.monotonic() - start, 1),
    }


def problems(report: dict) -> list[str]:
    """Every check of the soak that failed; empty when all passed."""
    found = []
    for name, r in report["servers"].items():
        if r["5xx"]:
            found.append(f"{name}: {r['5xx']} responses with a 5xx status")
        failures = r["failures"]
        found += [f"{name}: request {f['index']} ({f['kind']}) failed: {f['error']}" for f in failures[:10]]
        if len(failures) > 10:
            found.append(f"{name}: {len(failures) - 10} more requests failed")
        if sum(r["outcomes"].values()) != report["requests"]:
            found.append(f"{name}: {sum(r['outcomes'].values())} outcomes for {report['requests']} requests")
        if r["health_after"] != 200 or r["final_request"] != "ok":
            found.append(f"{name} after the load: /health {r['health_after']}, "
                         f"final request {r['final_request']}")
    for bad, entry in report["bad_input"].items():
        for name, statuses in entry["answers"].items():
            if any(s != entry["expected"] for s in statuses):
                found.append(f"bad input {bad!r}: {name} answered {statuses}, expected {entry['expected']}")
    for name, g in report["greedy"].items():
        if g["different"]:
            found.append(f"{name}: {g['different']} greedy answers differ from those without speculation")
        if g["not_compared"]:
            found.append(f"{name}: {g['not_compared']} greedy requests could not be compared")
        if g["final_request"] not in ("identical", "near-tie"):
            found.append(f"{name}: the greedy request after the load: {g['final_request']}")
    return found


# -- the report ----------------------------------------------------------------------------------

def tables(report: dict) -> str:
    """Requests by kind, HTTP statuses, greedy identity, throughput and RSS, in markdown."""
    servers = report["servers"]
    names = list(servers)
    columns = ("ok", "rejected", "disconnected", "aborted", "failed")
    lines = ["| kind | requests | ok | rejected (4xx) | disconnected | aborted | failed |",
             "|---|---|---|---|---|---|---|"]
    for kind, n in report["plan"].items():
        cells = [" / ".join(str(servers[s]["by_kind"].get(kind, {}).get(c, 0)) for s in names) for c in columns]
        lines.append(f"| {kind} | {n} | " + " | ".join(cells) + " |")
    statuses = sorted({s for r in servers.values() for s in r["statuses"]})
    lines += ["", "| HTTP status | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for s in statuses:
        lines.append(f"| {s} | " + " | ".join(str(servers[n]["statuses"].get(s, 0)) for n in names) + " |")
    lines += ["", "| greedy answers against no speculation | compared | identical | near-tie | different |",
              "|---|---|---|---|---|"]
    for name, g in report["greedy"].items():
        lines.append(f"| {name} | {g['compared']} | {g['identical']} | {g['near_ties']} | {g['different']} |")
    lines += ["", ("| server | wall s | output tokens | tokens/s | tokens per step | RSS warm MiB | "
                   "RSS end MiB | growth | growth over the 2nd half | RSS max MiB |"),
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in servers.items():
        m, tps = r["rss"], r["tokens_per_step"]
        lines.append(f"| {name} | {r['seconds']} | {r['output_tokens']} | {r['tokens_per_s']} | "
                     f"{'-' if tps is None else f'{tps:.2f}'} | {m.get('warm_mib')} | {m.get('end_mib')} | "
                     f"{m.get('growth_pct', 0):+.2f}% | {m.get('second_half_growth_pct', 0):+.2f}% | "
                     f"{m.get('max_mib')} |")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    found, servers = report["problems"], report["servers"]
    names = list(servers)
    configs = "; ".join(f"{name}: `--speculative-config '{json.dumps(r['speculative_config'])}'`"
                        for name, r in servers.items() if r["speculative_config"] is not None)
    setup = (f"{report['date']}; {report['machine']}; LD_PRELOAD {report['ld_preload']}; vLLM "
             f"{report['vllm']}; {report['model']}; every server `{' '.join(report['server_args'])}` with "
             f"`VLLM_CPU_KVCACHE_SPACE=1`; {configs}. {report['requests']} requests (seed {report['seed']}) "
             f"at concurrency {report['concurrency']} to each server in turn. Command: `{report['command']}`. "
             f"{report['wall_s']} s in all; the servers, started side by side, were up in "
             + ", ".join(f"{r['start_s']} s" for r in servers.values())
             + f". Load average when it started: {' / '.join(map(str, report['load_average_at_start']))}.")
    counters = "Spec-decode counters: " + "; ".join(
        f"{name}: {r['spec_decode'].get('drafts', 0)} drafts, {r['spec_decode'].get('draft_tokens', 0)} "
        f"draft tokens, {r['spec_decode'].get('accepted', 0)} accepted"
        for name, r in servers.items() if r["speculative_config"] is not None) + "."
    memory = (f"Output tokens: those of the requests answered in full. RSS: the sum of VmRSS over the "
              f"server's process group, sampled every {report['rss_interval_s']} s under its own load; "
              f"warm: the first sample once {int(100 * WARM_FRACTION)}% of the requests were done. Warm -> "
              f"end MiB by process: " + "; ".join(
                  f"{name}: " + ", ".join(f"{k} {v} -> {r['rss']['end_by_process'].get(k)}"
                                          for k, v in r["rss"].get("warm_by_process", {}).items())
                  for name, r in servers.items() if r["rss"]) + ".")
    bad = "Bad input, and the status expected from every server: " + "; ".join(
        f"{name}: {entry['expected']}" for name, entry in report["bad_input"].items()) + "."
    after = "After the loads, /health and one more greedy request: " + "; ".join(
        f"{name}: {r['health_after']}, {r['final_request']}"
        + (f" ({report['greedy'][name]['final_request']})" if name in report["greedy"] else "")
        for name, r in servers.items()) + "."
    verdict = ("**All checks passed.**" if not found
               else "**Failed checks:**\n\n" + "\n".join(f"- {p}" for p in found))
    lines = ["# Soak: vLLM's OpenAI server with Token Recycling", "", setup, "",
             f"Requests by kind ({' / '.join(names)}):", "", tables(report), "",
             counters, "", memory, "", bad, "", after, "", verdict]
    divergences = [(name, d) for name, g in report["greedy"].items() for d in g["divergences"]]
    if divergences:
        lines += ["", ("Greedy divergences (at the first differing token; gap: the top-2 logprob gap "
                       "without speculation there):"), ""]
        lines += [f"- {name}, request {d['index']} ({d['kind']}), {d['verdict']} at token "
                  f"{d['position']}: {d['token']}, no speculation {d['no_speculation']}"
                  + (f", gap {d['gap']:.3g}" if "gap" in d else f"; {d['why']}") for name, d in divergences]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--spec", action="append",
                        help=f"a speculative server's --speculative-config (JSON); repeat for more "
                             f"servers (default: one, {DEFAULT_SPEC})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-interval", type=float, default=2.0, help="seconds between RSS samples")
    parser.add_argument("--out", default="soak_cpu", help="results name: benchmarks/results/<out>.{json,md}")
    args = parser.parse_args(argv)
    specs = []
    for text in args.spec or [DEFAULT_SPEC]:
        try:
            specs.append(json.loads(text))
        except json.JSONDecodeError as e:
            parser.error(f"--spec is not valid JSON: {e}")
        if not isinstance(specs[-1], dict):
            parser.error(f"--spec must be a JSON object: {text}")
    from vllm_recycling.tools.models import prepare_model

    prepare_model(MODEL)  # once, before the servers start
    report = {**run_header("soak.py", MODEL), "server_args": SERVER_ARGS,
              **run_soak(args.requests, args.concurrency, specs, args.seed, args.rss_interval)}
    report["problems"] = problems(report)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(markdown(report))
    print("\n" + markdown(report))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
