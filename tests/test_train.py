"""modeling.train: the default model's trainer, on a tiny model (hidden 32, 1 layer, 32-token
sequences) and a slice of tests/data/tinyshakespeare_20k.txt, CPU (Triton interpreter without a GPU).

- a few steps lower the training and the validation loss;
- the checkpoint it writes loads in transformers.Qwen3ForCausalLM.from_pretrained unchanged and
  gives the logits of our QwenForCausalLM.from_pretrained (fp32), with the tokenizer, EOS ids and
  sampling defaults in place, every file under 16 MB;
- --stop-at then --resume reproduces an uninterrupted run (same losses, same weights);
- the best weights are a copy, not the live weights (--save-dtype fp32 on CPU), and the learning
  rate follows whichever of the step and the time budget is further along;
- the dialogue as ChatML (speeches in turn user and assistant messages) and --chat-fraction's
  rows of it in each batch; --init starts from a checkpoint's weights, tokenizer and sizes;
- bits per character by hand: the formula, the validation windows (every token but the first
  predicted once), a zero model (uniform: log2(V) bits per token), and the fused loss against
  log-softmax of the logits, window by window;
- the shipped default sizes fit the 16 MB file limit.
"""
import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from modeling import train
from modeling.model.config import QwenConfig

TEXT = Path(__file__).parent / "data" / "tinyshakespeare_20k.txt"
# tiny preset (hidden 32, 1 layer, 2/1 heads x 16, seq 32, vocab 320) on 4000 characters, 200 of them
# validation (about 140 tokens, 5 windows), no train-split evaluation: each step and each
# validation is a few hundred tokens through the interpreter.
TINY = ["--device", "cpu", "--preset", "tiny", "--data", str(TEXT), "--max-chars", "4000",
        "--val-fraction", "0.05", "--batch-size", "2", "--train-eval-tokens", "0", "--lr", "1e-2",
        "--rope-theta", "1e6", "--log-every", "1", "--no-progress", "--no-plot"]
STEPS = ["--steps", "4", "--eval-every", "4"]


def run(*argv):
    rc = train.main([*TINY, *map(str, argv)])
    assert rc == 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "model"
    run("--out", out, *STEPS)
    return out


def read_log(path):
    return json.loads((path / train.LOG_FILE).read_text())


def test_a_few_steps_lower_the_loss(trained):
    log = read_log(trained)
    val = [p["val_loss"] for p in log["val"]]
    losses = [p["loss"] for p in log["train"]]
    assert [p["step"] for p in log["val"]] == [0, 4] and [p["step"] for p in log["train"]] == [1, 2, 3, 4]
    assert math.isclose(val[0], math.log(320), rel_tol=0.02)  # init: about uniform over the vocabulary
    assert val[1] < val[0] - 0.3, val
    assert losses[-1] < losses[0] - 0.1, losses  # the loss of each step's batch, before its update
    assert log["steps"] == 4 and log["tokens_seen"] == 4 * 2 * 32 and log["stopped"] == "steps"
    assert log["best"]["step"] == 4 and log["best"]["val_loss"] == val[1]
    d = log["data"]
    assert (d["train_chars"], d["val_chars"]) == (3800, 200)
    assert log["best"]["val_bits_per_char"] == pytest.approx(
        val[1] * d["val_tokens"] / d["val_chars"] / math.log(2), rel=1e-12)


def test_checkpoint_loads_in_transformers_with_the_same_logits(trained):
    transformers = pytest.importorskip("transformers")
    from modeling.model.causal_lm import QwenForCausalLM
    from modeling.api.tokenizer import QwenTokenizer

    names = {p.name for p in trained.iterdir()}
    assert names == {*train.MODEL_FILES, train.LOG_FILE, train.STATE_FILE}
    assert all((trained / n).stat().st_size < 16e6 for n in names)

    tok = QwenTokenizer.from_pretrained(trained)
    assert tok.eos_token_ids == (2, 0)  # <|im_end|>, <|endoftext|>
    assert tok.special_tokens == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    text = "ROMEO:\nWhat light through yonder window breaks?"
    assert tok.decode(tok.encode(text)) == text
    gen = json.loads((trained / "generation_config.json").read_text())
    assert gen["do_sample"] is True and gen["temperature"] == 0.8 and gen["top_k"] == 40 and gen["top_p"] == 0.95

    hf = transformers.Qwen3ForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    ours = QwenForCausalLM.from_pretrained(trained, dtype=torch.float32)
    assert ours.config.rope_theta == 1e6
    ids = torch.tensor([tok.encode(text)[:32]])
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours(ids)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    # and the saved weights are the best step's (bf16), un-fused as loader.load_plan says
    state = torch.load(trained / train.STATE_FILE, weights_only=True)
    assert state["step"] == 4 and state["best"]["step"] == 4
    torch.testing.assert_close(ours.embed_tokens, state["weights"]["embed_tokens"].to(torch.bfloat16).float())
    hf_q = hf.model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(hf_q, state["weights"]["layers.0.qkv_weight"][:32].to(torch.bfloat16).float())


