"""The engine's token controls (SamplingParams' logit_bias, allowed_token_ids, bad_words,
min_tokens; modeling.engine.token_masks and sampler.controlled_logits) against a plain greedy
reference written here (the model rerun on the whole sequence every step, each control applied to
the raw logits token by token), rows with different controls in one batch; then what ``LLM`` does
with include_stop_str_in_output and truncate_prompt_tokens, and structured outputs (xgrammar)."""

import json
import re
import sys

import pytest
import torch

from modeling import LLM, SamplingParams
from modeling.engine import Engine
from modeling.engine.sampler import sample_sequences
from modeling.engine.structured_outputs import Grammars, StructuredOutputs
from modeling.engine.token_masks import TokenControls, bad_word_ids
from tests.test_engine import QWEN3, model_of, prompts_of
from tests.test_engine_sampling import seq_of
from tests.test_generate_cli import build_chat_checkpoint


class CharTokenizer:
    """A tokenizer of one token per printable ASCII character (id = code - 32), for bad_words."""

    @staticmethod
    def encode(text):
        return [ord(c) - 32 for c in text]


def text_of(ids):
    return "".join(chr(t + 32) for t in ids)


def reference(model, prompt, new, stop=(), bias=None, allowed=None, bad=(), min_tokens=0):
    """Greedy tokens under the controls, in float64: the bias added, then every token outside
    ``allowed``, the last token of each bad word (token ids) whose others end the output, and the
    stop tokens before ``min_tokens`` set to -inf. Ends at a stop token (kept) or after ``new``."""
    tokens = list(prompt)
    for _ in range(new):
        with torch.no_grad():
            logits = model(torch.tensor([tokens]))[0, -1].double().clone()
        output = tokens[len(prompt):]
        for t, b in (bias or {}).items():
            logits[t] += b
        banned = set(range(logits.shape[0])) - set(allowed) if allowed is not None else set()
        for word in bad:
            if output[len(output) - len(word) + 1:] == list(word[:-1]) or len(word) == 1:
                banned.add(word[-1])
        if len(output) < min_tokens:
            banned |= set(stop)
        for t in banned:
            logits[t] = float("-inf")
        tokens.append(int(logits.argmax()))
        if tokens[-1] in stop:
            break
    return tokens[len(prompt):]


def test_controls_match_the_reference_rows_mixed_in_one_batch():
    model = model_of(QWEN3)
    prompts = prompts_of([9, 23, 4, 12, 7])
    new = 10
    engine = Engine(model, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, tokenizer=CharTokenizer())
    plain = [reference(model, p, new) for p in prompts]
    bias = {plain[0][0]: -30.0, plain[0][3]: 5.0}
    allowed = sorted(set(plain[1][::2]) | {3, 50})
    word = text_of(plain[2][2:4])  # a two-token bad word the plain output contains
    bad = bad_word_ids(CharTokenizer(), [word, text_of(plain[2][6:7])])
    stop = (plain[3][1],)
    cases = [
        (dict(logit_bias=bias), dict(bias=bias)),
        (dict(allowed_token_ids=allowed), dict(allowed=allowed)),
        (dict(bad_words=[word, text_of(plain[2][6:7])]), dict(bad=bad)),
        (dict(min_tokens=6), dict(min_tokens=6, stop=stop)),
        ({}, {}),
    ]
    seqs = [engine.add(p, SamplingParams(**params), new, ref.get("stop", ()))
            for p, (params, ref) in zip(prompts, cases)]
    while engine.has_work():
        engine.step()
    for i, (p, seq, (params, ref)) in enumerate(zip(prompts, seqs, cases)):
        want = reference(model, p, new, **ref)
        assert seq.output_ids == want, params
        if i < 4:
            assert want != plain[i][:len(want)] or len(want) != len(reference(model, p, new, stop=ref.get("stop", ())))
    assert set(seqs[1].output_ids) <= set(allowed)
    assert len(seqs[3].output_ids) >= 6 and plain[3][1] not in seqs[3].output_ids[:6]
    assert reference(model, prompts[3], new, stop=stop) == plain[3][:2]  # without min_tokens: 2 tokens


