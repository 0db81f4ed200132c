"""Record an engine's command-line options from its own parser, for the tests (#62).

    PYTHONPATH=<a dir with the engine installed> .venv/bin/python \
        scripts/capture_engine_options.py sglang > tests/fixtures/engines/sglang-<version>.json

The CI machine cannot import vLLM's or SGLang's parsers (SGLang's pulls triton, IPython,
zmq; vLLM's CUDA builds), so the test of our drivers' argv (tests/test_engine_argv.py)
rebuilds each parser from this record: every option's flags, its nargs, choices, value
type and whether it takes a value. Where the package imports, the test uses the real
parser as well. Recorded from the package as installed, never written by hand.

How SGLang 0.5.23's parser was made importable on a CPU machine (no CUDA): the wheel and
orjson, psutil, pybase64, triton, pillow, starlette, msgspec, pyzmq, IPython, traitlets
with `pip install --no-deps --target DIR`, beside CPU torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def parser_of(engine: str) -> tuple[argparse.ArgumentParser, str]:
    if engine == "sglang":
        import sglang
        from sglang.srt.server_args import ServerArgs

        p = argparse.ArgumentParser()
        ServerArgs.add_cli_args(p)
        return p, str(sglang.__version__)
    if engine == "vllm":
        import vllm
        from vllm.entrypoints.common.cli_args import make_arg_parser  # 0.34 (0.1x: .openai.)
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        return make_arg_parser(FlexibleArgumentParser()), str(vllm.__version__)
    raise SystemExit(f"capture_engine_options: unknown engine {engine!r} (sglang, vllm)")


def record(p: argparse.ArgumentParser) -> list[dict[str, Any]]:
    out = []
    for a in p._actions:
        if not a.option_strings or isinstance(a, argparse._HelpAction):
            continue
        takes = not isinstance(a, (argparse._StoreConstAction, argparse._CountAction,
                                   argparse.BooleanOptionalAction))  # fmt: skip
        out.append({
            "flags": list(a.option_strings),
            "dest": a.dest,
            "takes_value": takes and a.nargs != 0,
            "nargs": a.nargs if isinstance(a.nargs, (int, str)) else None,
            "choices": sorted(map(str, a.choices)) if a.choices is not None else None,
            "type": getattr(a.type, "__name__", None) if a.type is not None else None,
        })  # fmt: skip
    return sorted(out, key=lambda o: o["flags"][0])


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: capture_engine_options.py sglang|vllm")
    p, version = parser_of(sys.argv[1])
    doc = {"engine": sys.argv[1], "version": version, "options": record(p)}
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
