"""docs/images/trace.png: one real request's trace, drawn from the spans it exported.

    .venv/bin/python scripts/trace_picture.py [--out docs/images/trace.png]

A router and two sim engines (a prefill and a decode replica), tracing on at
100 %, export to an OTLP/gRPC receiver in this process (harness/otlp.py); one
chat request with a long prompt goes through the router (so it is split into a
prefill leg and a decode leg), and its trace is drawn as a waterfall (one row
per span, indented under its parent, bars on one time axis) in headless
Chromium. Also prints the spans as a table (for docs/tracing.md).
"""

from __future__ import annotations

import argparse
import html
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from harness.browser import open_page
from harness.otlp import Span, receiver
from harness.procs import cgn_infer_engines, cgn_router

COLORS = {"cgn-router": "#3b82f6", "cgn-infer": "#10b981"}


def ordered(spans: list[Span]) -> list[tuple[int, Span]]:
    """(depth, span) in tree order, children by start time."""
    ids = {s.span_id for s in spans}
    kids: dict[str, list[Span]] = {}
    for s in spans:
        kids.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    out: list[tuple[int, Span]] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(kids.get(parent, []), key=lambda s: s.start_ns):
            out.append((depth, s))
            walk(s.span_id, depth + 1)

    walk("", 0)
    return out


def page(spans: list[Span]) -> str:
    rows = ordered(spans)
    t0 = min(s.start_ns for s in spans)
    total = max(s.end_ns for s in spans) - t0
    lines = []
    for depth, s in rows:
        left = 100 * (s.start_ns - t0) / total
        width = max(0.3, 100 * (s.end_ns - s.start_ns) / total)
        ms = (s.end_ns - s.start_ns) / 1e6
        label = html.escape(f"{s.service}: {s.name}")
        lines.append(
            f'<div class="row"><div class="name" style="padding-left:{depth * 18}px">{label}</div>'
            f'<div class="lane"><div class="bar" style="left:{left:.2f}%;width:{width:.2f}%;'
            f'background:{COLORS.get(s.service, "#888")}"></div>'
            f'<span class="ms" style="left:{min(left + width, 88):.2f}%">{ms:.1f} ms</span>'
            "</div></div>"
        )
    return (
        "<html><head><style>body{font:14px sans-serif;margin:24px;background:#fff}"
        ".row{display:flex;height:26px;align-items:center}.name{width:360px;box-sizing:border-box;white-space:nowrap}"
        ".lane{position:relative;flex:1;height:16px;border-left:1px solid #ddd}"
        ".bar{position:absolute;height:16px;border-radius:3px}"
        ".ms{position:absolute;padding-left:6px;font-size:12px;color:#444}</style></head><body>"
        f"<h3>One chat request, prefill and decode disaggregated: {len(spans)} spans, "
        f"{total / 1e6:.1f} ms, trace {spans[0].trace_id}</h3>"
        + "".join(lines)
        + '<div id="done"></div></body></html>'
    )


def table(spans: list[Span]) -> str:
    t0 = min(s.start_ns for s in spans)
    out = ["| span | service | starts at | lasts | attributes |", "|---|---|---:|---:|---|"]
    for depth, s in ordered(spans):
        attrs = ", ".join(f"`{k}={v}`" for k, v in sorted(s.attributes.items())
                          if k.startswith(("cognitora.", "gen_ai.")))  # fmt: skip
        out.append(f"| {'· ' * depth}{s.name} | {s.service} | {(s.start_ns - t0) / 1e6:.1f} ms | "
                   f"{(s.end_ns - s.start_ns) / 1e6:.1f} ms | {attrs} |")  # fmt: skip
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("docs/images/trace.png"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        tmp = Path(d)
        rx = stack.enter_context(receiver())
        tracing = {"enabled": True, "endpoint": rx.url, "sample_ratio": 1.0,
                   "export_every_s": 0.1}  # fmt: skip
        argv = ["--backend", "sim", "--speed", "100", "--model-name", "sim"]
        for k, v in tracing.items():
            argv += ["--set", f"tracing.{k}={v}"]
        prefill, decode = stack.enter_context(cgn_infer_engines(tmp, 2, *argv))
        config = {
            "discovery": "static",
            "models": {"sim": {"tokenizer": "smollm2"}},
            "endpoints": {"p": {"url": prefill.url, "model": "sim", "role": "prefill"},
                          "d": {"url": decode.url, "model": "sim", "role": "decode"}},
            "pd": {"min_uncached_tokens": 256},
            "tracing": tracing,
        }  # fmt: skip
        router = stack.enter_context(cgn_router(tmp, config))
        text = "Summarise: " + "the story goes on " * 80
        body = {"model": "sim", "max_tokens": 12, "stream": True,
                "messages": [{"role": "user", "content": text}]}  # fmt: skip
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            r.read()

        def whole(spans: list[Span]) -> list[Span] | None:
            roots = [s for s in spans if s.service == "cgn-router" and s.parent_id == ""]
            trace = [s for s in spans if roots and s.trace_id == roots[0].trace_id]
            done = sum(s.name == "decode" for s in trace) == 2 and any(s is roots[0] for s in trace)
            return trace if done else None

        spans = rx.wait("the request's whole trace", whole)
        html_file = tmp / "trace.html"
        html_file.write_text(page(spans))
        shot = open_page(html_file.as_uri(), "document.getElementById('done')", size=(1400, 560))
        args.out.write_bytes(shot.png)
        print(table(spans))
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
