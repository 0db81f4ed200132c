"""The layer pipeline (cgn_infer/pipeline): a model split by layers across real processes.

Stages are real `cgn-infer stage` processes on loopback (and, where this test may create
them, in a network namespace behind a veth pair with mutual TLS); heads run in this
process through `load_model`, as `cgn-infer serve --stages` builds them, or as a served
process behind the official openai client. With float32 activations a pipeline computes
exactly what one process does (logits compared at tolerance 0); float16 and int8 are
measured against that (their figures on the GGUF kernels are in bench/results/pipeline.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from cgn_core.bundled_models import qwen_coder_05b, smollm2
from cgn_core.errors import ConfigError
from cgn_core.settings import TlsSettings
from cgn_infer.backends.base import BackendLost
from cgn_infer.backends.paged import BatchItem, layout
from cgn_infer.loader import load_model
from cgn_infer.pipeline import wire
from cgn_infer.pipeline.head import _split
from cgn_infer.settings import InferSettings, PipelineSettings
from cgn_proto.cognitora.v1 import pipeline_pb2 as pb
from harness.procs import BIN, cgn_infer, cgn_infer_stages, stop

pytestmark = pytest.mark.slow  # real multi-process runs: not in the fast loop

# ---- the wire, ranges and rows (pure) -----------------------------------------------------


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_activations_round_trip_within_their_precision(dtype: str) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(0, 2, (5, 64)).astype(np.float32)
    x[0, 3] = 21659.7  # an outlier like SmolLM2's first row
    h = wire.encode(x, wire.ACTIVATIONS[dtype])
    y = wire.decode(pb.Hidden.FromString(h.SerializeToString()), 64)
    assert y.shape == x.shape and y.dtype == np.float32
    per_value = {"f32": 4, "f16": 2, "int8": 1 + 2 / wire.GROUP}[dtype]
    apart = 4 * wire.OUTLIERS * 5 if dtype == "int8" else 0  # (column, value) per outlier
    assert len(h.data) + len(h.scales) + len(h.outliers) == x.size * per_value + apart
    if dtype == "f32":
        assert np.array_equal(x, y)
    elif dtype == "f16":
        assert np.abs(y - x).max() <= np.abs(x).max() * 2**-11
    else:  # half a step of each group's scale once the outliers are apart
        assert y[0, 3] == np.float32(np.float16(21659.7))  # the outlier, as float16
        rest = np.abs(x).copy()
        np.put_along_axis(rest, np.argsort(-rest, axis=1)[:, : wire.OUTLIERS], 0, 1)
        groups = rest.reshape(5, -1, wire.GROUP).max(axis=2) / 127
        bound = np.repeat(groups, wire.GROUP, axis=1) * 0.5 * 1.002 + 2**-10 * np.abs(x)
        assert (np.abs(y - x) <= bound + 1e-6).all()
        assert np.abs(np.delete(y[0] - x[0], 3)).max() < 0.1  # nor does it spoil its neighbours


def int8(good: pb.Hidden, **change: Any) -> pb.Hidden:
    h = pb.Hidden()
    h.CopyFrom(good)
    for key, value in change.items():
        setattr(h, key, value)
    return h


def test_malformed_activations_are_errors_that_say_why() -> None:
    good = wire.encode(np.ones((2, 32), np.float32), pb.ACTIVATIONS_INT8)
    cases = [
        (pb.Hidden(dtype=pb.ACTIVATIONS_F16, rows=2, cols=32, data=b"\0" * 10), "carry 10 bytes"),
        (pb.Hidden(dtype=7, rows=1, cols=32), "unknown activation type"),
        (pb.Hidden(dtype=pb.ACTIVATIONS_F32, rows=1, cols=16, data=b"\0" * 64), "16 wide"),
        (pb.Hidden(dtype=pb.ACTIVATIONS_INT8, rows=2, cols=32, data=good.data), "0 scales"),
        (int8(good, scales=np.full(2, np.inf, "<f2").tobytes()), "non-finite"),
        (int8(good, outliers=good.outliers[:-1]), "outlier bytes"),
        (int8(good, outliers=b"\xff\x00" + good.outliers[2:]), "names column 255 of 32"),
    ]
    for msg, why in cases:
        with pytest.raises(wire.WireError, match=why):
            wire.decode(msg, 32)


@pytest.mark.parametrize(
    ("parts", "error"),
    [
        ([(0, 15), (15, 30)], None),
        ([(0, 10), (10, 20), (20, 30)], None),
        ([(0, 0), (0, 30)], None),  # a head with the ends only
        ([(0, 12), (15, 30)], "layers 12:15 are served by nobody"),
        ([(0, 16), (15, 30)], "layers 15:16 are served twice"),
        ([(0, 15), (15, 29)], "layers 29:30 are served by nobody"),
        ([(0, 15), (15, 30), (30, 30)], "serves no layers"),
        ([(0, 20), (10, 30)], "layers 10:20 are served twice"),
    ],
)
def test_layer_ranges_must_tile_the_model(parts: list[tuple[int, int]], error: str | None) -> None:
    named = [("the head", parts[0])] + [(f"stage s{i}", p) for i, p in enumerate(parts[1:])]
    if error is None:
        wire.check_tiling(30, named)
    else:
        with pytest.raises(ConfigError, match=error):
            wire.check_tiling(30, named)


@pytest.mark.parametrize("text", ["15", "a:b", "20:10", "-1:4", ""])
def test_bad_layer_ranges_name_the_expected_form(text: str) -> None:
    with pytest.raises(ConfigError, match="expected FIRST:END"):
        wire.parse_layers(text)


def test_a_balanced_split_minimises_the_largest_part(float32_smollm2: Any) -> None:
    """Brute force over every 2- and 3-way cut agrees; the head carries the embedding."""
    import itertools

    gguf = float32_smollm2[0]
    per, rest = wire.layer_bytes(gguf, 30)
    assert rest > 10 * per[0]  # SmolLM2's embedding and LM head: most of a third of the file

    def worst(bounds: list[int]) -> int:
        spans = list(itertools.pairwise([0, *bounds, 30]))
        return max(sum(per[a:b]) + (rest if i == 0 else 0) for i, (a, b) in enumerate(spans))

    for parts in (2, 3):
        split = wire.balanced_split(gguf, 30, parts)
        assert split[0][0] == 0 and split[-1][1] == 30
        assert all(a < b for a, b in split[1:])  # every stage has a layer
        wire.check_tiling(30, [(str(i), s) for i, s in enumerate(split)])
        best = min(worst(list(c)) for c in itertools.combinations(range(31), parts - 1)
                   if all(b > a for a, b in itertools.pairwise([*c, 30])))  # fmt: skip
        assert worst([a for a, _ in split[1:]]) == best
    assert wire.balanced_split(gguf, 30, 2) == [(0, 8), (8, 30)]  # 49.5 % and 50.5 %


def test_rows_that_reach_outside_the_pool_or_context_are_refused() -> None:
    ok = wire.rows_to_items([pb.Row(n_tokens=3, start=5, table=[0, 1])], 4, 64)
    assert [(len(i.tokens), i.start, list(i.table)) for i in ok] == [(3, 5, [0, 1])]
    for rows, why in [
        ([pb.Row(n_tokens=1, start=0, table=[4])], "outside the pool of 4"),
        ([pb.Row(n_tokens=2, start=63, table=[0])], "past the context"),
        ([pb.Row(n_tokens=0, start=0, table=[0])], "no tokens"),
        ([], "no rows"),
    ]:
        with pytest.raises(wire.WireError, match=why):
            wire.rows_to_items(rows, 4, 64)


def test_micro_batches_split_rows_in_order() -> None:
    items = [BatchItem([i], i, [0]) for i in range(7)]
    assert [[i.start for i in g] for g in _split(items, 3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert len(_split(items[:2], 4)) == 2 and len(_split(items, 1)) == 1


# ---- the wire format's effect, in process (float32 weights: the wire is the only rounding) --


def greedy(backend: Any, prompt: list[int], n: int) -> list[int]:
    cache = backend.new_cache(len(prompt) + n + 1)
    logits, out = backend.forward(prompt, 0, cache), []
    for i in range(n):
        out.append(int(logits.argmax()))
        logits = backend.forward([out[-1]], len(prompt) + i, cache)
    return out


class WireParts:
    """Head and tail parts in this process with `wire` encode/decode between them: the
    arithmetic of a two-part pipeline without its processes (for the precision tests)."""

    def __init__(self, gguf: Any, args: Any, split: int, activations: str, weights: str):
        from cgn_infer.backends.torch_backend import TorchBackend

        self.head = TorchBackend(gguf, args, layers=(0, split), weights=weights, threads=2)
        self.tail = TorchBackend(gguf, args, layers=(split, args.n_layers), ends=False,
                                 weights=weights, threads=2)  # fmt: skip
        self.dtype, self.dim = wire.ACTIVATIONS[activations], args.dim

    def logits(self, prompt: list[int], kvs: tuple[Any, Any], start: int = 0) -> np.ndarray:
        import torch

        table = list(range(64))
        lay = layout([BatchItem(prompt, start, table)])
        x = self.head.run_layers(self.head.embed(lay), lay, kvs[0]).numpy()
        y = wire.decode(wire.encode(x, self.dtype), self.dim)
        z = self.tail.run_layers(torch.from_numpy(y), lay, kvs[1])
        return self.head.logits(z, None)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        kvs = (self.head.new_kv(64), self.tail.new_kv(64))
        logits, out = self.logits(prompt, kvs)[-1], []
        for i in range(n):
            out.append(int(logits.argmax()))
            logits = self.logits([out[-1]], kvs, len(prompt) + i)[-1]
        return out


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
           "The three laws of thermodynamics are", "List five fruits:"]  # fmt: skip


@pytest.fixture(scope="module")
def float32_smollm2() -> Iterator[tuple[Any, Any, Any]]:
    from cgn_core.text.gguf_file import GGUFFile
    from cgn_core.text.prompt import PromptCodec
    from cgn_infer.backends.torch_backend import TorchBackend
    from cgn_infer.models import args_from_gguf

    with GGUFFile(smollm2()) as gguf:
        args = args_from_gguf(gguf)
        whole = TorchBackend(gguf, args, weights="float32", threads=2)
        yield gguf, whole, PromptCodec.from_gguf(gguf).tokenizer


def test_f16_activations_keep_greedy_output_identical(float32_smollm2: Any) -> None:
    gguf, whole, tok = float32_smollm2
    parts = WireParts(gguf, whole.args, 15, "f16", "float32")
    for text in PROMPTS[:2]:
        ids = tok.encode(text)
        assert parts.greedy(ids, 12) == greedy(whole, ids, 12), text


def test_int8_activations_agree_with_f16_on_99_percent_of_top1(float32_smollm2: Any) -> None:
    """Teacher-forced over 384 tokens of this repository's README (a real text)."""
    gguf, whole, tok = float32_smollm2
    ids = tok.encode((Path(__file__).parents[1] / "README.md").read_text()[:2500])[:384]
    out = {}
    for act in ("f16", "int8"):
        parts = WireParts(gguf, whole.args, 15, act, "float32")
        out[act] = parts.logits(ids, (parts.head.new_kv(64), parts.tail.new_kv(64)))
    agree = float((out["int8"].argmax(1) == out["f16"].argmax(1)).mean())
    err = float(np.abs(out["int8"] - out["f16"]).max())
    print(f"\nint8 vs f16: top-1 agreement {agree:.4f}, max logit error {err:.3f}")
    assert agree >= 0.99 and err < 5


