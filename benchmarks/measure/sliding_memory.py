"""Long generation under the `sliding` KV policy: resident memory sampled while it runs.

    python benchmarks/measure/sliding_memory.py [BUNDLE] [--tokens 8000] [--memory-budget SIZE] [--no-speculate]

Prints RSS every 4,000 characters of text (sampled by a thread every 0.2 s from /proc/self/statm), the peak, the
planned budget split, and the start and end of the text so a reader can judge its coherence.
"""
import argparse
import os
import threading
import time

from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline

from edgespec.defaults import resolve_bundle


class RssSampler(threading.Thread):
    def __init__(self, every_s: float = 0.2):
        super().__init__(daemon=True)
        self.every_s, self.samples, self.running = every_s, [], True
        self.page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def run(self):
        while self.running:
            self.samples.append((time.perf_counter(), self.rss()))
            time.sleep(self.every_s)


parser = argparse.ArgumentParser()
parser.add_argument("bundle", nargs="?", default="default")
parser.add_argument("--tokens", type=int, default=8000)
parser.add_argument("--memory-budget", default=None)
parser.add_argument("--no-speculate", action="store_true")
parser.add_argument("--threads", type=int, default=None)
args = parser.parse_args()

folder = resolve_bundle(args.bundle)
if args.bundle == "default":  # building it in this process would leave the exporter's memory in the figures
    raise SystemExit(f"give the bundle's folder ({folder}), so that this process only decodes")
pipeline = Pipeline(folder, args.threads, args.memory_budget)
print(pipeline.memory.describe())
sampler = RssSampler()
sampler.start()
marks = []
count = 0


def on_text(piece: str) -> None:
    global count
    before, count = count, count + len(piece)
    if count // 4000 > before // 4000:
        marks.append((count, sampler.rss()))
        print(f"{count:6d} characters  RSS {sampler.rss() / 2**20:7.1f} MiB", flush=True)


config = GenerationConfig(max_new_tokens=args.tokens, stop_at_eos=False, kv_policy="sliding")
started = time.perf_counter()
result = pipeline.generate(messages=[{"role": "user", "content": "Tell me a long story about a lighthouse keeper "
                                       "and the ships she guides, chapter by chapter."}],
                           config=config, speculate=not args.no_speculate, on_text=on_text)
sampler.running = False
peak = max(r for _, r in sampler.samples)
print(f"{len(result.token_ids)} tokens in {time.perf_counter() - started:.0f}s "
      f"({result.stats.tokens_per_s:.1f} tokens/s, {result.stats.mean_accepted_per_pass:.2f} per pass), "
      f"stop: {result.stop_reason}")
print(f"peak RSS {peak / 2**20:.1f} MiB; planned total {pipeline.memory.total / 2**20:.1f} MiB")
if len(marks) >= 3:
    print(f"RSS after warm-up (4,000 characters) {marks[0][1] / 2**20:.1f} MiB, at the end {marks[-1][1] / 2**20:.1f} MiB")
print("--- start ---\n" + result.text[:600] + "\n--- end ---\n" + result.text[-600:])
