"""modeling.train stopped by real signals, and the directory it writes into.

- a tiny run (40 steps) stopped again and again by SIGTERM or SIGINT from outside at random
  moments, continued with --resume each time, ends with the weights, optimizer state, checkpoint
  and losses of the same run without a stop, bit for bit (CPU, fp32, one thread); every resume
  state it leaves is whole (the optimizer's step counts, the log and the data sampler's generator
  all at the saved step); its first process stops itself inside the step-0 validation, which
  leaves a directory that --resume continues and a fresh run refuses;
- a second training into a directory that one is writing fails at once (exit 2, one line);
- an --out or --state that cannot be a writable directory, and every bad flag and input file (an
  empty --out, a learning rate or clip that is not a finite positive number, a --data that is
  /dev/zero, a FIFO, a directory, too large or not UTF-8, a --state that is a device or a folder, a
  corrupt resume state): exit 2, one line, no traceback, nothing written.

The runs are subprocesses without TRITON_INTERPRET (the PyTorch references: a few seconds each).
"""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from modeling import train
from modeling.train.constants import DATA_LIMIT
from tests.helpers import isolated, needs_fifo

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "tinyshakespeare_20k.txt"
STEPS = 40
RUN = ["--device", "cpu", "--preset", "tiny", "--data", str(TEXT), "--max-chars", "4000", "--val-fraction", "0.05",
       "--batch-size", "2", "--train-eval-tokens", "0", "--lr", "1e-2", "--rope-theta", "1e6", "--log-every", "1",
       "--steps", str(STEPS), "--eval-every", "10", "--state-every", "7", "--no-progress", "--no-plot"]
RESUME = ["--resume", "--no-progress", "--no-plot"]
# A real SIGTERM to itself while the step-0 validation runs.
STOP_IN_STEP0_VALIDATION = """\
import os, signal, sys
from modeling import train
evaluate = train.Evaluator.__call__
def stop_inside(self, model):
    os.kill(os.getpid(), signal.SIGTERM)
    return evaluate(self, model)
train.Evaluator.__call__ = stop_inside
sys.exit(train.main(sys.argv[1:]))
"""
ENV = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},  # CPU: the reference ops
       "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "OMP_NUM_THREADS": "1"}  # every process sums in the same order


def start(*args, script=None):
    head = ["-c", script] if script else ["-m", "modeling.train"]
    return subprocess.Popen([sys.executable, *head, *map(str, args)], cwd=ROOT, env=ENV,
                            stderr=subprocess.PIPE, text=True)


def finish(p):
    err = p.stderr.read()
    return p.wait(timeout=120), err


def wait_for_training(p):
    """Read p's stderr until the run's 'model:' line (its lock is held by then)."""
    lines = []
    while not lines or not lines[-1].startswith("model:"):
        line = p.stderr.readline()
        assert line, "".join(lines)
        lines.append(line)


def load_state(out):
    return torch.load(out / train.STATE_FILE, weights_only=True)


def assert_whole(out):
    """The resume state, the log and the checkpoint of one save, all at one step."""
    state = load_state(out)
    step, log = state["step"], json.loads((out / train.LOG_FILE).read_text())
    assert log["steps"] == state["log"]["steps"] == step
    assert log["best"] == state["log"]["best"] and state["best"]["step"] == log["best"]["step"]
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} <= {step}
    assert len(state["optimizer"]["state"]) == (len(state["weights"]) if step else 0)
    data = torch.Generator().manual_seed(0 + 1)  # Trainer.batch's draws, one per step
    for _ in range(step):
        torch.randint(0, state["log"]["data"]["train_tokens"] - 32 + 1, (2, 1), generator=data)
    assert torch.equal(data.get_state(), state["rng"]["data"])
    return state