def test_controlled_draws_take_allowed_tokens_only_and_biased_rows_move():
    """Sampled (not greedy) rows: an allowed set holds in every draw; a +100 bias on one token
    makes it the draw; a row without controls draws what it draws alone."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 300, generator=g, dtype=torch.float64)
    rows = [seq_of([1, 2], [], seed=s, temperature=1.0, **kw) for s, kw in
            enumerate([dict(allowed_token_ids=[7, 40, 299]), dict(logit_bias={123: 100.0}), {}])]
    rows[0].controls = TokenControls(rows[0].params, 300, [], ())
    alone = sample_sequences(logits[2:], rows[2:]).collect()[0][0]
    for position in range(20):
        tokens = [t for t, _ in sample_sequences(logits, rows, [position] * 3).collect()]
        assert tokens[0] in (7, 40, 299) and tokens[1] == 123
    assert sample_sequences(logits, rows).collect()[2][0] == alone


def test_engine_refuses_ids_outside_the_vocabulary_and_bad_words_without_a_tokenizer():
    engine = Engine(model_of(QWEN3), max_num_seqs=2, max_model_len=64)
    with pytest.raises(ValueError, match=r"token ids \[96\] outside the model's vocabulary \[0, 96\)"):
        engine.add([1, 2], SamplingParams(logit_bias={96: 1.0}), 4)
    with pytest.raises(ValueError, match="bad_words needs the engine's tokenizer"):
        engine.add([1, 2], SamplingParams(bad_words=["x"]), 4)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(build_chat_checkpoint(tmp_path_factory.mktemp("controls") / "tiny"), device="cpu", dtype=torch.float64)


def test_include_stop_str_in_output_and_truncate_prompt_tokens(llm):
    prompt = "ROMEO:\nWhat light"
    base = llm.generate(prompt, SamplingParams(max_tokens=24), use_tqdm=False)[0]
    stop = base.text[len(base.text) // 2:][:3]
    cut = llm.generate(prompt, SamplingParams(max_tokens=24, stop=[stop]), use_tqdm=False)[0]
    kept = llm.generate(prompt, SamplingParams(max_tokens=24, stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0]
    assert cut.text == base.text[:base.text.index(stop)]
    assert kept.text == cut.text + stop and kept.finish_reason == "stop" and kept.stop_reason == stop
    ids = llm.tokenizer.encode(prompt)
    short = llm.generate(prompt, SamplingParams(max_tokens=8, truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert short.prompt_token_ids == ids[-3:]
    assert short.token_ids == llm.generate({"prompt_token_ids": ids[-3:]}, SamplingParams(max_tokens=8),
                                           use_tqdm=False)[0].token_ids
    assert llm.generate(prompt, SamplingParams(max_tokens=8, truncate_prompt_tokens=100),
                        use_tqdm=False)[0].prompt_token_ids == ids


def test_collections_may_be_generators(llm):
    """Each collection field takes any iterable, a generator too: read once, checked and stored whole."""
    given = dict(stop=["x"], stop_token_ids=[5], logit_bias=[(3, 1.0)], allowed_token_ids=[49, 50], bad_words=["ab"])
    params = SamplingParams(**{k: (v for v in values) for k, values in given.items()},
                            structured_outputs={"choice": (c for c in ["a", "b"])})
    assert params == SamplingParams(**given, structured_outputs={"choice": ["a", "b"]})
    out = llm.generate("Hello", SamplingParams(max_tokens=3, allowed_token_ids=(t for t in [49])), use_tqdm=False)[0]
    assert out.token_ids == [49, 49, 49]
    with pytest.raises(ValueError, match=r"allowed_token_ids must be a non-empty sequence .* got \(\)"):
        SamplingParams(allowed_token_ids=iter([]))


def test_structured_outputs_hold_and_leave_unconstrained_rows_alone(llm):
    """A JSON schema, a choice and a regex in one batch with a free row: each constrained output
    holds, and the free row is what it is alone (its logits row untouched by the bitmask)."""
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 50},
                                                "s": {"type": "string", "maxLength": 5}},
              "required": ["n", "s"], "additionalProperties": False}
    specs = [{"json": schema}, {"choice": ["alpha", "beta"]}, {"regex": r"[xyz]{2}\d"}, None]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured_outputs=spec)
              for i, spec in enumerate(specs)]
    outs = [o.outputs[0] for o in llm.generate(["Hello"] * 4, params, use_tqdm=False)]
    assert all(o.finish_reason == "stop" for o in outs[:3])
    value = json.loads(outs[0].text)
    assert set(value) == {"n", "s"} and 0 <= value["n"] <= 50 and len(value["s"]) <= 5
    assert outs[1].text in ("alpha", "beta") and re.fullmatch(r"[xyz]{2}\d", outs[2].text)
    assert outs[3].token_ids == llm.generate("Hello", params[3], use_tqdm=False)[0].outputs[0].token_ids


def test_structured_outputs_errors():
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, choice, grammar, got json, regex"):
        SamplingParams(structured_outputs={"json": {}, "regex": "a"})
    with pytest.raises(ValueError, match="structured_outputs.choice must be a non-empty list"):
        SamplingParams(structured_outputs={"choice": "ab"})
    for bad in ({"json_object": "yes"}, {"json": {}, "strict": 0}):  # not coerced to bools
        with pytest.raises(ValueError, match="structured_outputs.(json_object|strict) must be a bool"):
            SamplingParams(structured_outputs=bad)
    pytest.importorskip("xgrammar")
    engine = Engine(model_of(QWEN3), max_num_seqs=2, max_model_len=64)
    with pytest.raises(ValueError, match="structured_outputs needs the engine's tokenizer"):
        engine.add([1, 2], SamplingParams(structured_outputs={"regex": "a"}), 4)


def test_grammars_are_built_once_before_the_first_constrained_request(llm, monkeypatch):
    """``Engine.prepare_grammars`` builds xgrammar's vocabulary table up front (the server calls
    it as it starts); the first constrained request then builds nothing. The server's own check
    builds its copy in a worker thread, never on the event loop."""
    pytest.importorskip("xgrammar")
    import asyncio
    import threading

    from modeling.engine import engine as engine_module
    from modeling.serve.structured import GrammarCheck

    built = []
    real = engine_module.Grammars

    def counting(*args):
        built.append(threading.current_thread())
        return real(*args)

    monkeypatch.setattr(engine_module, "Grammars", counting)
    engine = Engine(llm.model, max_num_seqs=2, max_model_len=64, tokenizer=llm.tokenizer)
    engine.prepare_grammars()
    engine.prepare_grammars()
    assert len(built) == 1
    out = engine.generate([[1, 2]], SamplingParams(structured_outputs={"choice": ["ab", "cd"]}), 8)
    assert len(built) == 1 and llm.tokenizer.decode(out[0], skip_special_tokens=True) in ("ab", "cd")

    monkeypatch.setattr("modeling.serve.structured.Grammars", counting)
    check = GrammarCheck(llm.tokenizer, llm.model.config.vocab_size)

    async def serve():
        await check.prepare()
        await check.check(StructuredOutputs(regex="a+"), "structured_outputs")

    asyncio.run(serve())
    assert len(built) == 2 and built[1] is not threading.main_thread()


def test_a_completed_grammar_ends_its_sequence_even_with_ignore_eos(llm):
    """The grammar's stop token ends the output ("stop"), though ignore_eos drops EOS from the
    sequence's stop tokens: nothing may follow a completed grammar (the engine used to ask the
    finished matcher for another mask and fail the whole step)."""
    pytest.importorskip("xgrammar")
    params = [SamplingParams(max_tokens=20, ignore_eos=True, structured_outputs={"choice": ["alpha", "beta"]}),
              SamplingParams(max_tokens=20, ignore_eos=True)]
    constrained, free = (o.outputs[0] for o in llm.generate(["Hello", "Hello"], params, use_tqdm=False))
    assert constrained.finish_reason == "stop" and constrained.text in ("alpha", "beta")
    assert free.finish_reason == "length" and len(free.token_ids) == 20


def test_bounded_json_strings_refuse_raw_control_characters(llm, monkeypatch):
    """A string with maxLength takes what JSON allows raw (xgrammar's own class for it lets control
    characters through); without xgrammar, a constraint is an ImportError naming the package."""
    pytest.importorskip("xgrammar")
    grammars = Grammars(llm.tokenizer, llm.model.config.vocab_size)
    spec = StructuredOutputs(json={"type": "string", "maxLength": 4})
    for text, ok in (('"ab"', True), ('"a\x07', False), ('"a\t', False), ('"abcde', False)):
        assert grammars.matcher(spec).accept_string(text) is ok, text
    assert grammars.compile(spec) is grammars.compile(StructuredOutputs(json='{"type": "string", "maxLength": 4}'))
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ImportError, match="structured outputs need the xgrammar package: pip install xgrammar"):
        Grammars(llm.tokenizer, 64)


def test_json_properties_come_in_the_schemas_order(llm):
    """An object's properties are generated in the order its schema lists them (OpenAI's and
    vLLM's), not sorted by name."""
    pytest.importorskip("xgrammar")
    grammars = Grammars(llm.tokenizer, llm.model.config.vocab_size)
    spec = StructuredOutputs(json={"type": "object", "properties": {"zeta": {"type": "integer"},
                                                                    "alpha": {"type": "integer"}},
                                   "required": ["zeta", "alpha"]})
    assert grammars.matcher(spec).accept_string('{"zeta": 1, "alpha": 2}')
    assert not grammars.matcher(spec).accept_string('{"alpha": 2, "zeta": 1}')


