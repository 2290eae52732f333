"""`edgespec serve` under load and under abuse, as clients see it (issue 42, item 5).

    python benchmarks/measure/serve_load.py [BUNDLE] [--max-tokens 64] [--clients 1,4,16] [--requests 16]
        [--llama-server PATH --gguf FILE] [--users] [--json FILE]

Starts `edgespec serve` (the default bundle, or BUNDLE) as a process of its own on a free port, with its
default queue. Load: the same `--requests` prompts (benchmarks/workloads/*.jsonl, one set after another, so
that no two clients share a prompt) at each number of concurrent streamed clients, each client sending its
share one after another, greedy, honouring Retry-After on 429; the one-client run is every prompt's answer
alone, which the concurrent runs must repeat byte for byte. Reported per level: aggregate generated
tokens/s (wall clock), p50/p95 time to first token and latency, every status received, lost answers (no
200) and truncated ones (no [DONE] or finish reason, or fewer tokens than a "length" finish), answers that
differ from the prompt's answer alone, p95 of time to first token over the same prompt's alone, the
server's CPU time per generated token (all its threads), and the server's peak RSS. `--users`: each client
sends a `user` of its own, so the server keeps each one's conversation. Abuse: a 50 MB body, JSON nested 10,000 levels and a 5,000-digit max_tokens, each
answered with a 4xx in under a second while /health keeps answering, RSS back within 10% of its baseline.

With --slots S it first serves the default recipe exported again with a slots graph of S conversations
per pass (benchmarks/measure/slot_passes.py; the server shares the passes of the generations in flight), then the
bundle as given, so that the two are compared within one run (history.md §65).

With --llama-server and --gguf it runs the same after against llama.cpp's `llama-server --parallel 4` on
that GGUF (its context split over the 4 slots, each as large as edgespec's default), its prompt cache off:
the levels send the same prompts, and edgespec's anonymous requests reuse nothing either.
"""
from __future__ import annotations

import argparse
import json
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from serve_client import Answer, Watch, cpu_seconds, peak_rss_bytes, rss_bytes, send_raw, stream_chat

HOST = "127.0.0.1"
WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"
SETS = ("chat", "rag", "code_edit", "agent", "extraction", "summary", "multiturn")
SLOT_CONTEXT = 2048  # edgespec's default context: each llama-server slot gets as much
ABUSE_S = 1.0  # the bound on answering an abusive request
RSS_SLACK = 1.10  # RSS after an abusive request, at most this times its baseline
SETTLE_S = 1.0  # after an abusive request, before its RSS is read


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def workload_prompts(sets: list[str], count: int) -> list[list[dict]]:
    """`count` conversations, the sets' first prompts in turn, then their second ones, and so on."""
    per_set = [[json.loads(line)["messages"] for line in (WORKLOADS / f"{name}.jsonl").read_text().splitlines()
                if line.strip()] for name in sets]
    interleaved = [prompts[i] for i in range(max(map(len, per_set))) for prompts in per_set if i < len(prompts)]
    if count > len(interleaved):
        raise SystemExit(f"--requests {count}: the sets {','.join(sets)} hold {len(interleaved)} prompts")
    return interleaved[:count]


class Server:
    """A server process, its log in a file, up once /health answers 200."""

    def __init__(self, name: str, command: list[str], port: int, log_dir: Path):
        self.name, self.command, self.port = name, command, port
        self.log_path = log_dir / f"{name}.log"
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 900  # the default bundle may be built on first use
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"{name} exited: {self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise SystemExit(f"{name} did not come up in 15 minutes: {self.log_path}")

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))] if ordered else float("nan")


