"""Which grammar engine constrains decoding here: llguidance, xgrammar and outlines-core, measured on the
same JSON schema and the same valid document, on the tiny test tokenizer and on the reference model's.

    python benchmarks/measure/grammar_engines.py [BUNDLE] [--schema FILE] [--rounds 3] [--json FILE]

For each engine and tokenizer: the time to read the tokenizer, to compile the schema, and per token of the
document (its tokenizer's own tokenization of json.dumps of an instance) the mask's cost and the cost of
advancing the parser by the token; whether importing the engine brings in torch (the runtime must not).
Per-token figures are the median over `--rounds` walks of each walk's mean. The document is walked
token by token, so the masks are those of a real decode: keys, punctuation, strings, numbers.

The tiny tokenizer is tests/tiny.py's (320 tokens, byte-level BPE); it is built with transformers, so the
script needs the [export] extra, as the tests do. xgrammar reads tokenizers through transformers too.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "sender_name": {"type": "string"},
        "sender_company": {"type": ["string", "null"]},
        "arrival_date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
        "participants": {"type": "integer"},
        "rooms": {"type": "array", "items": {"type": "object", "properties": {
            "type": {"type": "string", "enum": ["single", "double", "suite"]}, "count": {"type": "integer"}},
            "required": ["type", "count"], "additionalProperties": False}},
        "needs_meeting_room": {"type": "boolean"},
        "budget_per_night_eur": {"type": ["number", "null"]},
    },
    "required": ["sender_name", "sender_company", "arrival_date", "participants", "rooms", "needs_meeting_room",
                 "budget_per_night_eur"],
    "additionalProperties": False,
}
DOCUMENT = {"sender_name": "Maria Lindqvist", "sender_company": "Nordlicht Events GmbH", "arrival_date": "2025-03-14",
            "participants": 12, "rooms": [{"type": "double", "count": 4}, {"type": "single", "count": 4}],
            "needs_meeting_room": True, "budget_per_night_eur": 145.5}
ENGINES = ("llguidance", "xgrammar", "outlines_core")


def imports_torch(module: str) -> bool:
    """Whether importing `module` alone, in a fresh interpreter, loads torch."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "True"