def test_prompt_logprobs_are_the_models_own(llm, monkeypatch):
    """Entry i: token i's log-probability after tokens 0..i-1 and the top k, from the float64
    model rerun on each prefix; the first entry None. With n=2 the first completion's prefill
    computes them (the engine's other sequence asks for none)."""
    ids = llm.tokenizer.encode("ROMEO:\nWhat light")
    add, asked = Engine.add, []

    def recorded(engine, prompt_ids, params, *args):
        asked.append(params.prompt_logprobs)
        return add(engine, prompt_ids, params, *args)

    monkeypatch.setattr(Engine, "add", recorded)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(n=2, max_tokens=2, prompt_logprobs=3),
                       use_tqdm=False)[0]
    assert asked == [3, None]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        with torch.no_grad():
            lp = torch.log_softmax(llm.model(torch.tensor([ids[:i]]))[0, -1].double(), -1)
        entry = out.prompt_logprobs[i]
        assert entry[ids[i]].logprob == pytest.approx(lp[ids[i]].item(), abs=1e-5)
        top = lp.topk(3)
        assert list(entry)[:3] == top.indices.tolist() and [entry[t].rank for t in list(entry)[:3]] == [1, 2, 3]
        assert entry[ids[i]].rank == 1 + (lp > lp[ids[i]]).sum().item()  # among the top 3 or not
    assert llm.generate("x", SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_logprobs is None
    with pytest.raises(ValueError, match=r"prompt_logprobs must be an integer in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)


def test_a_grammar_dead_end_ends_its_sequence_alone(tmp_path):
    """A vocabulary that cannot finish a grammar: the word "a" starts the only instance "ab", but no
    word holds "b". After "a" the grammar allows nothing: that sequence ends ("abort", ``error``
    saying why) without the token drawn from the empty mask, while the free row beside it runs to
    its length; ``LLM`` raises naming the request (the engine used to fail the whole step, every
    request in it)."""
    pytest.importorskip("xgrammar")
    from modeling.engine.sequence import DEAD_END
    from modeling.model.random_checkpoint import build_random_checkpoint

    path = build_random_checkpoint(tmp_path / "words", tokenizer="words", vocab_size=64, hidden_size=32,
                                   intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    tokenizer_json = path / "tokenizer.json"
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"]
    del vocab[next(w for w, i in vocab.items() if i == 63)]
    vocab["a"] = 63
    tokenizer_json.write_text(json.dumps(data))
    llm = LLM(path, device="cpu", dtype=torch.float32, max_model_len=64)
    engine = Engine(llm.model, max_num_seqs=2, max_model_len=64, tokenizer=llm.tokenizer)
    stuck = engine.add([1, 2], SamplingParams(structured_outputs={"choice": ["ab"]}), 8)
    free = engine.add([1, 2], SamplingParams(ignore_eos=True), 8)
    while engine.has_work():
        engine.step()
    assert stuck.output_ids == [63] and stuck.finish_reason == "abort" and stuck.error == DEAD_END
    assert free.finish_reason == "length" and len(free.output_ids) == 8 and free.error is None
    with pytest.raises(RuntimeError, match="request 0: its grammar allows no token of the model's vocabulary"):
        llm.generate("x", SamplingParams(max_tokens=8, structured_outputs={"choice": ["ab"]}), use_tqdm=False)