def test_resume_continues_from_the_saved_step(trained, tmp_path):
    out = tmp_path / "model"
    run("--out", out, *STEPS, "--stop-at", "2")
    first = read_log(out)
    assert first["steps"] == 2 and first["stopped"] == "stop_at"
    assert torch.load(out / train.STATE_FILE, weights_only=True)["step"] == 2

    assert train.main(["--out", str(out), "--resume", "--no-progress", "--no-plot"]) == 0
    log, ref = read_log(out), read_log(trained)
    assert log["steps"] == 4 and [r["start_step"] for r in log["runs"]] == [0, 2]
    assert [p["step"] for p in log["train"]] == [1, 2, 3, 4]
    # the same batches, dropout masks, learning rates and optimizer state as the run without a break
    for a, b in zip(log["train"], ref["train"]):
        assert (a["lr"], a["loss"]) == pytest.approx((b["lr"], b["loss"]), rel=1e-6), (a, b)
    assert log["best"]["val_loss"] == pytest.approx(ref["best"]["val_loss"], rel=1e-6)
    w, w_ref = (torch.load(p / train.STATE_FILE, weights_only=True)["weights"] for p in (out, trained))
    for name in w_ref:
        torch.testing.assert_close(w[name], w_ref[name], rtol=1e-6, atol=1e-7)