def run_level(server: Server, model: str, prompts: list[list[dict]], clients: int, max_tokens: int,
              alone: dict[int, Answer] | None, users: bool = False) -> tuple[dict, dict[int, Answer]]:
    """Every prompt once, over `clients` concurrent clients (client i sends prompts i, i + clients, ...);
    `users`: each client sends a `user` of its own."""
    answers: dict[int, Answer] = {}
    lock = threading.Lock()

    def client(i: int) -> None:
        for k in range(i, len(prompts), clients):
            answer = stream_chat(HOST, server.port, prompts[k], max_tokens, model,
                                 user=f"client-{clients}-{i}" if users else None)
            with lock:
                answers[k] = answer

    cpu_before = cpu_seconds(server.pid)
    with Watch(HOST, server.port, server.pid, every_s=0.25) as watch:
        started = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
    cpu_after = cpu_seconds(server.pid)
    done = [a for a in answers.values() if a.status == 200]
    ttft = [a.ttft_s for a in done if a.ttft_s is not None]
    codes: dict[str, int] = {}
    for a in answers.values():
        for code in a.codes or ["no answer"]:
            codes[str(code)] = codes.get(str(code), 0) + 1
    row = {"clients": clients, "requests": len(prompts), "wall_s": round(wall, 2),
           "tokens_per_s": round(sum(a.tokens for a in done) / wall, 2),
           # the server's CPU time (every thread) per generated token: what a level cost, whatever the load beside it
           "cpu_ms_per_token": round(1000 * (cpu_after - cpu_before) / max(1, sum(a.tokens for a in done)), 2)
           if cpu_before is not None and cpu_after is not None else None,
           "ttft_p50_s": round(percentile(ttft, 0.5), 3), "ttft_p95_s": round(percentile(ttft, 0.95), 3),
           "latency_p50_s": round(percentile([a.latency_s for a in done], 0.5), 3),
           "latency_p95_s": round(percentile([a.latency_s for a in done], 0.95), 3),
           "codes": codes, "lost": sum(a.status != 200 for a in answers.values()),
           "truncated": sum(a.status == 200 and not a.complete(max_tokens) for a in answers.values()),
           "errors": sorted({a.error for a in answers.values() if a.error})[:3],
           "peak_rss_mb": round(watch.peak_rss / 2**20, 1), "health_failed": watch.health_failed}
    if alone is not None:
        row["differ_from_alone"] = sum(a.text != alone[k].text for k, a in answers.items() if k in alone)
        ratios = [a.ttft_s / alone[k].ttft_s for k, a in answers.items()
                  if a.ttft_s is not None and k in alone and alone[k].ttft_s]
        row["ttft_over_alone_p95"] = round(percentile(ratios, 0.95), 2)
    return row, answers


def abuse_bodies(model: str) -> dict[str, bytes]:
    message = [{"role": "user", "content": "hello"}]
    fifty_mb = json.dumps({"model": model, "messages": [{"role": "user", "content": "a " * (25 * 10**6)}]})
    name = json.dumps(model)
    deep = f'{{"model": {name}, "messages": {"[" * 10_000}{"]" * 10_000}}}'
    digits = f'{{"model": {name}, "messages": {json.dumps(message)}, "max_tokens": {"9" * 5_000}}}'
    return {"50 MB body": fifty_mb.encode(), "JSON 10,000 levels deep": deep.encode(),
            "max_tokens of 5,000 digits": digits.encode()}


def abuse_checks(server: Server, model: str) -> list[dict]:
    """Each abusive request alone, /health polled throughout, RSS read before and after it settles."""
    rows = []
    for name, body in abuse_bodies(model).items():
        baseline = rss_bytes(server.pid)
        with Watch(HOST, server.port, server.pid, every_s=0.05) as watch:
            try:
                status, took = send_raw(HOST, server.port, "/v1/chat/completions", body)
            except ConnectionError as err:
                status, took = None, float("nan")
                print(f"{server.name}, {name}: {err}", file=sys.stderr)
            time.sleep(SETTLE_S)
        after = rss_bytes(server.pid)
        rows.append({"check": name, "bytes": len(body), "status": status, "answer_s": round(took, 3),
                     "health_checks": watch.health_checks, "health_failed": watch.health_failed,
                     "slowest_health_s": round(watch.slowest_health_s, 3),
                     "rss_before_mb": round(baseline / 2**20, 1), "rss_peak_mb": round(watch.peak_rss / 2**20, 1),
                     "rss_after_mb": round(after / 2**20, 1),
                     "ok": status is not None and 400 <= status < 500 and took < ABUSE_S
                     and watch.health_failed == 0 and after <= RSS_SLACK * baseline})
    return rows


def measure(server: Server, model: str, prompts: list[list[dict]], levels: list[int], max_tokens: int,
            abuse: bool, users: bool = False) -> dict:
    stream_chat(HOST, server.port, [{"role": "user", "content": "Say hi."}], 8, model)  # warm up
    report = {"server": server.name, "command": shlex.join(server.command)}
    report["abuse"] = abuse_checks(server, model) if abuse else []
    report["load"], alone = [], None
    for clients in levels:
        row, answers = run_level(server, model, prompts, clients, max_tokens, alone, users)
        report["load"].append(row)
        alone = alone if alone is not None or clients != 1 else answers
    report["peak_rss_mb"] = round((peak_rss_bytes(server.pid) or 0) / 2**20, 1)
    return report


