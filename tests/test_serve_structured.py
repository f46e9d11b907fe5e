"""Structured outputs and the request extras through a real server (``python -m modeling.serve``
on the shipped model) and the official openai client: 200 requests with random JSON schemas
from a fixed generator, at 32 at a time, all finish with "stop" and validate; regex, choice,
json_object and grammar constraints hold; each extra (logit_bias, allowed_token_ids,
bad_words, min_tokens, include_stop_str_in_output, truncate_prompt_tokens) has its effect.
"""
import asyncio
import json
import random
import re

import pytest

from tests.test_serve import NAME, PROMPT, Server, wait_idle

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

SCHEMAS = 200
MAX_BUDGET = 400
"""The most new tokens a generated schema may need (the model's context is 512)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("structured"), "structured", "--max-num-seqs", "32")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema whose instances are bounded: strings of at most 16 characters, integers in a
    range, arrays of at most 4 items, objects of at most 3 properties, nesting at most 3 deep."""
    kinds = ["string", "integer", "boolean", "null", "enum"] + (["array", "object"] if depth < 2 else [])
    kind = "object" if depth == 0 else rng.choice(kinds)
    if kind == "string":
        longest = rng.randint(0, 16)
        return {"type": "string", "minLength": rng.randint(0, min(longest, 3)), "maxLength": longest}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 22, None, True, "x y"], rng.randint(1, 4))}
    if kind == "array":
        most = rng.randint(1, 4)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, most),
                "maxItems": most}
    names = rng.sample(["id", "name", "tags", "ok", "count", "kind", "v"], rng.randint(1, 3))
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": sorted(rng.sample(names, rng.randint(0, len(names)))), "additionalProperties": False}


def budget(schema: dict) -> int:
    """New tokens enough for any instance of ``schema`` in xgrammar's compact JSON (a token per
    character at worst; a string character at worst a 6-character escape)."""
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return 2 + 6 * schema["maxLength"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind in ("boolean", "null"):
        return 5
    if kind == "array":
        return 2 + schema["maxItems"] * (budget(schema["items"]) + 2)
    return 2 + sum(len(n) + 6 + budget(s) for n, s in schema["properties"].items())


def schemas(count: int, seed: int = 0):
    rng = random.Random(seed)
    while count:
        schema = random_schema(rng)
        if budget(schema) <= MAX_BUDGET:
            count -= 1
            yield schema


def test_200_random_schemas_finish_with_stop_and_validate(server):
    """Every request finishes once, with "stop" and a valid instance; the server's counters add up
    and the engine ends idle (the load test with constraints: nothing lost or duplicated)."""
    before = wait_idle(server)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    gate = asyncio.Semaphore(32)
    cases = list(schemas(SCHEMAS))

    async def one(i: int, schema: dict):
        async with gate:
            r = await client.completions.create(
                model=NAME, prompt=f"{PROMPT} {i}", max_tokens=budget(schema) + 1, temperature=1.0, seed=i,
                extra_body={"response_format": {"type": "json_schema",
                                                "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}})
        return r.id, r.choices[0], r.usage

    async def run():
        try:
            return await asyncio.gather(*(one(i, s) for i, s in enumerate(cases)))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert len({rid for rid, _, _ in results}) == SCHEMAS
    for (_, choice, _), schema in zip(results, cases):
        assert choice.finish_reason == "stop", (schema, choice.text)
        jsonschema.validate(json.loads(choice.text), schema)
    after = wait_idle(server)
    key = 'qwen_serve_request_success_total{finish_reason="stop"}'
    assert after.get(key, 0) - before.get(key, 0) == SCHEMAS
    assert after["qwen_serve_generation_tokens_total"] - before.get("qwen_serve_generation_tokens_total", 0) == \
        sum(u.completion_tokens for _, _, u in results)


def test_regex_choice_grammar_and_json_object_hold(server):
    client = server.client()
    pattern = r"[a-d]{2,4}-\d{3}"
    for seed in range(2):
        for body in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
            text = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=seed,
                                             extra_body=body).choices[0].text
            assert re.fullmatch(pattern, text), text
        choices = ["yes", "no", "maybe later"]
        for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
            assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=seed,
                                             extra_body=body).choices[0].text in choices
        grammar = 'root ::= "(" [0-9]+ ")" | "none"'
        text = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=seed,
                                         extra_body={"guided_grammar": grammar}).choices[0]
        assert text.finish_reason == "length" or re.fullmatch(r"\(\d+\)|none", text.text), text
        reply = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=48, temperature=1.0, seed=seed,
                                               response_format={"type": "json_object"}).choices[0]
        if reply.finish_reason == "stop":
            assert isinstance(json.loads(reply.message.content), dict)


def test_streamed_constrained_output_equals_the_whole(server):
    client = server.client()
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                "b": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
              "required": ["a", "b"], "additionalProperties": False}
    args = dict(model=NAME, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=3,
                extra_body={"structured_outputs": {"json": schema}})
    whole = client.completions.create(**args).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), schema)


# ---------------------------------------------------------------------------------------------
# the request extras


def ids_of(choice) -> list:
    return choice.model_extra["token_ids"]


def test_request_extras_have_their_effect(server):
    client = server.client()
    args = dict(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
    plain = client.completions.create(**args).choices[0]
    greedy = ids_of(plain)

    def run(**extra):
        return client.completions.create(**{**args, "extra_body": {"return_token_ids": True, **extra}}).choices[0]

    assert set(ids_of(run(logit_bias={"300": 100}))) == {300}
    banned = {str(t): -100 for t in greedy}
    assert not set(ids_of(run(logit_bias=banned))) & set(greedy)
    allowed = [5, 77, 300, 1000]
    assert set(ids_of(run(allowed_token_ids=allowed))) <= set(allowed)
    word = plain.text.split()[0]
    assert word not in run(bad_words=[word]).text.split()
    early = run(stop_token_ids=[greedy[1]])
    assert len(ids_of(early)) == 2 and early.finish_reason == "stop"
    late = run(stop_token_ids=[greedy[1]], min_tokens=6)
    assert len(ids_of(late)) >= 6 and greedy[1] not in ids_of(late)[:6]
    stop = plain.text[4:7]
    kept = run(stop=[stop], include_stop_str_in_output=True)
    assert kept.text == plain.text[:plain.text.index(stop) + len(stop)] and kept.finish_reason == "stop"
    short = client.completions.create(**{**args, "extra_body": {"truncate_prompt_tokens": 3}})
    assert short.usage.prompt_tokens == 3
