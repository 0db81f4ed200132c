"""cgn-router against SGLang's Rust gateway (smg, cache_aware) on the same fake engines, one run.

    .venv/bin/python bench/router_vs_smg.py [--rounds 3] [--seconds 8] [--requests 1000] [--workers 1,2]

Both gateways route the same chat requests (a ~150-token prompt: a shared
system prompt and a user question that differs in every request, so nothing
is answered from a whole-request cache) over the same four fake engines (bench/fake_engine.py: one process, four ports, answers at
once). cgn-router runs its full pipeline: API key (etcd), admission,
tokenizing with SmolLM2's tokenizer, block hashing, scoring four endpoints.
smg runs `--policy cache_aware` (its approximate radix tree over the text).
Nothing is pinned: gateways, engine and load generator share the machine
alike, and the two gateways are measured in alternating rounds (cgn, smg,
cgn, smg, ...) so drift on this noisy machine hits both; figures are the
mean over rounds.

* c=1: sequential requests on one keep-alive connection, alternating direct
  (the engine itself), cgn and smg request by request; added = gateway - direct.
* c=64: `wrk -t1 -c64 --latency` for `--seconds` per gateway per round:
  requests/s and p99, and the CPU time the gateway's processes (all of a
  router's workers and its supervisor) spent per request: what the gateway
  costs, whichever process got the cores this round.
* stream: sequential 64-token streams, time to the last byte, p50.
* workers: cgn-router is measured once per `--workers` count (default 1 and one
  per core), each a router of its own on the same engines and etcd.
* profile: with py-spy installed, cgn-router's CPU profile during one c=64
  run (the functions with the most samples, self and total).

Results: bench/results/router_vs_smg.{json,md}.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from cgn_core import bundled_models, keys
from cgn_core.apikeys import create
from cgn_core.etcd.local import LocalEtcd, free_port
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.prompt import PromptCodec
from harness.procs import BIN, REPO, cgn_router, etcd_put, http_process

SYSTEM = ("You are a careful assistant for a logistics company. Answer in short sentences, "
          "cite the shipment number when you know it, never invent tracking data, and ask "
          "for the order reference when it is missing. ") * 3  # fmt: skip
BODY = {"model": "fake", "max_tokens": 1,
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": "Where is shipment NNNN?"}]}  # fmt: skip
SHORT = {"model": "fake", "max_tokens": 1,
         "messages": [{"role": "user", "content": "Where is shipment NNNN?"}]}  # fmt: skip
QUESTION = ("Where is shipment NNNN? It left the Rotterdam depot on Monday with two pallets "
            "of spare parts, and the customer says the tracking page has not moved since.")  # fmt: skip
LONG_CHAT = {"model": "fake", "max_tokens": 1,
             "messages": [{"role": "system", "content": SYSTEM * 3},
                          {"role": "user", "content": QUESTION}]}  # fmt: skip


def workload(name: str, conversations: int) -> list[dict[str, Any]]:
    """The request bodies of a workload, sent in turn (NNNN: the request's number)."""
    if name == "short":
        return [SHORT]
    if name == "long-chat":
        return [LONG_CHAT]
    if name == "conversations":  # every turn resends its history (bench/router_conversations)
        from bench.router_conversations import Words, mooncake

        codec = PromptCodec.from_gguf(GGUFFile(bundled_models.smollm2()))
        return [json.loads(b) for b in mooncake(Words(codec), conversations)[0]]
    return [BODY]


def body(n: int, base: dict[str, Any] = BODY, **extra: object) -> bytes:
    """`base` with shipment number `n` (a new user message per request)."""
    return json.dumps({**base, **extra}).replace("NNNN", str(n)).encode()


ENGINES = 4


@contextmanager
def gateways(
    tmp: Path,
    workers: list[int],
    variants: dict[str, dict[str, Any]] | None = None,
    smg: bool | None = None,
) -> Iterator[dict[str, Any]]:
    """The fake engines, etcd with one API key, a cgn-router per worker count (`cgn<N>`)
    and smg; all stopped after. With `variants` (name → settings over the common ones),
    those routers instead of one per worker count, and no smg unless `smg`."""
    with ExitStack() as stack:
        ports = [free_port() for _ in range(ENGINES)]
        fake = [sys.executable, str(REPO / "bench/fake_engine.py"), *map(str, ports)]
        stack.enter_context(
            http_process(fake, f"http://127.0.0.1:{ports[0]}/health", tmp / "fake.log")
        )
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        etcd = LocalEtcd(tmp / "etcd")
        etcd.start()
        stack.callback(etcd.stop)
        key, record = create("bench", "gold")
        etcd_put(etcd.endpoint, keys.API_KEYS + record.id, record.to_json())
        for i, url in enumerate(urls):
            etcd_put(etcd.endpoint, f"{keys.ENDPOINTS}fake/e{i}", {"url": url, "engine": "vllm"})
        config = {
            "etcd": {"endpoints": [etcd.endpoint]}, "auth": {"enabled": True},
            "log": {"level": "warning"}, "models": {"fake": {"tokenizer": "smollm2"}},
            "reconciler": {"enabled": False},
        }  # fmt: skip
        with_smg = variants is None if smg is None else smg
        variants = variants or {f"cgn{n}": {"workers": n} for n in workers}
        cgns = {name: stack.enter_context(cgn_router(tmp, {**config, **extra}))
                for name, extra in variants.items()}  # fmt: skip
        for cgn in cgns.values():
            deadline = time.monotonic() + 30
            while _status(cgn.url, key) != 200:  # the key and the endpoints come from etcd
                assert time.monotonic() < deadline, "cgn-router never served"
                time.sleep(0.1)
        first = next(iter(cgns.values()))
        common = {"direct": urls[0], "key": key, "cgn_pid": first.proc.pid, "cgn_url": first.url,
                  "admins": {n: c.admin for n, c in cgns.items()}}  # fmt: skip
        if not with_smg:
            yield {**common, **{n: c.url for n, c in cgns.items()},
                   "pids": {n: c.proc.pid for n, c in cgns.items()}}  # fmt: skip
            return
        port = free_port()
        argv = [str(BIN / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *urls, "--policy", "cache_aware", "--log-level", "warn"]  # fmt: skip
        smg_proc = stack.enter_context(
            http_process(argv, f"http://127.0.0.1:{port}/health", tmp / "smg.log")
        )
        smg_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while _status(smg_url, key) != 200:  # workers are activated after its health is up
            assert time.monotonic() < deadline, "smg never served"
            time.sleep(0.1)
        yield {
            **common,
            **{name: cgn.url for name, cgn in cgns.items()},
            "smg": smg_url,
            "pids": {**{n: c.proc.pid for n, c in cgns.items()}, "smg": smg_proc.pid},
        }


def _status(url: str, key: str) -> int:
    try:
        conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=10)
        conn.request("POST", "/v1/chat/completions", body(0), _headers(key))
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except OSError:
        return 0


def _headers(key: str) -> dict[str, str]:
    return {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}


def sequential(
    urls: dict[str, str], key: str, n: int, bases: list[dict[str, Any]], **extra: object
) -> dict[str, list[float]]:
    """Alternate requests over one keep-alive connection per target, the bodies of `bases`
    in turn; ms per request."""
    conns = {k: http.client.HTTPConnection(u.removeprefix("http://"), timeout=30)
             for k, u in urls.items()}  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in urls}
    for i in range(n + 50):
        for k, conn in conns.items():
            t = time.perf_counter()
            payload = body(i, bases[i % len(bases)], **extra)
            conn.request("POST", "/v1/chat/completions", payload, _headers(key))
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200, (k, resp.status)
            if i >= 50:  # warm-up
                times[k].append((time.perf_counter() - t) * 1000)
    return times


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def wrk(
    url: str, key: str, seconds: int, tmp: Path, bases: list[dict[str, Any]]
) -> dict[str, float]:
    """`wrk` with the bodies of `bases` in turn, each request's number for NNNN."""
    script = tmp / "post.lua"
    pieces = [json.dumps(b).split("NNNN") for b in bases]
    table = ",".join("{" + ",".join(json.dumps(p) for p in ps) + "}" for ps in pieces)
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {key}"\n'
        f"local bodies, n = {{{table}}}, 0\n"
        "request = function()\n  n = n + 1\n"
        "  local parts = bodies[(n - 1) % #bodies + 1]\n"
        "  return wrk.format(nil, nil, nil, table.concat(parts, tostring(n)))\n"
        "end\n"
    )
    argv = ["wrk", "-t1", "-c64", f"-d{seconds}s", "--latency", "-s", str(script),
            url + "/v1/chat/completions"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    if re.search(r"Non-2xx or 3xx responses: (\d+)", out):
        raise RuntimeError(f"wrk saw errors:\n{out}")
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    p99 = re.search(r"99%\s+([\d.]+)(us|ms|s)\b", out)
    assert rps and p99, out
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}[p99.group(2)]
    return {"req_s": float(rps.group(1)), "p99_ms": float(p99.group(1)) * scale}


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of `pid` and every process under it, from /proc."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parents[int(entry)] = int(stat[1])
        times[int(entry)] = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    tree, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in tree} - tree
        grew, tree = bool(more), tree | more
    return sum(times.get(p, 0.0) for p in tree)