# ---- real stage processes ------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_stages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """SmolLM2 (30 layers): stages 15:30 (a 2-way split), 10:20 and 20:30 (3-way)."""
    spans = ["15:30", "10:20", "20:30"]
    with cgn_infer_stages(tmp_path_factory.mktemp("stages"), spans) as stages:
        yield {span: s.address for span, s in zip(spans, stages, strict=True)}


OPENED: list[Any] = []  # models loaded by the tests below, closed after the module


@pytest.fixture(scope="module", autouse=True)
def _close_models() -> Iterator[None]:
    yield
    for loaded in OPENED:
        for client, _ in getattr(loaded.backend, "stages", []):
            client.close()
        loaded.gguf.close()
    OPENED.clear()


def load(settings: InferSettings) -> Any:
    OPENED.append(loaded := load_model(settings))
    return loaded.backend


def head(stages: list[str], activations: str = "f32", **extra: Any) -> Any:
    extra.setdefault("connect_timeout_s", 20)
    p = PipelineSettings(stages=tuple(stages), activations=activations, **extra)  # type: ignore[arg-type]
    return load(InferSettings(model=smollm2(), threads=2, pipeline=p))


def batched_logits(backend: Any, prompts: list[list[int]]) -> np.ndarray:
    """A prompt step and a decode step over several sequences at once (micro-batched)."""
    kv = backend.new_kv(64)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    items = [BatchItem(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    first = backend.forward_batch(items, kv, all_logits=True)
    nxt = [BatchItem([7], len(p), t) for p, t in zip(prompts, tables, strict=True)]
    return np.concatenate([first, backend.forward_batch(nxt, kv)])


@pytest.mark.parametrize("split", [["15:30"], ["10:20", "20:30"]], ids=["2-way", "3-way"])
def test_f32_pipeline_computes_exactly_what_one_process_does(
    smollm2_torch: Any, smollm2_stages: dict[str, str], split: list[str]
) -> None:
    pipe = head([smollm2_stages[s] for s in split])
    assert pipe.local.end == int(split[0].split(":")[0])
    rng = np.random.default_rng(3)
    prompts = [rng.integers(100, 20000, n).tolist() for n in (37, 5, 70, 16)]
    got = batched_logits(pipe, prompts)
    want = batched_logits(smollm2_torch, prompts)
    assert np.array_equal(got, want)  # tolerance 0: batch-invariant kernels, exact wire
    ids = [1, 504, 3458, 282, 4649, 314]
    assert greedy(pipe, ids, 16) == greedy(smollm2_torch, ids, 16)
    c = pipe.stages[0][0]
    assert c.sent_bytes > 0 and c.received_bytes > 0


def test_an_mlx_head_drives_a_torch_stage(
    smollm2_torch: Any, smollm2_stages: dict[str, str]
) -> None:
    """The wire does not depend on the backend: a Mac's MLX head with a Linux torch stage
    (f16 activations) answers as one torch process does (MLX alone matches torch's greedy
    output: test_mlx_backend)."""
    pytest.importorskip("mlx.core", reason="the mlx extra is not installed")
    p = PipelineSettings(stages=(smollm2_stages["15:30"],), connect_timeout_s=20)
    pipe = load(InferSettings(model=smollm2(), backend="mlx", pipeline=p))
    assert pipe.local.name == "mlx" and pipe.stages[0][1].backend == "torch"
    # MLX on a Linux CPU takes ~0.2 s a prompt token: a short chat prompt
    ids = [1, 4093, 198, 1780, 314, 216, 39, 1711, 216, 38, 47, 2, 198, 1, 520, 9531, 198]
    got = pipe.forward(ids, 0, pipe.new_cache(32), all_logits=True)
    want = smollm2_torch.forward(ids, 0, smollm2_torch.new_cache(32), all_logits=True)
    agree = float((got.argmax(1) == want.argmax(1)).mean())
    print(
        f"\nMLX head + torch stage vs torch: top-1 {agree:.3f}, max |dlogit| "
        f"{np.abs(got - want).max():.3f}"
    )
    assert agree >= 0.9 and greedy(pipe, ids, 6) == greedy(smollm2_torch, ids, 6)


def test_bad_tilings_are_refused_before_loading(smollm2_stages: dict[str, str]) -> None:
    s = smollm2_stages
    for stages, layers, why in [
        ([s["10:20"], s["20:30"]], "0:12", "layers 10:12 are served twice"),
        ([s["20:30"]], "0:15", "layers 15:20 are served by nobody"),
        ([s["10:20"]], "", "layers 20:30 are served by nobody"),
        ([s["20:30"], s["10:20"]], "0:10", "layers 10:20 are served by nobody"),  # out of order
    ]:
        with pytest.raises(ConfigError, match=why):
            head(stages, layers=layers)
    with pytest.raises(ConfigError, match="did not answer within"):
        head(["127.0.0.1:1"], connect_timeout_s=0.5)


def test_served_head_answers_like_one_engine(
    smollm2_stages: dict[str, str], smollm2_torch: Any, smollm2_gguf: Any, tmp_path: Path
) -> None:
    """`cgn-infer serve --stages` behind the official client: a completion of a token prompt
    is one process's greedy answer, token for token; chat works streamed and whole; the
    head's /metrics count the bytes each way."""
    from cgn_core.text.tokenizer import GGUFTokenizer

    stage = smollm2_stages["15:30"]
    with cgn_infer(tmp_path, "--stages", stage, "--activations", "f32",
                   "--model-name", "smollm2") as url:  # fmt: skip
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        ids = [1, 504, 3458, 282, 4649, 314, 253, 2184]
        out = client.completions.create(model="smollm2", prompt=ids, max_tokens=12,
                                        temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        tok = GGUFTokenizer(smollm2_gguf)
        assert out.choices[0].text == tok.decode(greedy(smollm2_torch, ids, 12))
        chat = [{"role": "user", "content": "Count to five."}]
        whole = client.chat.completions.create(model="smollm2", messages=chat,  # type: ignore[arg-type]
                                               max_tokens=10, temperature=0)  # fmt: skip
        streamed = client.chat.completions.create(model="smollm2", messages=chat,  # type: ignore[arg-type]
                                                  max_tokens=10, temperature=0, stream=True)  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in streamed)
        assert text == whole.choices[0].message.content and text
        metrics = httpx.get(f"{url}/metrics").text
        for way in ("out", "in"):
            line = f'cgn_infer_pipeline_bytes_total{{direction="{way}",stage="{stage}"}}'
            assert float(metrics.split(line)[1].split()[0]) > 0, (line, metrics)


def test_qwen_split_two_ways_is_exact(tmp_path: Path) -> None:
    qwen = qwen_coder_05b()
    with cgn_infer_stages(tmp_path, ["12:24"], model=qwen) as [stage]:
        p = PipelineSettings(stages=(stage.address,), activations="f32", connect_timeout_s=20)
        pipe = load(InferSettings(model=qwen, threads=2, pipeline=p))
        whole = load(InferSettings(model=qwen, threads=2))
        ids = [14990, 11, 1879, 0, 3555, 374, 220, 17, 10, 17, 30]
        assert np.array_equal(pipe.forward(ids, 0, pipe.new_cache(64), all_logits=True),
                              whole.forward(ids, 0, whole.new_cache(64), all_logits=True))  # fmt: skip
        assert greedy(pipe, ids, 8) == greedy(whole, ids, 8)


# ---- two "hosts": a network namespace, a veth pair, mutual TLS --------------------------------

NS = f"cgnpipe{os.getpid() % 100000}"
HEAD_IP, STAGE_IP = "10.231.0.1", "10.231.0.2"


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "creating a network namespace needs root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    return None


@pytest.fixture(scope="module")
def other_host() -> Iterator[str]:
    """A network namespace joined to this one by a veth pair: the stage's "host"."""
    if why := _netns_unavailable():
        pytest.skip(why)
    cmds = [
        f"ip netns add {NS}",
        f"ip link add {NS}a type veth peer name {NS}b",
        f"ip link set {NS}b netns {NS}",
        f"ip addr add {HEAD_IP}/30 dev {NS}a",
        f"ip link set {NS}a up",
        f"ip netns exec {NS} ip addr add {STAGE_IP}/30 dev {NS}b",
        f"ip netns exec {NS} ip link set {NS}b up",
        f"ip netns exec {NS} ip link set lo up",
    ]
    try:
        for cmd in cmds:
            res = subprocess.run(cmd.split(), capture_output=True, text=True, timeout=10)
            if res.returncode != 0:
                pytest.skip(f"`{cmd}` failed here: {res.stderr.strip()}")
        yield NS
    finally:
        subprocess.run(["ip", "link", "del", f"{NS}a"], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True, timeout=10)


def test_a_stage_on_another_host_over_mutual_tls(
    other_host: str, smollm2_torch: Any, tmp_path: Path
) -> None:
    """Real TCP across a veth pair; the stage serves only the head its flags name (CN)."""
    from cgn_core import pki

    ca = pki.create_ca()
    pki.write_pair(tmp_path, "ca", ca)
    pki.write_pair(tmp_path, "stage-node", pki.issue(ca, "stage-node", "infer", [STAGE_IP]))
    for node in ("head-node", "intruder"):
        pki.write_pair(tmp_path, node, pki.issue(ca, node, "infer", [HEAD_IP]))
    tls = [a for f, n in (("ca", "ca"), ("cert", "stage-node"), ("key", "stage-node"))
           for a in ("--set", f"tls.{f}_file={tmp_path / n}.{'key' if f == 'key' else 'pem'}")]  # fmt: skip
    wrap = ("ip", "netns", "exec", other_host)
    with cgn_infer_stages(tmp_path, ["15:30"], "--head", "head-node", *tls, host=STAGE_IP,
                          wrap=wrap) as [stage]:  # fmt: skip

        def as_node(node: str) -> Any:
            t = TlsSettings(ca_file=tmp_path / "ca.pem", cert_file=tmp_path / f"{node}.pem",
                            key_file=tmp_path / f"{node}.key")  # fmt: skip
            p = PipelineSettings(stages=(stage.address,), activations="f32", connect_timeout_s=20)
            return load(InferSettings(model=smollm2(), threads=2, pipeline=p, tls=t))

        pipe = as_node("head-node")
        ids = [1, 504, 3458, 282, 4649, 314, 253, 2184]
        assert np.array_equal(pipe.forward(ids, 0, pipe.new_cache(32), all_logits=True),
                              smollm2_torch.forward(ids, 0, smollm2_torch.new_cache(32),
                                                    all_logits=True))  # fmt: skip
        with pytest.raises(ConfigError, match=r"serves head 'head-node'.*'intruder'"):
            as_node("intruder")
        plain = PipelineSettings(stages=(stage.address,), connect_timeout_s=5)
        with pytest.raises(ConfigError, match=stage.address):  # no certificate at all
            load(InferSettings(model=smollm2(), threads=2, pipeline=plain))


# ---- the command line ----------------------------------------------------------------------


def test_stage_and_head_flags_are_checked_in_one_line(tmp_path: Path) -> None:
    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(BIN / "cgn-infer"), *argv], capture_output=True, text=True,
                              timeout=60)  # fmt: skip

    for argv, why in [
        (["stage", "--model", "smollm2"], "a stage needs its layers"),
        (["stage", "--model", "smollm2", "--part", "2/2"], "expected I/N with 1 <= I < N"),
        (["stage", "--model", "smollm2", "--layers", "20:40"], "has 30 layers"),
        (
            ["stage", "--model", "smollm2", "--layers", "0:4", "--set", "tls.ca_file=/x"],
            "--head NODE_ID",
        ),
        (["serve", "--model", "smollm2", "--stages", "a:1", "--kvcached", "h:1"], "cgn-kvcached"),
        (["serve", "--model", "smollm2", "--stages", "a:1", "--activations", "f8"], "f16"),
        (["serve", "--model", "smollm2", "--stages", ":9101"], "expected host:port, got :9101"),
        (["serve", "--model", "smollm2", "--stages", "a:0"], "expected host:port, got a:0"),
    ]:
        res = run(*argv)
        assert res.returncode == 2, (argv, res.stdout, res.stderr)
        assert why in res.stderr and "Traceback" not in res.stderr, (argv, res.stderr)
        assert len(res.stderr.strip().splitlines()) <= 2, res.stderr