def test_resume_refuses_settings_it_would_not_take(trained, capsys):
    """--resume takes the saved run's settings: one given again with another value is an error
    naming it (it used to be dropped without a word); the same value, or a resumable setting, is not."""
    assert train.main(["--out", str(trained), "--resume", "--lr", "0.5", "--seed", "7", "--no-progress",
                       "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "--resume continues the saved run's settings: --lr, --seed cannot change" in err


def test_refuses_to_overwrite_a_run(trained, capsys):
    assert train.main([*TINY, "--out", str(trained), *STEPS]) == 2
    assert "--resume" in capsys.readouterr().err


def trainer(out, *argv, base=TINY):
    """A Trainer for ``base + argv`` into ``out``, as main builds it (fp32), before its run."""
    a = train.parse_args([*base, "--out", str(out), *map(str, argv)])
    a.dtype = "fp32"
    out, state_path, lock = train.prepare(a)
    try:
        return train.Trainer(a, out, state_path, print, train.StopSignals())
    finally:
        lock.release()


def test_best_weights_are_a_copy_of_the_live_ones(tmp_path):
    """In fp32 with --save-dtype fp32, ``.to(dtype)`` alone returns the live tensor itself: the
    checkpoint would follow every later step."""
    t = trainer(tmp_path / "model", "--save-dtype", "fp32")
    t.val = lambda model: (1.0, 1.0)  # a validation (the real one runs minutes in the interpreter)
    before = [m.detach().clone() for m in t.master]
    t.evaluate(0.0)
    with torch.no_grad():
        for m in t.master:
            m.add_(1.0)  # what later steps do to the live weights
    assert t.best_step == 0
    for best, init in zip(t.best_weights, before):
        assert best.dtype == torch.float32 and torch.equal(best, init)


def test_learning_rate_follows_the_further_of_steps_and_time():
    a = argparse.Namespace(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_minutes=2.0)
    half = 1e-4 + 0.9e-3 * 0.5  # the cosine halfway
    assert train.lr_at(a, 4, 110, 90.0) == pytest.approx(5e-4)  # warm-up: steps only
    assert train.lr_at(a, 10, 110, 0.0) == pytest.approx(1e-3)
    assert train.lr_at(a, 10, 110, 60.0) == pytest.approx(half)  # half the time budget, no decay steps yet
    assert train.lr_at(a, 60, 110, 6.0) == pytest.approx(half)  # half the decay steps, 5% of the time
    assert train.lr_at(a, 60, 110, 500.0) == pytest.approx(1e-4)  # past the budget: fully annealed
    a.max_minutes = None
    assert train.lr_at(a, 60, 110, 500.0) == pytest.approx(half)


def test_dialogue_as_chatml():
    text = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
            "First Citizen:\nYou are all resolved\nrather to die?\n\nthe rest of a speech\n\nMENENIUS:\n\n"
            "All:\nResolved.\n")
    assert train.speeches(text) == ["Before we proceed any further, hear me speak.", "Speak, speak.",
                                     "You are all resolved\nrather to die?", "Resolved."]
    assert train.dialogue_chat(text) == (
        "<|im_start|>user\nBefore we proceed any further, hear me speak.<|im_end|>\n"
        "<|im_start|>assistant\nSpeak, speak.<|im_end|>\n"
        "<|im_start|>user\nYou are all resolved\nrather to die?<|im_end|>\n"
        "<|im_start|>assistant\nResolved.<|im_end|>\n")


def test_chat_fraction_rows_are_crops_of_the_dialogue(tmp_path):
    t = trainer(tmp_path / "model", "--batch-size", 4, "--chat-fraction", 0.5)
    dialogue = t.chat_ids.tolist()
    assert t.chat_rows == 2 and dialogue[0] == 1 and dialogue.count(2) > 10  # <|im_start|>, <|im_end|>
    for _ in range(3):
        x = t.batch().tolist()
        plain, chat = x[:2], x[2:]
        for row in chat:
            assert any(dialogue[i:i + 32] == row for i in range(len(dialogue) - 31)), row
        assert all(1 not in row and 2 not in row for row in plain)  # no special token in the plain text


def test_init_starts_from_a_checkpoint(trained, tmp_path, capsys):
    from modeling.model.causal_lm import QwenForCausalLM

    base = [x for x in TINY if x not in ("--rope-theta", "1e6")]
    t = trainer(tmp_path / "model", "--init", trained, base=base)
    assert t.config.rope_theta == 1e6 and t.a.seq_len == 32  # the checkpoint's settings, not the preset's
    init = QwenForCausalLM.from_pretrained(trained, dtype=torch.float32)
    for (name, p), q in zip(init.named_parameters(), t.master):
        assert torch.equal(p, q), name
    assert (t.out / "tokenizer.json").read_text() == (trained / "tokenizer.json").read_text()
    assert train.main([*base, "--out", str(tmp_path / "other"), "--init", str(trained), "--layers", "2"]) == 2
    assert capsys.readouterr().err == (f"error: --init {trained}: the model's settings come from its config.json; "
                                       "drop --layers\n")


def test_bits_per_char_formula():
    # 300 tokens at 1.2 nats each over 500 characters: 360 nats = 519.37 bits, 1.0387 bits/char
    assert train.bits_per_char(1.2, 300, 500) == pytest.approx(360 / math.log(2) / 500, rel=1e-15)
    assert train.bits_per_char(math.log(2), 10, 10) == pytest.approx(1.0)


@pytest.mark.parametrize("n, seq", [(70, 32), (32, 32), (33, 32), (10, 32), (100, 8), (2, 5)])
def test_eval_windows_predict_every_token_once(n, seq):
    counted = []
    for start, first in train.eval_windows(n, seq):
        t = min(seq, n)
        assert 0 <= start and start + t <= n and first >= 1
        counted += [start + j for j in range(first, t)]
    assert sorted(counted) == list(range(1, n))
    assert train.eval_windows(70, 32) == [(0, 1), (31, 1), (38, 25)]


def tiny_model(seed=0):
    a = train.parse_args(["--preset", "tiny", "--out", "unused"])
    a.rope_theta = 1e6
    return train.build_model(QwenConfig.from_dict(train.model_config_dict(a, 64)), seed, 0.5)


def test_bits_per_char_of_a_uniform_model():
    """All-zero matrices: every logit is 0, each token costs ln(64) nats, i.e. 6 bits."""
    model = tiny_model()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.zero_()
    ids = torch.randint(0, 64, (70,), generator=torch.Generator().manual_seed(0))
    nats, bpc = train.Evaluator(ids, 150, 32, 2)(model)
    assert nats == pytest.approx(math.log(64), rel=1e-6)
    assert bpc == pytest.approx(6 * 70 / 150, rel=1e-6)


def test_evaluator_matches_log_softmax_by_hand():
    model = tiny_model().requires_grad_(True).train()
    train.attach_dropout(model, 0.5)  # eval mode turns it off
    ids = torch.randint(3, 64, (70,), generator=torch.Generator().manual_seed(1))
    nats, bpc = train.Evaluator(ids, 123, 32, 2)(model)
    assert model.training
    total = 0.0
    with torch.no_grad():  # windows [0, 32), [31, 63), [38, 70) counting tokens 1-31, 32-62, 63-69
        for start, first in [(0, 1), (31, 1), (38, 25)]:
            x = ids[start:start + 32][None]
            logits = model.eval()(x)[0].double()
            logp = torch.log_softmax(logits[:-1], -1).gather(1, x[0, 1:, None])[:, 0]
            total -= logp[first - 1:].sum().item()
    assert nats == pytest.approx(total / 69, rel=1e-5)
    assert bpc == pytest.approx(total / 69 * 70 / 123 / math.log(2), rel=1e-5)


def test_shipped_sizes_fit_the_file_limit():
    a = train.parse_args(["--out", "unused"])
    config = QwenConfig.from_dict(train.model_config_dict(a, a.vocab_size))
    assert (config.model_type, config.tie_word_embeddings, config.qk_norm) == ("qwen3", True, True)
    assert config.num_attention_heads > config.num_key_value_heads  # GQA
    with torch.device("meta"):
        from modeling.model.causal_lm import QwenForCausalLM
        n = train.count_parameters(QwenForCausalLM(config))
    assert 5e6 <= n <= 8e6, n
    assert 2 * n < 16e6  # bf16 model.safetensors


def test_epochs_given_set_the_length_over_a_presets_steps():
    """--epochs without --steps decides the length even where the preset (tiny: 20 steps) has steps;
    --steps given still wins, and without either the preset's steps stand."""
    from modeling.train.cli import parse_args

    base = ["--preset", "tiny", "--out", "unused"]
    assert parse_args(base).steps == 20
    a = parse_args([*base, "--epochs", "0.5"])
    assert a.steps is None and a.epochs == 0.5
    assert parse_args([*base, "--epochs", "0.5", "--steps", "7"]).steps == 7
