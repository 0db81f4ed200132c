"""llguidance vs xgrammar on our own tokenizers (the choice behind cgn_infer.grammar).

For SmolLM2 (49k tokens) and Qwen2.5 (152k) and each grammar engine: the time to build
its tokenizer from the GGUF's vocabulary, then for every schema of the test corpus
(tests/fixtures/json_schemas.json) the cold compile time, the time of one token mask
along a valid instance (written compact, as cgn-infer writes JSON, in the model's own
tokens), whether that instance is accepted token by token, and schemas refused. One run,
same process, same inputs.

xgrammar is not a dependency (it needs transformers and triton); to include it:
    pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi
    pip install --target /tmp/xg2 transformers   # then drop numpy and tokenizers from it
    PYTHONPATH=/tmp/xg:/tmp/xg2 python bench/grammar_engines.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from bench.common import write_result  # noqa: E402
from cgn_core.bundled_models import qwen_coder_05b, smollm2  # noqa: E402
from cgn_core.text.gguf_file import GGUFFile  # noqa: E402
from cgn_core.text.tokenizer import GGUFTokenizer  # noqa: E402

CORPUS = json.loads((REPO / "tests" / "fixtures" / "json_schemas.json").read_text())
SEPARATORS = (", ", ": ")


class Llguidance:
    name = "llguidance"

    def __init__(self, tok: GGUFTokenizer, size: int):
        from cgn_infer.grammar import JSON_OPTIONS, Grammars

        self.grammars, self.options = Grammars(tok, size), JSON_OPTIONS
        self.grammars.warm()

    def compile(self, schema: dict[str, Any]) -> Any:
        import llguidance as llg

        grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=self.options)  # type: ignore[arg-type]
        error, why = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.grammars.vocab)
        if error:
            raise ValueError(" ".join(why))
        return llg.LLMatcher(self.grammars.vocab, grammar, log_level=0)

    def walk(self, matcher: Any, ids: list[int]) -> tuple[list[float], bool]:
        times = []
        for t in ids:
            start = time.perf_counter()
            mask = self.grammars.fill([_Wrap(matcher)])
            times.append(time.perf_counter() - start)
            if not self.grammars.allowed(mask[0])[t] or not matcher.consume_token(t):
                return times, False
        return times, bool(matcher.is_accepting())


class _Wrap:  # Grammars.fill takes constraints
    def __init__(self, matcher: Any):
        self.matcher = matcher


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok: GGUFTokenizer, size: int):
        import xgrammar as xgr

        pieces = [b"" if b.startswith(b"\xff") else b for b in tok.token_bytes()]
        pieces += [b""] * (size - len(pieces))
        info = xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=size,
                                 stop_token_ids=sorted(tok.stop_ids))  # fmt: skip
        self.xgr, self.size = xgr, size
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, schema: dict[str, Any]) -> Any:
        compiled = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=SEPARATORS
        )
        return self.xgr.GrammarMatcher(compiled)

    def walk(self, matcher: Any, ids: list[int]) -> tuple[list[float], bool]:
        bitmask = self.xgr.allocate_token_bitmask(1, self.size)
        times = []
        for t in ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - start)
            row = bitmask[0].numpy().view(np.uint8)
            if not np.unpackbits(row, bitorder="little")[t] or not matcher.accept_token(t):
                return times, False
        return times, bool(matcher.is_terminated() or matcher.is_completed())


def measure(
    make: Callable[[GGUFTokenizer, int], Any], tok: GGUFTokenizer, size: int
) -> dict[str, Any]:
    start = time.perf_counter()
    engine = make(tok, size)
    setup_s = time.perf_counter() - start
    compiles, masks, accepted, refused = [], [], 0, []
    for case in CORPUS:
        ids = tok.encode(json.dumps(case["example"], ensure_ascii=False, separators=SEPARATORS),
                         add_bos=False)  # fmt: skip
        start = time.perf_counter()
        try:
            matcher = engine.compile(case["schema"])
        except Exception as exc:  # a schema this engine cannot compile
            refused.append(f"{case['name']}: {str(exc)[:80]}")
            continue
        compiles.append(time.perf_counter() - start)
        times, ok = engine.walk(matcher, ids)
        masks += times
        accepted += ok
    return {
        "setup_s": setup_s,
        "compile_ms_mean": 1e3 * statistics.mean(compiles),
        "compile_ms_p95": 1e3 * float(np.percentile(compiles, 95)),
        "compile_ms_max": 1e3 * max(compiles),
        "mask_us_mean": 1e6 * statistics.mean(masks),
        "mask_us_p99": 1e6 * float(np.percentile(masks, 99)),
        "accepted": accepted,
        "schemas": len(CORPUS),
        "refused": refused,
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    engines: list[Any] = [Llguidance]
    try:
        import xgrammar  # noqa: F401

        engines.append(Xgrammar)
    except ImportError:
        print("xgrammar is not importable: measuring llguidance only (see --help)")
    results, rows = {}, []
    for model, path in (("smollm2", smollm2()), ("qwen", qwen_coder_05b())):
        with GGUFFile(path) as gguf:
            from cgn_infer.models import args_from_gguf

            tok, size = GGUFTokenizer(gguf), args_from_gguf(gguf).vocab_size
        for make in engines:
            r = measure(make, tok, size)
            results[f"{model}/{make.name}"] = r
            rows.append(
                f"| {model} ({size:,} tokens) | {make.name} | {r['setup_s']:.2f} | "
                f"{r['compile_ms_mean']:.1f} / {r['compile_ms_p95']:.1f} / {r['compile_ms_max']:.1f} | "
                f"{r['mask_us_mean']:.0f} / {r['mask_us_p99']:.0f} | {r['accepted']}/{r['schemas']} | "
                f"{len(r['refused'])} |"
            )
            print(rows[-1], flush=True)
    refusals = "\n".join(
        f"- {key}: {'; '.join(r['refused'])}" for key, r in results.items() if r["refused"]
    )
    table = (
        f"{len(CORPUS)} JSON schemas (tests/fixtures/json_schemas.json), one valid instance each "
        "walked token by token.\n\n"
        "| model | engine | tokenizer setup s | cold compile ms mean / p95 / max | "
        "mask µs mean / p99 | instances accepted | schemas refused |\n|---|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + (f"\n\nRefused:\n{refusals}" if refusals else "")
    )
    write_result("grammar_engines", "python bench/grammar_engines.py", results, table)


if __name__ == "__main__":
    main()