def print_report(report: dict) -> None:
    print(f"\n{report['server']}: {report['command']}")
    print("clients  tokens/s  CPU ms/token  TTFT p50/p95 s  latency p50/p95 s  lost  trunc  differ  TTFT/alone p95  "
          "peak RSS MB  codes")
    for r in report["load"]:
        print(f"{r['clients']:7d}  {r['tokens_per_s']:8.2f}  {r.get('cpu_ms_per_token') or float('nan'):12.2f}  "
              f"{r['ttft_p50_s']:6.2f} / {r['ttft_p95_s']:5.2f}  "
              f"{r['latency_p50_s']:7.2f} / {r['latency_p95_s']:6.2f}  {r['lost']:4d}  {r['truncated']:5d}  "
              f"{r.get('differ_from_alone', '-')!s:>6}  {r.get('ttft_over_alone_p95', '-')!s:>14}  "
              f"{r['peak_rss_mb']:11.1f}  {r['codes']}")
        for error in r["errors"]:
            print(f"         error: {error}")
    for a in report["abuse"]:
        print(f"{a['check']}: {a['status']} in {a['answer_s']} s; /health {a['health_checks'] - a['health_failed']}"
              f"/{a['health_checks']} answered (slowest {a['slowest_health_s']} s); RSS {a['rss_before_mb']} -> "
              f"peak {a['rss_peak_mb']} -> {a['rss_after_mb']} MB: {'ok' if a['ok'] else 'FAILED'}")
    print(f"peak RSS of the server process (VmHWM): {report['peak_rss_mb']} MB")


def built(bundle: str) -> str:
    """The bundle's folder, the default one built first in a process of its own: the server's peak RSS is
    then serving's, not the export's."""
    if bundle != "default":
        return bundle
    code = "from edgespec.defaults import resolve_bundle; print(resolve_bundle('default'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def built_with_slots(slots: int) -> str:
    """The default bundle's recipe with a slots graph (benchmarks/measure/slot_passes.py), built in a process of
    its own."""
    code = f"from slot_passes import slots_bundle; print(slots_bundle({int(slots)}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parent)
    return done.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", nargs="?", default="default")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--clients", default="1,4,16", help="concurrent clients per level; the first must be 1")
    parser.add_argument("--requests", type=int, default=16, help="prompts per level (each level sends them all)")
    parser.add_argument("--sets", default=",".join(SETS), help="workload sets the prompts come from")
    parser.add_argument("--no-abuse", action="store_true", help="leave out the abusive requests")
    parser.add_argument("--no-edgespec", action="store_true", help="measure llama-server alone")
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    parser.add_argument("--gguf", default=None, help="the GGUF llama-server loads (the default's: Q4_1)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="passed on to edgespec serve, e.g. --serve-arg=--max-body=64MiB (repeatable)")
    parser.add_argument("--slots", type=int, default=0,
                        help="first serve the default recipe exported with a slots graph of this many conversations "
                             "per pass (shared passes, history.md §65), then the bundle as given, in the same run")
    parser.add_argument("--users", action="store_true",
                        help="each client sends a `user` of its own (the server keeps each one's conversation)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    if levels[0] != 1:
        raise SystemExit("--clients must start with 1: the answers alone are what the others are held to")
    if bool(args.llama_server) != bool(args.gguf):
        raise SystemExit("--llama-server and --gguf go together")
    prompts = workload_prompts(args.sets.split(","), args.requests)
    model = "bench"
    commands = []
    if args.slots and not args.no_edgespec:
        port = free_port()
        commands.append((f"edgespec, {args.slots} slots", port,
                         [sys.executable, "-m", "edgespec.cli", "serve", built_with_slots(args.slots), "--port", str(port),
                          "--threads", str(args.threads), "--model-name", model, *args.serve_arg]))
    if not args.no_edgespec:
        port = free_port()
        bundle = built(args.bundle)
        commands.append(("edgespec", port, [sys.executable, "-m", "edgespec.cli", "serve", bundle, "--port",
                                            str(port), "--threads", str(args.threads), "--model-name", model, *args.serve_arg]))
    if args.llama_server:
        port = free_port()
        commands.append(("llama-server", port, [args.llama_server, "-m", args.gguf, "--parallel", "4", "--host", HOST,
                                                "--port", str(port), "-t", str(args.threads),
                                                "-c", str(4 * SLOT_CONTEXT), "--alias", model,
                                                # as edgespec's requests that are no one's: nothing reused
                                                # across requests (each level sends the same prompts again)
                                                "--no-cache-prompt", "--cache-ram", "0"]))
    reports = []
    with tempfile.TemporaryDirectory(prefix="serve_load_") as logs:
        for name, port, command in commands:
            server = Server(name, command, port, Path(logs))
            try:
                reports.append(measure(server, model, prompts, levels, args.max_tokens, not args.no_abuse,
                                       args.users))
            finally:
                server.stop()
    for report in reports:
        print_report(report)
    if len(reports) == 2:
        for ours, theirs in zip(reports[0]["load"], reports[1]["load"]):
            print(f"{ours['clients']} clients: {reports[0]['server']} / {reports[1]['server']} tokens/s "
                  f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "reports": reports}, indent=2))


if __name__ == "__main__":
    main()