def test_stopped_at_random_moments_the_resumed_run_is_the_uninterrupted_one(tmp_path, capsys):
    ref = tmp_path / "ref"
    rc, err = finish(start("--out", ref, *RUN))
    assert rc == 0, err
    wall = json.loads((ref / train.LOG_FILE).read_text())["wall_time_s"]

    out = tmp_path / "run"
    rc, err = finish(start("--out", out, *RUN, script=STOP_IN_STEP0_VALIDATION))
    assert rc == 128 + signal.SIGTERM and "interrupted by SIGTERM at step 0" in err, err
    state = assert_whole(out)  # the validation ran to its end, and the run stopped before step 1
    assert state["step"] == 0 and [v["step"] for v in state["log"]["val"]] == [0]
    assert not (out / train.LOCK_FILE).exists()
    assert train.main([*RUN, "--out", str(out)]) == 2  # a fresh run refuses it; --resume continues it
    assert "continue it with --resume" in capsys.readouterr().err

    rng, stops = random.Random(0), []
    for i in range(4):
        p = start("--out", out, *RESUME)
        wait_for_training(p)
        if i == 0:
            assert train.main(["--out", str(out), *RESUME]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"error: --out {out} is being written by another training run (pid {p.pid}")
            assert err.count("\n") == 1, err
        step = load_state(out)["step"]
        # at most half the uninterrupted run's time left: a resumed run can be a third faster than that one
        time.sleep(rng.uniform(0.0, 0.5 * wall * (STEPS - step) / STEPS))
        sig = rng.choice([signal.SIGTERM, signal.SIGINT])
        p.send_signal(sig)
        rc, err = finish(p)
        if rc == 0 or "done (" in err:  # it got to the end first (a signal during its exit may still kill it)
            break
        assert rc == 128 + sig and f"interrupted by {sig.name}" in err, (rc, err)
        stops.append(assert_whole(out)["step"])
    else:
        rc, err = finish(start("--out", out, *RESUME))
        assert rc == 0, err
    assert sum(0 < s < STEPS for s in stops) >= 2, stops  # most stops land between steps 1 and 39

    state, want = load_state(out), load_state(ref)
    assert state["step"] == want["step"] == STEPS
    for name, w in want["weights"].items():
        assert torch.equal(state["weights"][name], w), name
    for i, s in want["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(state["optimizer"]["state"][i][k], v), (i, k)
    assert (out / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
    log, ref_log = (json.loads((d / train.LOG_FILE).read_text()) for d in (out, ref))
    assert [(p["step"], p["loss"]) for p in log["train"]] == [(p["step"], p["loss"]) for p in ref_log["train"]]
    assert [(p["step"], p["val_loss"]) for p in log["val"]] == [(p["step"], p["val_loss"]) for p in ref_log["val"]]
    assert log["best"] == ref_log["best"] and len(log["runs"]) == 2 + len(stops)


def usage_error(capsys, *argv):
    assert train.main([*RUN, *map(str, argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_out_that_cannot_be_a_directory(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    assert usage_error(capsys, "--out", a_file) == f"error: --out {a_file}: exists and is not a directory\n"
    err = usage_error(capsys, "--out", a_file / "model")
    assert err.startswith(f"error: --out {a_file / 'model'}: cannot create the directory (Not a directory)")
    err = usage_error(capsys, "--out", tmp_path / "model", "--state", a_file / "state.pt")
    assert err.startswith(f"error: --state {a_file}: exists and is not a directory")
    assert usage_error(capsys, "--out", a_file, "--resume").startswith(f"error: --resume: --out {a_file} is not")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # the refused run's --out is removed again


MAIN_EACH = """
import contextlib, io, json, sys
from modeling import train

out = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stderr(io.StringIO()) as err:
        out.append([train.main(argv), err.getvalue()])
print(json.dumps(out))
"""
"""Runs modeling.train's main on each command line of its JSON argument; prints each exit status
and what it wrote on stderr."""


@needs_fifo
def test_bad_flags_and_inputs_fail_in_one_line_and_write_nothing(tmp_path):
    """Each a clear error, exit status 2, and the folders as they were (an --out made for the run is
    removed again). In a process of its own with a timeout and 2 GiB of data: /dev/zero or a FIFO
    as --data used to be read until the kernel killed the run, or forever."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    with open(tmp_path / "huge.txt", "wb") as f:  # sparse: nothing is written
        f.truncate(2 * DATA_LIMIT)
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / train.STATE_FILE).write_bytes(b"PK\x03\x04 not a zip file")
    (tmp_path / "old").mkdir()
    torch.save({"version": 1, "args": {}}, tmp_path / "old" / train.STATE_FILE)
    out = str(tmp_path / "new" / "model")
    cases = [
        (["--out", ""], "--out needs a path, got ''"),
        (["--out", out, "--lr", "nan"], "--lr must be a finite number > 0, got nan"),
        (["--out", out, "--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["--out", out, "--grad-clip", "-1"], "--grad-clip must be a finite number > 0, got -1.0"),
        (["--out", out, "--beta2", "1"], "--beta2 must be in [0, 1), got 1.0"),
        (["--out", out, "--data", "/dev/zero"], "--data /dev/zero: zero is not a regular file (a character device)"),
        (["--out", out, "--data", tmp_path / "fifo"], "fifo is not a regular file (a FIFO)"),
        (["--out", out, "--data", tmp_path], "is not a regular file (a directory)"),
        (["--out", out, "--data", tmp_path / "huge.txt"], "huge.txt is 2 GiB, larger than the 1 GiB"),
        (["--out", out, "--data", tmp_path / "latin1.txt"], "latin1.txt is not valid UTF-8 (byte 0xe9 at offset 3)"),
        (["--out", out, "--state", "/dev/null"], "--state /dev/null: exists and is not a regular file"),
        (["--out", out, "--state", tmp_path], f"--state {tmp_path}: exists and is not a regular file"),
        (["--out", tmp_path / "garbled", "--resume"], "is not a resume state (torch.load: "),
        (["--out", tmp_path / "old", "--resume"], "resume state version 1, expected 2"),
        (["--out", out, "--stop-at", "0", "--patience", "-1"], "--stop-at must be >= 1, got 0; --patience must be >= 0"),
        (["--out", out, "--max-chars", "-5"], "--max-chars must be >= 1, got -5"),
        (["--out", out, "--warmup-steps", "-5", "--state-every", "-1", "--train-eval-tokens", "-5"],
         "--warmup-steps must be >= 0, got -5; --state-every must be >= 0, got -1; --train-eval-tokens must be >= 0"),
        (["--out", out, "--head-dim", "24"], "the model flags make no valid model: unsupported head_dim 24"),
    ]
    before = sorted(tmp_path.rglob("*"))
    p = isolated("-c", MAIN_EACH, json.dumps([[*RUN, *map(str, argv)] for argv, _ in cases]))
    assert p.returncode == 0, p.stderr
    for (argv, message), (code, err) in zip(cases, json.loads(p.stdout)):
        assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, (argv, err)
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_out_in_a_read_only_folder(tmp_path, capsys):
    tmp_path.chmod(0o555)
    try:
        err = usage_error(capsys, "--out", tmp_path / "model")
    finally:
        tmp_path.chmod(0o755)
    assert err.startswith(f"error: --out {tmp_path / 'model'}: cannot create the directory (Permission denied)")
