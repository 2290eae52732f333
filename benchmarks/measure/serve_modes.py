"""`edgespec serve`'s ways of running several clients, measured alternately in one run (issue 42, history.md §68).

    python benchmarks/measure/serve_modes.py [--modes batch,apart,alone,interleave] [--rounds 2]
        [--clients 1,4,16] [--max-tokens 64] [--requests 16] [--json FILE]

Modes: `batch` and `alone` serve the default recipe exported with a slots graph of `--slots` conversations
(benchmarks/measure/slot_passes.py), the generations in flight sharing their target passes, each greedy
step's tree priced against the whole shared pass (`--shared-speculation batch`) or as if alone (`alone`,
§65's server, serve's default); `apart` as `alone` with a prompt's prefill chunks back to back, alone
(`--shared-prefill apart`); `interleave` serves the default bundle, the generations taking passes in turn
(§62). Each round starts every mode's server once (the order reversed every other round, so that a drift of the
machine's load falls on each mode alike) and runs serve_load.py's levels against it: the same prompts,
streamed, greedy, Retry-After honoured, the one-client level's answers the ones every other level must
repeat. On a machine others share, only ratios within a round count: it prints, per round, each mode's
tokens/s at each level over its own one-client level's, and each mode's over `alone`'s at the same level.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from serve_load import (
    SETS,
    Server,
    built,
    built_with_slots,
    free_port,
    measure,
    print_report,
    workload_prompts,
)

MODEL = "bench"


def command(mode: str, bundle: str, port: int, threads: int) -> list[str]:
    extra = {"interleave": [], "apart": ["--shared-speculation", "alone", "--shared-prefill", "apart"]}.get(
        mode, ["--shared-speculation", mode])
    return [sys.executable, "-m", "edgespec.cli", "serve", bundle, "--port", str(port), "--threads", str(threads),
            "--model-name", MODEL, *extra]


def summary(rounds: list[dict[str, dict]], modes: list[str]) -> list[str]:
    """Per round and mode: tokens/s and p95 TTFT per level, the ratio over the mode's own one client, and
    over `alone`'s at the same level."""
    lines = []
    for i, reports in enumerate(rounds):
        for mode in modes:
            load = reports[mode]["load"]
            one = load[0]["tokens_per_s"]
            for row in load:
                versus = ""
                if "alone" in reports and mode != "alone":
                    theirs = next(r for r in reports["alone"]["load"] if r["clients"] == row["clients"])
                    versus = f"  over alone {row['tokens_per_s'] / theirs['tokens_per_s']:.2f}x"
                lines.append(f"round {i + 1} {mode:10s} {row['clients']:2d} clients: {row['tokens_per_s']:7.2f} "
                             f"tokens/s ({row['tokens_per_s'] / one:.2f}x its one client){versus}; TTFT p95 "
                             f"{row['ttft_p95_s']:.2f} s; lost {row['lost']}, truncated {row['truncated']}, "
                             f"differ {row.get('differ_from_alone', '-')}, codes {row['codes']}")
    for mode in modes:
        for level, _ in enumerate(rounds[0][mode]["load"]):
            rows = [r[mode]["load"][level] for r in rounds]
            over_one = [row["tokens_per_s"] / r[mode]["load"][0]["tokens_per_s"] for row, r in zip(rows, rounds)]
            lines.append(f"median {mode:10s} {rows[0]['clients']:2d} clients: "
                         f"{statistics.median(row['tokens_per_s'] for row in rows):7.2f} tokens/s, "
                         f"{statistics.median(over_one):.2f}x its one client, TTFT p95 "
                         f"{statistics.median(row['ttft_p95_s'] for row in rows):.2f} s")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="batch,alone,interleave")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--clients", default="1,4,16", help="concurrent clients per level; the first must be 1")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--json", default=None, help="also write every report here")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= {"batch", "apart", "alone", "interleave"} or args.rounds < 1:
        raise SystemExit("--modes: batch, apart, alone, interleave; --rounds >= 1")
    levels = [int(c) for c in args.clients.split(",")]
    if levels[0] != 1:
        raise SystemExit("--clients must start with 1: the answers alone are what the others are held to")
    prompts = workload_prompts(list(SETS), args.requests)
    bundles = {"interleave": built("default") if "interleave" in modes else None,
               "slots": built_with_slots(args.slots) if set(modes) - {"interleave"} else None}
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="serve_modes_") as logs:
        for i in range(args.rounds):
            reports = {}
            for mode in (modes if i % 2 == 0 else modes[::-1]):
                bundle = bundles["interleave" if mode == "interleave" else "slots"]
                port = free_port()
                server = Server(f"{mode}-{i}", command(mode, bundle, port, args.threads), port, Path(logs))
                try:
                    reports[mode] = measure(server, MODEL, prompts, levels, args.max_tokens, False)
                finally:
                    server.stop()
                print_report(reports[mode])
                sys.stdout.flush()
            rounds.append(reports)
    print()
    print("\n".join(summary(rounds, modes)))
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