def test_a_stage_by_part_serves_new_head_streams_and_stops_cleanly(
    tmp_path: Path, smollm2_torch: Any
) -> None:
    """`--part 1/2`: stage and head agree on the balanced split without naming a layer; a
    head's second opening resets the stage's pool; SIGTERM stops the stage cleanly and the
    head then reports the stage lost."""
    with cgn_infer_stages(tmp_path, [""], "--part", "1/2") as [stage]:
        pipe = head([stage.address])
        assert (pipe.local.first, pipe.local.end) == (0, 8)
        assert (pipe.stages[0][1].first_layer, pipe.stages[0][1].end_layer) == (8, 30)
        ids = [1, 504, 3458, 282]
        want = smollm2_torch.forward(ids, 0, smollm2_torch.new_cache(16))
        for _ in range(2):  # new_cache opens the stages again each time
            assert np.array_equal(pipe.forward(ids, 0, pipe.new_cache(16)), want)
        stale = pipe.new_kv(4)
        pipe.new_kv(4)
        with pytest.raises(ValueError, match="earlier opening"):
            pipe.forward_batch([BatchItem(ids, 0, [0])], stale)
        cache = pipe.new_cache(16)
        stop(stage.proc)
        assert stage.proc.returncode == 0
        with pytest.raises(BackendLost):
            pipe.forward(ids, 0, cache)
        assert pipe.lost is not None and stage.address in pipe.lost
        with pytest.raises(ConfigError, match=f"pipeline stage {stage.address}"):
            pipe.new_cache(16)  # opening a pool on a stage that is gone: one line at start
    assert list(tmp_path.glob("stage-*.ready")) == [], "a clean stop removes the ready file"
