"""What benchmarks/measure/peers.py prints and records: each system's runs summarized, its ratios to its own
plain decoding and to each peer's faster mode, whether outputs match, and the means over the sets. `systems`
are peers.py's System rows (name, kind, folder, plain)."""
from __future__ import annotations

import math
import statistics

PRECISIONS = ("int4", "int8")
LLAMA_CPP = "llama.cpp Q4_1"


def summarize(runs: list[dict]) -> dict:
    results = [r for run in runs for r in run["results"]]
    decoded = sum(max(0, len(r["tokens"]) - 1) for r in results)
    passes = sum(r["passes"] or 0 for r in results)
    by_round = [sum(max(0, len(r["tokens"]) - 1) for r in run["results"]) / sum(r["decode_s"] for r in run["results"])
                for run in runs]
    return {"tokens_per_s": decoded / sum(r["decode_s"] for r in results),
            "tokens_per_s_by_round": by_round, "tokens_per_s_median_round": statistics.median(by_round),
            "ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in results),
            "peak_rss_mb": max(run["peak_rss_mb"] for run in runs),
            "tokens_per_pass": decoded / passes if passes else None,
            "outputs": [r["tokens"] for r in runs[0]["results"]],
            **({"template_agrees": runs[0]["template_agrees"]} if "template_agrees" in runs[0] else {})}


def genai_name(precision: str, ngram: bool) -> str:
    return f"onnxruntime-genai {precision}" + (" n-gram 3/10" if ngram else "")


def shown(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def geomean(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def llama_name(ngram: bool) -> str:
    return LLAMA_CPP + (" ngram-simple 3/10" if ngram else "")


def add_ratios(table: dict, systems: list) -> None:
    """Each row's ratios to its own plain decoding and to each genai precision's (and llama.cpp's) faster mode;
    identical."""
    best = {p: max(table[genai_name(p, ngram)]["tokens_per_s"] for ngram in (False, True)) for p in PRECISIONS}
    llama = [table[name]["tokens_per_s"] for name in (llama_name(False), llama_name(True)) if name in table]
    for s in systems:
        row = table[s.name]
        row["x_own_plain"] = row["tokens_per_s"] / table[s.plain]["tokens_per_s"] if s.plain else 1.0
        row.update({f"x_genai_{p}": row["tokens_per_s"] / best[p] for p in PRECISIONS})
        # plain against plain: each system's speed over genai's greedy decoding at each precision
        row.update({f"x_genai_{p}_greedy": row["tokens_per_s"] / table[genai_name(p, False)]["tokens_per_s"]
                    for p in PRECISIONS})
        if llama:
            row["x_llama_cpp"] = row["tokens_per_s"] / max(llama)
        row["identical_to_plain"] = row["outputs"] == table[s.plain]["outputs"] if s.plain else None


def plain_ratios(table: dict, systems: list) -> dict:
    """Plain against plain: each bundle's plain decoding over genai's greedy (int4, int8) and over every other
    bundle's plain decoding (the default's exact grid against the symmetric int4 bundle, issue 56)."""
    plain = [s.name for s in systems if s.kind == "plain"]
    return {name: {**{f"genai {p} greedy": table[name][f"x_genai_{p}_greedy"] for p in PRECISIONS},
                   **{other: table[name]["tokens_per_s"] / table[other]["tokens_per_s"] for other in plain
                      if other != name}} for name in plain}


def greedy_agreement(table: dict, systems: list) -> dict:
    """On how many prompts each bundle's plain output equals each peer's greedy output."""
    def same(a: list, b: list) -> str:
        return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"
    peers = [s.name for s in systems if s.kind in ("genai", "openvino", "llama-cpp")]
    return {s.name: {p: same(table[s.name]["outputs"], table[p]["outputs"]) for p in peers}
            for s in systems if s.kind == "plain"}


def print_table(table: dict, systems: list) -> None:
    llama = any(s.kind.startswith("llama-cpp") for s in systems)
    print(f"{'system':44s} {'tokens/s':>8s} {'x plain':>7s} {'x g-int4':>8s} {'x g-int8':>8s} "
          + (f"{'x llama':>7s} " if llama else "") + f"{'TTFT ms':>8s} {'RSS MB':>6s} {'tok/pass':>8s}  identical")
    for s in systems:
        row = table[s.name]
        print(f"{s.name:44s} {row['tokens_per_s']:8.1f} {shown(row['x_own_plain'] if s.plain else None, '.2f'):>7s} "
              f"{row['x_genai_int4']:8.2f} {row['x_genai_int8']:8.2f} "
              + (f"{shown(row.get('x_llama_cpp'), '.2f'):>7s} " if llama else "")
              + f"{row['ttft_ms']:8.1f} {row['peak_rss_mb']:6.0f} "
              f"{shown(row['tokens_per_pass'], '.2f'):>8s}  {shown(row['identical_to_plain'], '')}")


def over_sets(report: dict, systems: list) -> dict:
    rows = {s.name: [sets[s.name] for sets in report.values()] for s in systems}
    means = ("tokens_per_s", "x_own_plain", "x_genai_int4", "x_genai_int8", "x_genai_int4_greedy",
             "x_genai_int8_greedy", "x_llama_cpp", "ttft_ms", "tokens_per_pass")
    return {name: {**{k: geomean(r.get(k) for r in rs) for k in means},
                   "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
                   "identical_to_plain": None if rs[0]["identical_to_plain"] is None else
                   all(r["identical_to_plain"] for r in rs)} for name, rs in rows.items()}
