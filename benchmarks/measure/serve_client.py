"""The client side of benchmarks/measure/serve_load.py, in the standard library alone so that it speaks to any
OpenAI-compatible server the same way (edgespec serve, llama.cpp's llama-server): a streamed chat request
that honours Retry-After, a body sent piece by piece that stops when the server answers early, the
server process's memory (resident now, and its peak), and /health polled while something else runs.
"""
from __future__ import annotations

import http.client
import json
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

try:
    import psutil
except ImportError:  # /proc is read instead
    psutil = None

SEND_PIECE = 1 << 20


@dataclass
class Answer:
    """One streamed request as its client saw it, retries included."""

    status: int | None = None  # the final answer's HTTP status (None: no answer at all)
    codes: list[int] = field(default_factory=list)  # every status received, 429s a client retried included
    ttft_s: float | None = None  # from the first attempt to the first text
    latency_s: float = 0.0
    text: str = ""
    tokens: int = 0  # usage's completion tokens, else the text chunks counted
    finish: str | None = None
    done: bool = False  # the stream ended with [DONE]
    error: str | None = None

    def complete(self, max_tokens: int) -> bool:
        """An answer that arrived whole: [DONE], a finish reason, and as many tokens as its finish says."""
        return (self.status == 200 and self.done and self.finish in ("stop", "length")
                and (self.finish != "length" or self.tokens >= max_tokens))


def stream_chat(host: str, port: int, messages: list[dict], max_tokens: int, model: str,
                headers: dict[str, str] | None = None, deadline_s: float = 600.0, user: str | None = None) -> Answer:
    """A streamed greedy chat completion; on 429 (or 503) waits what Retry-After says and tries again, until
    `deadline_s` has passed. `user`: the request's `user` label (the server keeps that client's conversation)."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True},
                       **({"user": user} if user else {})}).encode()
    answer, started = Answer(), time.perf_counter()
    while True:
        conn = http.client.HTTPConnection(host, port, timeout=deadline_s)
        try:
            conn.request("POST", "/v1/chat/completions", body,
                         {"Content-Type": "application/json", **(headers or {})})
            response = conn.getresponse()
            answer.codes.append(response.status)
            retry = response.getheader("Retry-After")
            if response.status in (429, 503) and time.perf_counter() - started < deadline_s:
                response.read()
                time.sleep(float(retry) if retry else 1.0)
                continue
            answer.status = response.status
            if response.status != 200:
                answer.error = response.read()[:300].decode(errors="replace")
                break
            _read_events(response, answer, started)
        except OSError as err:
            answer.error = f"{type(err).__name__}: {err}"
        finally:
            conn.close()
        break
    answer.latency_s = time.perf_counter() - started
    return answer


def _read_events(response, answer: Answer, started: float) -> None:
    counted = 0
    while line := response.readline():
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            answer.done = True
            break
        event = json.loads(data)
        if "error" in event:
            answer.error = json.dumps(event["error"])[:300]
            continue
        for choice in event.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            if text:
                if answer.ttft_s is None:
                    answer.ttft_s = time.perf_counter() - started
                answer.text += text
                counted += 1
            answer.finish = choice.get("finish_reason") or answer.finish
        if event.get("usage"):
            answer.tokens = event["usage"]["completion_tokens"]
    answer.tokens = answer.tokens or counted


def send_raw(host: str, port: int, path: str, body: bytes, timeout_s: float = 30.0) -> tuple[int | None, float]:
    """POSTs `body` piece by piece and stops sending as soon as the server answers (a server that refuses a
    body by its Content-Length need not wait for it). Returns (status, seconds to the answer's
    status line), status None when the first line is not one; ConnectionError when no answer arrived."""
    started = time.perf_counter()
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        try:
            sock.sendall(head)
            for start in range(0, len(body), SEND_PIECE):
                if select.select([sock], [], [], 0)[0]:
                    break  # an answer (or a close) came before the whole body
                sock.sendall(body[start:start + SEND_PIECE])
        except (BrokenPipeError, ConnectionResetError) as err:
            closed = err  # the server closed its side early: what it answered is read below
        else:
            closed = None
        try:
            first = sock.makefile("rb").readline()
        except (ConnectionResetError, TimeoutError) as err:
            raise ConnectionError(f"no answer to a {len(body)}-byte body ({closed or err})") from err
    took = time.perf_counter() - started
    parts = first.split()
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None), took


def rss_bytes(pid: int) -> int:
    if psutil is not None:
        return psutil.Process(pid).memory_info().rss
    return _proc_status_kib(pid, "VmRSS") * 1024


def cpu_seconds(pid: int) -> float | None:
    """CPU time the process has used, all its threads (Linux: /proc; psutil elsewhere), None where unknown."""
    if psutil is not None:
        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_bytes(pid: int) -> int | None:
    """The kernel's high-water mark of the process's resident memory (Linux), None elsewhere."""
    try:
        return _proc_status_kib(pid, "VmHWM") * 1024
    except FileNotFoundError:
        return None


def _proc_status_kib(pid: int, name: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    raise FileNotFoundError(f"/proc/{pid}/status has no {name}")


class Watch:
    """Samples a process's RSS and polls its /health every `every_s` on a thread, between start and stop:
    the peak RSS seen, and the slowest and failed health answers."""

    def __init__(self, host: str, port: int, pid: int, health_path: str = "/health", every_s: float = 0.05):
        self.host, self.port, self.pid, self.health_path, self.every_s = host, port, pid, health_path, every_s
        self.peak_rss = 0
        self.health_checks, self.health_failed, self.slowest_health_s = 0, 0, 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, rss_bytes(self.pid))
            started = time.perf_counter()
            conn = http.client.HTTPConnection(self.host, self.port, timeout=1.0)
            try:
                conn.request("GET", self.health_path)
                ok = conn.getresponse().status == 200
            except OSError:
                ok = False
            finally:
                conn.close()
            self.health_checks += 1
            self.health_failed += not ok
            self.slowest_health_s = max(self.slowest_health_s, time.perf_counter() - started)
            self._stop.wait(self.every_s)