def token_bytes(tokenizer_json: str) -> tuple[list[bytes], list[int]]:
    """Every token's bytes (byte-level BPE: GPT-2's byte-to-unicode map undone) and the special tokens' ids."""
    data = json.loads(tokenizer_json)
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    codes = printable + [b for b in range(256) if b not in printable]
    unicode_to_byte = {chr(c if c in printable else 256 + i): c
                       for i, c in enumerate(b for b in range(256) if b not in printable)}
    unicode_to_byte.update({chr(c): c for c in printable})
    assert len(codes) == 256
    vocab = dict(data["model"]["vocab"])
    special = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    vocab.update(special)
    size = max(vocab.values()) + 1
    out = [b""] * size
    for text, i in vocab.items():
        out[i] = text.encode() if text in special else bytes(unicode_to_byte[ch] for ch in text)
    return out, sorted(special.values())


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, eos: int):
        import llguidance
        self.ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
        self.vocab = self.tokenizer.vocab_size

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        self.mask = np.zeros((self.vocab + 31) // 32, dtype=np.int32)
        return matcher

    def fill(self, matcher) -> None:
        matcher.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)

    def allowed(self, token: int) -> bool:
        return bool((self.mask[token // 32] >> (token % 32)) & 1)

    def advance(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, eos: int):
        import torch
        import xgrammar
        from transformers import PreTrainedTokenizerFast
        self.xgr, self.torch = xgrammar, torch
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "tokenizer.json").write_text(tokenizer_json)
            hf = PreTrainedTokenizerFast(tokenizer_file=str(Path(folder, "tokenizer.json")))
        self.vocab = len(hf)
        self.compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab,
                                                                                         stop_token_ids=[eos]))

    def compile(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)
        self.mask = self.xgr.allocate_token_bitmask(1, self.vocab)
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self.mask)

    def allowed(self, token: int) -> bool:
        return bool((int(self.mask[0, token // 32]) >> (token % 32)) & 1)

    def advance(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)


class OutlinesCore:
    name = "outlines_core"

    def __init__(self, tokenizer_json: str, eos: int):
        import outlines_core
        self.oc = outlines_core
        pieces, special = token_bytes(tokenizer_json)
        by_bytes: dict[bytes, list[int]] = {}
        for i, piece in enumerate(pieces):
            if i != eos and i not in special and piece:
                by_bytes.setdefault(piece, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, by_bytes)
        self.vocab = len(pieces)

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), r"[ ]?")
        self.mask = np.zeros((self.vocab + 31) // 32, dtype=np.int32)
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def fill(self, guide) -> None:
        guide.write_mask_into(self.mask.ctypes.data, self.mask.size, self.mask.itemsize)

    def allowed(self, token: int) -> bool:
        return bool((self.mask[token // 32] >> (token % 32)) & 1)

    def advance(self, guide, token: int) -> None:
        guide.advance(token)


ADAPTERS = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines_core": OutlinesCore}


def measure(engine: str, tokenizer_json: str, eos: int, document_ids: list[int], rounds: int) -> dict:
    started = time.perf_counter()
    adapter = ADAPTERS[engine](tokenizer_json, eos)
    tokenizer_s = time.perf_counter() - started
    compile_s, mask_s, advance_s = [], [], []
    for _ in range(rounds):
        started = time.perf_counter()
        matcher = adapter.compile(SCHEMA)
        compile_s.append(time.perf_counter() - started)
        masks = advances = 0.0
        for token in document_ids:
            t0 = time.perf_counter()
            adapter.fill(matcher)
            t1 = time.perf_counter()
            if not adapter.allowed(token):
                raise AssertionError(f"{engine} refuses token {token} of a valid document")
            adapter.advance(matcher, token)
            t2 = time.perf_counter()
            masks += t1 - t0
            advances += t2 - t1
        mask_s.append(masks / len(document_ids))
        advance_s.append(advances / len(document_ids))
    return {"engine": engine, "tokenizer_s": round(tokenizer_s, 4), "compile_s": round(statistics.median(compile_s), 4),
            "mask_us": round(1e6 * statistics.median(mask_s), 1), "advance_us": round(1e6 * statistics.median(advance_s), 1),
            "tokens": len(document_ids)}


def tiny_tokenizer() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from tiny import make_tokenizer
    with tempfile.TemporaryDirectory() as folder:
        make_tokenizer(Path(folder))
        return Path(folder, "tokenizer.json").read_text()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", nargs="?", default="default", help="the bundle whose tokenizer is measured")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    from tokenizers import Tokenizer

    from edgespec.defaults import resolve_bundle

    folder = Path(resolve_bundle(args.bundle))
    manifest = json.loads((folder / "manifest.json").read_text())
    tokenizers = {"tiny (320)": (tiny_tokenizer(), None),
                  f"{folder.name} ({manifest['target']['facts']['vocab_size']})":
                      ((folder / "tokenizer.json").read_text(), manifest["tokenizer"]["eos_token_ids"][0])}
    document = json.dumps(DOCUMENT)
    rows = []
    engines = args.engines.split(",")
    torch_free = {engine: not imports_torch(engine) for engine in engines}
    for label, (text, eos) in tokenizers.items():
        tokenizer = Tokenizer.from_str(text)
        eos = eos if eos is not None else tokenizer.token_to_id("<|im_end|>")
        ids = tokenizer.encode(document, add_special_tokens=False).ids
        for engine in engines:
            importlib.import_module(engine)
            row = {"tokenizer": label, **measure(engine, text, eos, ids, args.rounds), "torch_free": torch_free[engine]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| tokenizer | engine | read tokenizer s | compile s | mask µs/token | advance µs/token | no torch |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['tokenizer']} | {r['engine']} | {r['tokenizer_s']} | {r['compile_s']} | {r['mask_us']} | "
              f"{r['advance_us']} | {'yes' if r['torch_free'] else 'no'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