def measured_wrk(
    pid: int, url: str, key: str, seconds: int, tmp: Path, bases: list[dict[str, Any]]
) -> dict[str, float]:
    """`wrk` on `url`, with the CPU µs the gateway under `pid` spent per request."""
    before = cpu_s(pid)
    out = wrk(url, key, seconds, tmp, bases)
    out["cpu_us_per_req"] = (cpu_s(pid) - before) / (out["req_s"] * seconds) * 1e6
    return out


def profile(
    pid: int, seconds: int, url: str, key: str, tmp: Path, bases: list[dict[str, Any]]
) -> list[dict[str, Any]] | str:
    """cgn-router's hottest functions during a c=64 run, from py-spy's raw stacks."""
    spy = shutil.which("py-spy") or str(BIN / "py-spy")
    if not Path(spy).exists():
        return "skipped: py-spy not installed (pip install py-spy)"
    raw = tmp / "profile.txt"
    rec = subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(seconds),
                            "--format", "raw", "--rate", "200", "--output", str(raw), "--nonblocking"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    time.sleep(0.5)
    wrk(url, key, seconds, tmp, bases)
    rec.wait(timeout=seconds + 30)
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        # "fn (path/file.py:line)" -> "fn (file.py)": one entry per function, not per line
        frames = [re.sub(r" \((.*/)?([^/:]+)(:\d+)?\)$", r" (\2)", f) for f in stack.split(";")]
        n = int(count)
        samples += n
        own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    return [{"function": f, "self_pct": round(100 * own[f] / samples, 1),
             "total_pct": round(100 * total[f] / samples, 1)}
            for f, _ in own.most_common(25)]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=int, default=8, help="wrk duration per gateway per round")
    p.add_argument("--requests", type=int, default=1000, help="sequential requests per target")
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--workers", default=f"1,{cores}" if cores > 1 else "1",
                   help="cgn-router worker counts to measure, comma-separated (default: 1 and "
                        "one per core); the profile is of the first")  # fmt: skip
    p.add_argument("--workload", choices=["chat", "short", "long-chat", "conversations"],
                   default="chat", help="chat: a ~150-token shared system prompt and a new "
                   "question per request; short: the question alone; long-chat: a ~450-token "
                   "system prompt and a ~40-token question; conversations: Mooncake's first "
                   "--conversations requests as chats, each resending its history, in turn")  # fmt: skip
    p.add_argument("--conversations", type=int, default=200)
    args = p.parse_args()
    bases = workload(args.workload, args.conversations)
    workers = sorted({int(w) for w in args.workers.split(",")})
    if not shutil.which("wrk"):
        sys.exit("install wrk (apt install wrk)")
    if not (BIN / "smg").exists():
        sys.exit("install smg (pip install smg) into this venv")
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        with gateways(tmp, workers) as g:
            cgns = [f"cgn{n}" for n in workers]
            targets = {k: g[k] for k in ("direct", *cgns, "smg")}
            for r in range(args.rounds):
                c1 = sequential(targets, g["key"], args.requests, bases)
                st = sequential(targets, g["key"], args.requests // 2, bases, max_tokens=64,
                                stream=True)  # fmt: skip
                order = [*cgns, "smg"] if r % 2 == 0 else ["smg", *reversed(cgns)]
                c64 = {k: measured_wrk(g["pids"][k], g[k], g["key"], args.seconds, tmp, bases)
                       for k in order}  # fmt: skip
                one = {k: {"c1_p50_ms": pct(c1[k], 0.5), "c1_p99_ms": pct(c1[k], 0.99),
                           "stream64_p50_ms": pct(st[k], 0.5), **({} if k == "direct" else {
                               "c64_req_s": c64[k]["req_s"], "c64_p99_ms": c64[k]["p99_ms"],
                               "c64_cpu_us_per_req": c64[k]["cpu_us_per_req"]})}
                       for k in targets}  # fmt: skip
                print(f"round {r + 1}: {json.dumps(one)}", file=sys.stderr, flush=True)
                rounds.append(one)
            prof = profile(g["cgn_pid"], args.seconds, g["cgn_url"], g["key"], tmp, bases)
    results = {"rounds": rounds, "workers": workers, "mean": mean(rounds, cgns),
               "profile_cgn_c64": prof, "workload": args.workload}  # fmt: skip
    command = " ".join([".venv/bin/python bench/router_vs_smg.py", *sys.argv[1:]])
    name = "router_vs_smg" + ("" if args.workload == "chat" else f"_{args.workload}")
    write_result(name.replace("-", "_"), command, results, render(results))


