"""The benchmarks' entry points without a GPU: each one that needs CUDA says so in one line
(exit status 2, no traceback); ``bench.cpu`` measures on the CPU (a tiny shape here); ``bench.serve``'s
client reads both servers' streams (canned ones, then our server and transformers serve on CPU)."""

import asyncio
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import serve as bench_serve
from modeling import QwenTokenizer
from modeling.model.random_checkpoint import build_random_checkpoint, build_word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CUDA_ONLY = ("cuda_suite", "decode", "decode_layers", "fp8", "fused_decode", "gated_delta_rule", "generate", "host",
             "loss", "moe", "ops", "prefill", "serve", "train")


@pytest.mark.parametrize("name", CUDA_ONLY)
def test_cuda_benchmarks_say_they_need_a_gpu(name, monkeypatch, capsys):
    module = importlib.import_module(f"bench.{name}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", [f"bench/{name}.py"])
    with pytest.raises(SystemExit) as e:
        module.main()
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"error: python -m bench.{name} needs a CUDA GPU") and err.count("\n") == 1, err


def test_cuda_suite_sizes_its_processes_from_free_memory_and_cores():
    """bench.cuda_suite's processes per GPU: one that may run a heavy test beside ordinary ones, as
    many as the free memory holds without overcommitting it, and no more than the host's cores feed."""
    from bench.cuda_suite import GIB, HEAVY_BYTES, PROCESS_BYTES, processes_per_gpu

    assert processes_per_gpu(int(79.1 * GIB), 16) == 8  # an 80 GB H100 on 16 cores
    assert processes_per_gpu(int(79.1 * GIB), 24) == 8  # ... on more cores: its memory decides
    assert processes_per_gpu(int(139.5 * GIB), 16) == 8  # an H200: the cores decide
    assert processes_per_gpu(int(60 * GIB), 128 // 8) == 5  # a GPU of which 60 GB are free
    assert processes_per_gpu(20 * GIB, 16) == 1 and processes_per_gpu(0, 16) == 1
    assert processes_per_gpu(None, 2) == 1 and processes_per_gpu(None, 9) == 4  # no GPU: the cores alone
    for free in range(0, 200 * GIB, GIB):
        n = processes_per_gpu(free, 64)
        assert n == 1 or HEAVY_BYTES + (n - 1) * PROCESS_BYTES <= free, (free, n)


def test_cuda_suite_cuts_whole_files_into_pieces_heaviest_first():
    """Without recorded times (each test weighs 1): every test once; a file of at most len(ids) / 2n
    tests is one piece; a longer one is cut into contiguous pieces of at most that; pieces come
    heaviest first, each in collection order."""
    from bench.cuda_suite import pieces

    sizes = {"a": 11, "b": 4, "c": 3, "d": 1, "e": 1}
    ids = [f"tests/test_{f}.py::t[{i}]" for f, k in sizes.items() for i in range(k)]
    queue = pieces(ids, 3)
    assert sorted(sum(queue, [])) == sorted(ids) and len(sum(queue, [])) == len(ids)
    limit = len(ids) / 6
    for piece in queue:
        assert piece == sorted(piece, key=ids.index) and len(piece) <= limit
        assert len({node.split("::")[0] for node in piece}) == 1
    assert [len(p) for p in queue] == sorted((len(p) for p in queue), reverse=True)
    for f, count in (("a", 4), ("b", 2), ("c", 1), ("d", 1), ("e", 1)):  # pieces of at most 3.33 tests
        assert sum(any(f"test_{f}.py" in i for i in p) for p in queue) == count, f


def test_cuda_suite_weighs_pieces_by_recorded_seconds(tmp_path):
    """With an earlier run's seconds: a slow test is a piece alone and comes first, a file's tests
    stay together up to total / 2n seconds, an unrecorded test weighs the median."""
    from bench.cuda_suite import pieces, recorded_seconds

    ids = [f"tests/test_slow.py::t[{i}]" for i in range(2)] + [f"tests/test_fast.py::t[{i}]" for i in range(12)]
    ids.append("tests/test_new.py::t")
    times = tmp_path / "times.tsv"
    times.write_text("".join(f"{60.0 if 'slow' in node else 5.0}\t0\t{node}\n" for node in ids[:-1]) + "junk\n")
    seconds = recorded_seconds(times)
    assert len(seconds) == 14 and seconds[ids[0]] == 60.0
    queue = pieces(ids, 3, seconds)  # 185 s: pieces of at most 30.8 s, but a 60 s test alone
    assert queue[:2] == [[ids[0]], [ids[1]]]
    assert [sum(seconds.get(n, 5.0) for n in p) for p in queue[2:]] == [30.0, 30.0, 5.0]
    assert sorted(sum(queue, [])) == sorted(ids)
    assert recorded_seconds(tmp_path / "missing.tsv") == {}


def test_cuda_suite_queue_runs_each_piece_once_and_cuts_at_the_deadline():
    """run_queue: each piece starts once, on at most `slots` slots at once, a freed slot takes the
    next; at the deadline a running piece is stopped ("cut") and the rest never start."""
    from bench.cuda_suite import run_queue

    started, running = [], set()

    class Piece:  # a process that ends on its third poll, with exit status piece % 2
        def __init__(self, piece):
            self.piece, self.polls, self.returncode = piece, 0, None

        def poll(self):
            self.polls += 1
            if self.polls == 3:
                self.returncode = self.piece % 2
                running.discard(self.piece)
            return self.returncode

    def start(piece, slot):
        started.append((piece, slot))
        running.add(piece)
        assert len(running) <= 2
        return Piece(piece)

    ran = run_queue(start, 5, 2, timeout=120, poll=0.001, stop=lambda proc: pytest.fail("nothing was cut"))
    assert sorted(p for p, _ in started) == [0, 1, 2, 3, 4] and {s for _, s in started} <= {0, 1}
    assert [r.status for r in ran] == ["exit 0", "exit 1", "exit 0", "exit 1", "exit 0"] and not running

    class Stuck:
        returncode = None

        def poll(self):
            return None

    stopped = []
    ran = run_queue(lambda piece, slot: Stuck(), 3, 1, timeout=0.05, poll=0.001, stop=stopped.append)
    assert ran[0].status == "cut" and ran[1:] == [None, None] and len(stopped) == 1


def test_failed_reports_are_written_as_they_fail(tmp_path, monkeypatch):
    """With QWEN_TEST_FAILURES set, a failed phase's report is appended at once (a piece cut later
    keeps it); passing phases write nothing."""
    from types import SimpleNamespace

    from tests import conftest

    path = tmp_path / "failures"
    monkeypatch.setenv("QWEN_TEST_FAILURES", str(path))
    conftest.pytest_runtest_logreport(SimpleNamespace(nodeid="t.py::ok", when="call", failed=False, duration=0.1,
                                                      longreprtext=""))
    assert not path.exists()
    conftest.pytest_runtest_logreport(SimpleNamespace(nodeid="t.py::bad", when="call", failed=True, duration=0.1,
                                                      longreprtext="assert 1 == 2"))
    assert path.read_text() == "===== t.py::bad (call)\nassert 1 == 2\n"


def test_test_times_are_written_as_each_test_ends(tmp_path, monkeypatch):
    """tests/conftest.py appends a test's setup + call + teardown seconds when its teardown ends
    (QWEN_TEST_TIMES set), nothing without the variable; bench.cuda_suite lists the slowest."""
    from types import SimpleNamespace

    from bench.cuda_suite import slowest
    from tests import conftest

    path = tmp_path / "times"
    for phase, sec in (("setup", 0.5), ("call", 2.0), ("teardown", 0.25)):
        conftest.pytest_runtest_logreport(SimpleNamespace(nodeid="t.py::x", when=phase, duration=sec))
    assert not path.exists()
    monkeypatch.setenv("QWEN_TEST_TIMES", str(path))
    for node, call in (("t.py::slow", 7.0), ("t.py::fast", 0.1)):
        for phase, sec in (("setup", 0.5), ("call", call), ("teardown", 0.25)):
            conftest.pytest_runtest_logreport(SimpleNamespace(nodeid=node, when=phase, duration=sec))
            assert (path.read_text() if path.exists() else "").count(node) == (phase == "teardown")
    assert path.read_text().splitlines() == ["7.75\tt.py::slow", "0.85\tt.py::fast"]
    tsv = tmp_path / "times.tsv"
    tsv.write_text("0.85\t1\tt.py::fast\n7.75\t0\tt.py::slow\n")
    assert slowest(tsv, 1) == ["| 7.8 | 0 | t.py::slow |"]


def test_gpu_memory_lock_makes_heavy_tests_take_turns(tmp_path, monkeypatch):
    """With QWEN_GPU_LOCK set (bench.cuda_suite sets it per GPU), a second holder waits until the
    first lets go; without it the lock does nothing."""
    import threading

    from tests.helpers import gpu_memory_lock

    with gpu_memory_lock():
        pass  # no QWEN_GPU_LOCK: nothing to wait for
    monkeypatch.setenv("QWEN_GPU_LOCK", str(tmp_path / "gpu0.lock"))
    entered = threading.Event()

    def second():
        with gpu_memory_lock():
            entered.set()

    with gpu_memory_lock():
        t = threading.Thread(target=second)
        t.start()
        t.join(0.3)
        assert not entered.is_set(), "the second holder did not wait"
    t.join(10)
    assert entered.is_set()


def test_cpu_benchmark_runs_a_small_shape(tmp_path):
    """bench.cpu on a 2-layer model, on the path it measures (the reference ops: no TRITON_INTERPRET):
    every row measured, the same logits as transformers."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "bench.cpu", "--shape", "small", "--layers", "2", "--context", "8", "--steps", "1",
           "--prompt", "4", "--cache-lens", "16", "32", "--rounds", "1", "--out", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    table = (tmp_path / "cpu.md").read_text()
    assert "ours: PyTorch reference ops (CPU)" in table
    for row in ("decode, ours, max_model_len 16", "decode, ours, max_model_len 32", "decode, transformers (DynamicCache)",
                "prefill, ours", "prefill, transformers"):
        assert f"| {row} |" in table
    diff = float(re.search(r"max \|logit diff\| ([0-9.e+-]+)", table).group(1))
    assert diff < 1e-3, table


def _sse(*events: str) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


OURS_STREAM = _sse('{"choices":[{"index":0,"text":"bababa","finish_reason":null}],"usage":null}',
                   '{"choices":[{"index":0,"text":" bababe","finish_reason":"length"}],"usage":null}',
                   '{"choices":[],"usage":{"prompt_tokens":256,"completion_tokens":2,"total_tokens":258}}',
                   "[DONE]")
PEER_STREAM = _sse('{"choices":[{"index":0,"text":"bababa"}]}', '{"choices":[{"index":0,"text":" bababe"}]}',
                   '{"choices":[{"finish_reason":"length","index":0,"text":""}],'
                   '"usage":{"completion_tokens":2,"prompt_tokens":256,"total_tokens":258}}')


def _one(status: int, body: bytes):
    """``bench.serve.RawClient.one`` against a socket server that answers with ``body``: chunked in
    two pieces split inside an event (status 200), or whole with a Content-Length."""
    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"POST /v1/completions HTTP/1.1")
        await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
        if status == 200:
            half = len(body) // 2
            chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:half], body[half:]))
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 %d Error\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body))
        await writer.drain()

    async def run():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = bench_serve.RawClient("127.0.0.1", server.sockets[0].getsockname()[1])
        try:
            return await client.one(bench_serve.request_body("m", "bababa"))
        finally:
            client.close()
            server.close()

    return asyncio.run(run())


@pytest.mark.parametrize("stream", [OURS_STREAM, PEER_STREAM], ids=["ours", "transformers"])
def test_serve_client_reads_usage_from_either_stream(stream):
    ttft, total, completion, prompt = _one(200, stream)
    assert 0 <= ttft <= total and (completion, prompt) == (2, 256)


@pytest.mark.parametrize("status, body, match", [
    (422, b'{"detail":"Unexpected fields in the request"}', "HTTP 422: .*Unexpected fields"),
    (200, _sse('{"error": "CB worker died"}'), "carried an error: CB worker died"),
    (200, _sse('{"choices":[{"index":0,"text":"x"}]}', "[DONE]"), "no usage"),
])
def test_serve_client_says_what_went_wrong(status, body, match):
    with pytest.raises(RuntimeError, match=match):
        _one(status, body)


def test_serve_client_processes_report_a_failure(monkeypatch):
    """A level spread over client processes says why one failed (here: nothing listens), at once."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(bench_serve, "CLIENTS_PER_PROCESS", 1)
    url = f"http://127.0.0.1:{bench_serve.free_port()}"
    with pytest.raises(RuntimeError, match="(?s)a client process failed:.*ConnectionRefusedError"):
        bench_serve.level(url, "m", ["a", "b"], 2)


def test_serve_summary_checks_every_response_ran_to_max_tokens():
    n, p = bench_serve.MAX_TOKENS, bench_serve.PROMPT_TOKENS
    stats = bench_serve.summarize([(0.1, 1.37, n, p), (0.3, 1.57, n, p)], wall=2.0)
    assert stats["ttft_p50_ms"] == pytest.approx(200) and stats["ttft_p99_ms"] == pytest.approx(300)
    assert stats["tpot_p50_ms"] == pytest.approx(10) and stats["tokens_per_s"] == pytest.approx(n)
    assert stats["requests_per_s"] == pytest.approx(1)
    with pytest.raises(ValueError, match=r"completion tokens \[100, 128\]"):
        bench_serve.summarize([(0.1, 1.0, n, p), (0.1, 1.0, 100, p)], wall=1.0)
    with pytest.raises(ValueError, match=r"prompt tokens \[255\]"):
        bench_serve.summarize([(0.1, 1.0, n, p - 1)], wall=1.0)


def test_serve_prompts_survive_the_text_round_trip():
    tok = QwenTokenizer(build_word_tokenizer(151936), [])
    ids, texts = bench_serve.make_prompts(tok, 4)
    assert [len(x) for x in ids] == [bench_serve.PROMPT_TOKENS] * 4 and min(min(x) for x in ids) >= 1
    assert [tok.encode(t) for t in texts] == ids
    assert [bench_serve.requests_at(c, 4, 8) for c in (1, 16, 64)] == [8, 64, 256]
    assert [bench_serve.client_processes(c) for c in (1, 8, 9, 16, 64)] == [1, 1, 2, 2, 8]
    assert bench_serve.level_ranges([1, 16, 64], [8, 64, 256]) == {1: (0, 8), 16: (8, 72), 64: (72, 328)}


@pytest.fixture(scope="module")
def words_checkpoint(tmp_path_factory):
    ckpt = build_random_checkpoint(tmp_path_factory.mktemp("serve") / "words", std=0.02, tokenizer="words",
                                   vocab_size=151936, dtype=torch.bfloat16, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    bench_serve.add_json_words(ckpt)
    return ckpt


def _peer_missing():
    """What transformers serve lacks here (its model loading needs accelerate), or None."""
    missing = [m for m in ("accelerate", "fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]
    return f"transformers serve needs {', '.join(missing)}" if missing else None


@pytest.mark.parametrize("server", ["ours", "peer"])
def test_serve_client_against_the_servers_on_cpu(server, words_checkpoint, tmp_path, monkeypatch):
    """The benchmark's own command lines and requests, on CPU: both servers answer the prompt text
    with PROMPT_TOKENS prompt and MAX_TOKENS completion tokens (the round trip, no EOS); ours through
    two client processes (one client each), the peer through one. A request may take up to 15
    minutes: on a 2-core machine shared with other processes' threads, the reference ops' steps
    were seen to slow to seconds each (45 tokens in the benchmark's own 120 s)."""
    missing = _peer_missing() if server == "peer" else None
    if missing:
        pytest.skip(missing)
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if server == "ours":
        monkeypatch.setattr(bench_serve, "CLIENTS_PER_PROCESS", 1)
    model, port = str(words_checkpoint), bench_serve.free_port()
    url = f"http://127.0.0.1:{port}"
    _, prompts = bench_serve.make_prompts(QwenTokenizer.from_pretrained(words_checkpoint), 2)
    proc = bench_serve.start(bench_serve.server_command(server, model, port, 2), tmp_path / "server.log", url,
                             timeout=120)
    try:
        stats = bench_serve.level(url, model, prompts, 2, timeout=900)
        if server == "ours" and importlib.util.find_spec("xgrammar") is not None:
            # the json_schema level: MAX_TOKENS tokens each (summarize checks), every one a JSON piece
            constrained = bench_serve.level(url, model, prompts, 2, bench_serve.JSON_SCHEMA, timeout=900)
            assert constrained["tokens_per_s"] > 0
    finally:
        bench_serve.stop(proc)
    assert stats["tokens_per_s"] > 0 and stats["ttft_p50_ms"] > 0


def test_decode_layers_phase_table_reads_a_synthetic_timeline():
    """bench.decode_layers --timeline's arithmetic on stamps whose answer is known: each phase's
    tasks start when the phase before ends, wait 0.5 us, then compute 1 us (the second task 2 us)."""
    from bench.decode_layers import PHASE_NAMES, phase_table

    counts, layers = [2, 1, 1, 2, 1], 4
    stamps, t = _synthetic_timeline([counts] * layers)
    lines = phase_table(stamps, [(None, PHASE_NAMES, counts)] * layers)
    assert lines[0] == f"timeline: 7 tasks a layer {counts}, kernel span {t:.1f} us"
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in lines if line.startswith("| ") and "---" not in line}
    assert rows["qkv"] == ["2.50", "1.00", "2.00", "0.50", "0.00"]
    assert rows["attn"] == ["1.50", "1.00", "1.00", "0.50", "0.00"]
    assert rows["layer"][0] == f"{t / layers:.2f}"


def _synthetic_timeline(layers: list, slow_waits: int = 0) -> tuple:
    """(stamps [tasks, 3] ns, their end in us) of layers' phases (each a list of task counts): each
    phase's tasks start when the phase before ends, wait 0.5 us (5 us in the first `slow_waits`
    layers), then compute 1 us (task k: 1 + k us)."""
    rows, t = [], 0.0
    for layer, counts in enumerate(layers):
        wait = 5.0 if layer < slow_waits else 0.5
        for n in counts:
            rows += [[t, t + wait, t + wait + 1 + k] for k in range(n)]
            t += wait + n
    return (torch.tensor(rows, dtype=torch.float64) * 1000).long(), t


def test_decode_layers_phase_table_reads_a_synthetic_hybrid_timeline():
    """bench.decode_layers --model qwen3.5 --timeline's arithmetic: one table per layer kind, of
    that kind's phases, the medians over its layers from the third on (the first two wait 5 us,
    the others 0.5): a phase of n tasks spans 0.5 + n us, computes 1 .. n us, its last task ready
    0.5 us after the phase before ends."""
    from bench.decode_layers import HYBRID_PHASES, phase_table
    from csrc_free_ops.decode_hybrid_layers import ATTENTION as A, GATED_DELTANET as G

    counts = {G: [1, 2, 1, 3, 1, 1], A: [2, 1, 1, 1, 2]}
    kinds = [G, A, G, G, A, G]
    stamps, t = _synthetic_timeline([counts[k] for k in kinds], slow_waits=2)
    lines = phase_table(stamps, [(*HYBRID_PHASES[k], counts[k]) for k in kinds])
    assert lines[0] == f"timeline: kernel span {t:.1f} us"
    assert "Gated DeltaNet layers: 9 tasks a layer [1, 2, 1, 3, 1, 1]" in lines
    assert "gated attention layers: 7 tasks a layer [2, 1, 1, 1, 2]" in lines
    rows, kind = {}, None
    for line in lines:
        if " layers: " in line:
            kind = line.split(" layers: ")[0]
        elif line.startswith("| ") and "---" not in line and "phase" not in line:
            rows[kind, line.split("|")[1].strip()] = [c.strip() for c in line.split("|")[2:-1]]
    assert [name for k, name in rows if k == "Gated DeltaNet"] == ["in_proj", "conv", "delta", "out", "gate_up",
                                                                  "down", "layer"]
    assert rows["Gated DeltaNet", "out"] == ["3.50", "2.00", "3.00", "0.50", "0.00"]
    assert rows["Gated DeltaNet", "conv"] == ["2.50", "1.00", "2.00", "0.50", "0.00"]
    assert rows["Gated DeltaNet", "layer"][0] == "12.00"
    assert rows["gated attention", "qkv"] == ["2.50", "1.00", "2.00", "0.50", "0.00"]
    assert rows["gated attention", "down"] == ["2.50", "1.00", "2.00", "0.50", "0.00"]
    assert rows["gated attention", "layer"][0] == "9.50"


def test_engine_decode_timing_counts_the_decode_steps_it_times():
    """``bench.decode.ours_ms`` on a tiny model on the CPU: it times exactly ``steps`` decode-only
    steps of every prompt (its own assertion) and reports a positive time."""
    import torch

    from bench.decode import ours_ms
    from modeling import QwenConfig
    from modeling.model.random_checkpoint import random_model
    from tests.test_engine import QWEN3

    model = random_model(QwenConfig.from_dict(QWEN3), dtype=torch.float64, device="cpu", std=0.2, seed=0)
    assert ours_ms(model, batch=3, context=9, steps=4, reps=1) > 0



def test_moe_benchmark_torch_peer_computes_fused_moe():
    """bench.moe's peer (torch._grouped_mm on the pairs sorted by expert, SiLU-multiply, the weighted
    combine) computes what qwen::fused_moe does, on a routing where an expert gets no pair."""
    from bench.moe import moe_inputs, torch_inputs, torch_moe
    from qwen_ops import fused_moe_reference

    x, w13, w2, weights, ids = moe_inputs(19, 8, 64, 48, 3, device="cpu", dtype=torch.float32)
    ids[ids == 5] = 6  # expert 5 gets no pair (a row may now pick 6 twice: fine for the sum)
    out = torch_moe(*torch_inputs(x, weights, ids, 8), w13, w2, 19)
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_moe_benchmark_floor_counts_what_one_token_reads():
    """bench.moe's decode floor for Qwen3-30B-A3B: every weight but the experts, 8 of the 128
    experts, one embedding row and lm_head, and the keys and values of the context."""
    from bench.moe import QWEN3_30B_A3B, token_bytes
    from modeling import QwenConfig, QwenForCausalLM

    with torch.device("meta"):
        model = QwenForCausalLM(QwenConfig.from_dict(QWEN3_30B_A3B)).to(torch.bfloat16)
    h, layers, vocab = 2048, 48, 151936
    attention = (4096 + 2 * 512) * h + h * 4096 + 2 * 128 + 2 * h  # q, k, v, o, q/k norms, the two norms
    experts = 8 * 3 * 768 * h + 128 * h  # the eight picked, and the router
    params = layers * (attention + experts) + h + vocab * h + h  # embedding row, lm_head, final norm
    kv = layers * 256 * 2 * 4 * 128
    assert token_bytes(model, 256) == 2 * (params + kv)


def test_moe_benchmark_fp8_floor_counts_fp8_bytes_and_scales():
    """bench.moe --fp8's floor: a model quantised as ``quantization="fp8"`` does counts one byte a
    weight of its FP8 projections and experts, their fp32 block scales (the experts' at the picked
    share), and the rest in bf16. One small layer: hidden 128, q 4 and kv 2 heads of 64, 8 experts
    of 128 with 2 picked, vocabulary 256."""
    from bench.moe import QWEN3_30B_A3B, token_bytes
    from modeling import QwenConfig
    from modeling.model.random_checkpoint import random_model

    sizes = dict(QWEN3_30B_A3B, vocab_size=256, hidden_size=128, moe_intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2)
    model = random_model(QwenConfig.from_dict(sizes), dtype=torch.bfloat16, quantization="fp8")
    qkv = 512 * 128 + 4 * 1 * 4  # FP8 [512, 128], scales [4, 1]
    o = 128 * 256 + 1 * 2 * 4  # FP8 [128, 256], scales [1, 2]
    experts = (8 * 256 * 128 + 8 * 2 * 1 * 4 + 8 * 128 * 128 + 8 * 1 * 1 * 4) * 2 // 8  # gate_up, down: 2 of 8
    bf16 = 2 * (2 * 64 + 2 * 128 + 8 * 128 + 128 + 256 * 128 + 128)  # q/k norms, norms, router, embedding row, lm_head, final norm
    kv = 256 * 2 * 2 * 64 * 2
    assert token_bytes(model, 256) == qkv + o + experts + bf16 + kv


def test_decode_benchmark_large_shapes_and_their_floor():
    """bench.decode's larger shapes load as configs of the sizes they name, and the floor's bytes
    count an untied embedding as the one row a token reads (a tied one is the lm_head, read whole)."""
    from bench.decode import LARGE, SHAPES, weight_bytes
    from modeling import QwenConfig, QwenForCausalLM

    def params(shape):
        with torch.device("meta"):
            model = QwenForCausalLM(QwenConfig.from_dict(shape)).to(torch.bfloat16)
        return model, sum(p.numel() for p in model.parameters())

    model, n = params(LARGE["qwen3-8b"])
    assert 8.1e9 < n < 8.3e9 and model.lm_head is not None
    assert weight_bytes(model) == 2 * (n - (151936 - 1) * 4096)
    model, n = params(LARGE["qwen3.5-9b"])
    kinds = model.config.layer_types
    assert len(kinds) == 32 and kinds.count("full_attention") == 8 and 8.9e9 < n < 9.0e9  # its text model: 8.95B
    assert weight_bytes(model) == 2 * (n - (248320 - 1) * 4096)
    model, n = params(SHAPES["qwen3-0.6b"])
    assert model.lm_head is None and weight_bytes(model) == 2 * n