def mean(rounds: list[dict[str, Any]], cgns: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for target in rounds[0]:
        out[target] = {m: round(statistics.fmean(r[target][m] for r in rounds), 3)
                       for m in rounds[0][target]}  # fmt: skip
    direct, smg = out["direct"], out["smg"]
    for name in (*cgns, "smg"):
        g = out[name]
        g["added_c1_p50_ms"] = round(g["c1_p50_ms"] - direct["c1_p50_ms"], 3)
        g["added_c1_p99_ms"] = round(g["c1_p99_ms"] - direct["c1_p99_ms"], 3)
    for name in cgns:
        out[f"{name}_over_smg_req_s"] = round(out[name]["c64_req_s"] / smg["c64_req_s"], 2)
        out[f"per_round_{name}_over_smg_req_s"] = [
            round(r[name]["c64_req_s"] / r["smg"]["c64_req_s"], 2) for r in rounds
        ]
        out[f"{name}_cpu_over_smg"] = round(
            out[name]["c64_cpu_us_per_req"] / smg["c64_cpu_us_per_req"], 2
        )
    return out


def render(r: dict[str, Any]) -> str:
    m = r["mean"]
    lines = [
        f"Mean of {len(r['rounds'])} alternating rounds; nothing pinned (2 cores shared by "
        "engine, gateways and wrk).",
        "",
        "| gateway | added c=1 p50 / p99 ms | c=64 req/s | c=64 p99 ms | c=64 CPU µs/req "
        "| 64-token stream p50 ms |",
        "|---|---|---:|---:|---:|---:|",
    ]
    cgns = [f"cgn{n}" for n in r["workers"]]
    labels = [(f"cgn{n}", f"cgn-router --workers {n} (auth, admission, tokenize, hash, score)")
              for n in r["workers"]]  # fmt: skip
    for name, label in (*labels, ("smg", "smg --policy cache_aware")):
        g = m[name]
        lines.append(f"| {label} | {g['added_c1_p50_ms']} / {g['added_c1_p99_ms']} | "
                     f"{g['c64_req_s']:.0f} | {g['c64_p99_ms']} | "
                     f"{g['c64_cpu_us_per_req']:.0f} | {g['stream64_p50_ms']} |")  # fmt: skip
    d = m["direct"]
    lines += [
        f"| (the engine itself) | c=1 p50 {d['c1_p50_ms']} ms | | | | {d['stream64_p50_ms']} |",
        "",
    ]
    for name in cgns:
        lines.append(
            f"cgn-router --workers {name[3:]} / smg requests/s at c=64: "
            f"**{m[f'{name}_over_smg_req_s']}x** (per round: "
            f"{', '.join(map(str, m[f'per_round_{name}_over_smg_req_s']))}); CPU per "
            f"request {m[f'{name}_cpu_over_smg']}x smg's."
        )
    prof = r["profile_cgn_c64"]
    if isinstance(prof, list):
        lines += ["", f"cgn-router --workers {r['workers'][0]} CPU profile at c=64 (py-spy, % "
                  "of samples):", "",
                  "| function | self % | total % |", "|---|---:|---:|"]  # fmt: skip
        lines += [f"| `{e['function']}` | {e['self_pct']} | {e['total_pct']} |" for e in prof]
    else:
        lines += ["", f"Profile: {prof}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
