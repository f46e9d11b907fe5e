"""Request bodies of /v1/completions and /v1/chat/completions: parsed and validated (pydantic,
strict JSON types), then turned into a ``Plan``: each prompt's token ids, each choice's
``SamplingParams``, the new-token budget, what to parse out of the text.

Unknown fields are logged and ignored, as vLLM does (clients send vLLM's and other servers'
extras), or refused under ``--strict-requests`` (``parse``). The OpenAI parameters this server does
not implement (``REFUSED``) are refused unless neutral. Parameters left out take the checkpoint's
generation_config.json values, as vLLM does by default.
"""

import logging
import re
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from ..api.checkpoint import Checkpoint, TemplateKwargsError
from ..common import is_int
from ..chat.messages import MessageError, template_messages
from ..chat.template import ChatTemplateError
from ..engine.prompts import checked_token_ids
from ..engine.sampling_params import MAX_LOGPROBS, SamplingParams, choice_params
from ..engine.structured_outputs import StructuredOutputs
from .errors import APIError, invalid, unsupported
from .chat_output import TOOL_PARSERS
from .structured import structured_of
from .tool_choice import forced_call_grammar

MAX_N = 16
"""Choices per prompt at most."""
MAX_STOP_STRINGS = 16
"""Stop strings a request may give at most (OpenAI's API takes 4)."""
MAX_STOP_CHARS = 1024
"""Characters of a request's stop strings together, at most."""
DEFAULT_COMPLETION_TOKENS = 16
"""max_tokens of /v1/completions when neither the request nor generation_config.json says (OpenAI's)."""

log = logging.getLogger("modeling.serve")


class Fields(BaseModel):
    """A request body or a part of one: strict JSON types, no NaN or infinity; fields it does not
    declare are kept aside (``unknown_fields``) for ``parse`` to log or refuse."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(Fields):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, each chunk its choice's usage so far


class _Request(Fields):
    """Fields both endpoints take: OpenAI's and vLLM's extensions."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    n: int = 1
    stop: Union[str, List[str], None] = None
    stop_token_ids: Optional[List[int]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    user: Optional[str] = None  # an end-user id for the caller's records: accepted, unused
    logit_bias: Optional[Dict[str, float]] = None  # token id (a string, as JSON keys are) -> bias
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    allowed_token_ids: Optional[List[int]] = None
    bad_words: Optional[List[str]] = None
    truncate_prompt_tokens: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    # constraints on the output (``structured.structured_of``): at most one of these
    response_format: Optional[Dict[str, Any]] = None
    structured_outputs: Optional[Dict[str, Any]] = None
    guided_json: Union[str, Dict[str, Any], None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = None
    guided_grammar: Optional[str] = None


class CompletionRequest(_Request):
    prompt: Any  # a str, a list of str, a list of token ids, a list of such lists (``completion_prompts``)
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None  # refused
    best_of: Optional[int] = None  # refused unless equal to n


class ChatCompletionRequest(_Request):
    messages: List[Dict[str, Any]]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Union[str, Dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    add_generation_prompt: bool = True
    # OpenAI parameters refused whenever set (see REFUSED)
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[Any] = None
    prediction: Optional[Any] = None
    reasoning_effort: Optional[Any] = None
    web_search_options: Optional[Any] = None
    # OpenAI's informational fields: accepted, nothing is stored and there is one tier
    service_tier: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[Dict[str, str]] = None


REFUSED = {
    "suffix": "no insertion (fill-in-the-middle) completions",
    "best_of": "no server-side best-of selection (use n)",
    "functions": "use 'tools'",
    "function_call": "use 'tool_choice'",
    "audio": "text only",
    "modalities": "text only",
    "prediction": "no predicted outputs",
    "reasoning_effort": "use chat_template_kwargs {\"enable_thinking\": false} to turn Qwen3's thinking off",
    "web_search_options": "no web search",
}
"""OpenAI parameters this server refuses (400) unless neutral, and why."""

_TYPE_TAG = re.compile(r"^(str|int|float|bool|dict|list|none)$|\[")
"""pydantic's names for the members of a union in an error's location (``str``, ``list[int]``)."""
_UNION_MESSAGES = {"stop": "must be a string or a list of strings",
                   "tool_choice": "must be \"auto\", \"none\" or an object"}


def parse(model: type, body: bytes, strict: bool = False) -> Any:
    """``model`` validated from the JSON ``body``; a 400 naming the first bad field otherwise.
    Fields ``model`` does not declare are logged and ignored, or refused (a 400 naming the first)
    when ``strict``."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    unknown = unknown_fields(req)
    if unknown and strict:
        raise invalid(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0].split(".")[0])
    if unknown:
        log.warning("The following fields were present in the request but ignored: %s", ", ".join(unknown))
    return req


def unknown_fields(req: Fields, prefix: str = "") -> List[str]:
    """The dotted names of the fields of ``req`` and of its parts that their models do not declare."""
    out = [prefix + name for name in req.model_extra or {}]
    for name in type(req).model_fields:
        value = getattr(req, name)
        if isinstance(value, Fields):
            out += unknown_fields(value, f"{prefix}{name}.")
    return out


def _validation_error(e: ValidationError) -> APIError:
    """The 400 of pydantic's first error (it names the field)."""
    err = e.errors()[0]
    loc = [x for i, x in enumerate(err["loc"]) if i == 0 or not (isinstance(x, str) and _TYPE_TAG.search(x))]
    param = str(loc[0]) if loc else None
    if err["type"] == "json_invalid":
        return invalid(f"the request body is not valid JSON: {err['msg']}")
    if err["type"] == "model_type":
        if loc:
            return invalid(f"'{_path(loc)}' must be a JSON object", param)
        return invalid("the request body must be a JSON object")
    if err["type"] == "missing":
        return invalid(f"'{_path(loc)}' is required", param)
    message = _UNION_MESSAGES.get(param) if len(loc) == 1 else None
    return invalid(f"'{_path(loc)}' {message or err['msg'][:1].lower() + err['msg'][1:]}", param)


def _path(loc: List[Any]) -> str:
    return "".join(f"[{x}]" if isinstance(x, int) else (f".{x}" if i else str(x)) for i, x in enumerate(loc))


# ---------------------------------------------------------------------------------------------
# the plan


@dataclass
class Prompt:
    text: Optional[str]  # None for a prompt given as token ids
    ids: List[int]


@dataclass
class Plan:
    """What one request runs: ``n`` choices per prompt, choice ``i * n + j`` of prompt i with
    ``params[i * n + j]``, ``max_tokens[i]`` new tokens at most, finished by ``stop_ids``."""

    prompts: List[Prompt]
    n: int
    params: List[SamplingParams]
    max_tokens: List[int]
    stop_ids: List[int]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logprobs: Optional[int]  # top logprobs per token when asked for logprobs, else None
    echo: bool = False  # with logprobs, the echoed prompt's tokens get theirs (the engine's prompt logprobs)
    prompt_logprobs: Optional[int] = None  # vLLM's prompt_logprobs shown (top tokens per prompt token), else None
    continuous_usage: bool = False  # each streamed chunk carries its choice's usage so far (with include_usage)
    tool_calls: bool = False  # parse Qwen's <tool_call> blocks out of the reply
    parallel_tool_calls: bool = True  # False: the first tool call of a reply only
    reasoning: bool = False  # parse Qwen3's <think> block out of the reply
    prompt_text: str = ""  # the rendered chat prompt (where a <think> block may already be open)
    constraint_field: Optional[str] = None  # the field the output constraint came from, if any
    tool_form: str = "json"  # the tool-call form parsed ("json" or "xml", chat_output)
    tool_types: Optional[Dict[str, Dict[str, Any]]] = None  # function -> parameter -> schema


def _refuse_neutral(req: _Request) -> None:
    neutral = {"best_of": req.n, "suffix": ""}  # besides None
    for name, why in REFUSED.items():
        value = getattr(req, name) if name in type(req).model_fields else None
        if value is not None and (name not in neutral or value != neutral[name]):
            raise unsupported(name, why)


def _sampling(req: _Request, ck: Checkpoint, logprobs: Optional[int],
              structured: Optional[StructuredOutputs] = None, prompt_logprobs: Optional[int] = None) -> SamplingParams:
    """The request's sampling values over the checkpoint's defaults (a 400 naming a bad value),
    with the output constraint ``structured`` (``structured.structured_of``) and the engine's
    ``prompt_logprobs``."""
    if req.n < 1 or req.n > MAX_N:
        raise invalid(f"'n' must be an integer in [1, {MAX_N}], got {req.n}", "n")
    given = {name: getattr(req, name) for name in ("temperature", "top_k", "top_p", "min_p", "presence_penalty",
                                                   "frequency_penalty", "repetition_penalty", "seed")}
    given = {k: v for k, v in given.items() if v is not None}
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS or sum(map(len, stop)) > MAX_STOP_CHARS:
        raise invalid(f"'stop' takes at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters together, "
                      f"got {len(stop)} of {sum(map(len, stop))}", "stop")
    bias = _logit_bias(req.logit_bias, ck.config.vocab_size)
    outside = [t for t in req.allowed_token_ids or () if not 0 <= t < ck.config.vocab_size]
    if outside:
        raise invalid(f"'allowed_token_ids' {outside[:4]} lie outside the model's vocabulary "
                      f"[0, {ck.config.vocab_size})", "allowed_token_ids")
    try:
        return replace(ck.default_sampling_params(), **given, max_tokens=None, stop=tuple(stop),
                       stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                       skip_special_tokens=req.skip_special_tokens, logprobs=logprobs, min_tokens=req.min_tokens,
                       include_stop_str_in_output=req.include_stop_str_in_output, logit_bias=bias,
                       allowed_token_ids=req.allowed_token_ids, bad_words=tuple(req.bad_words or ()),
                       truncate_prompt_tokens=req.truncate_prompt_tokens, structured_outputs=structured,
                       prompt_logprobs=prompt_logprobs)
    except ValueError as e:  # SamplingParams names each bad value: "temperature must be ..."
        first = str(e).split("; ")[0]
        name = re.match(r"(?:stop strings|(\w+))", first)
        raise invalid(str(e), (name.group(1) or "stop") if name else None) from None


def _limit(req: _Request) -> Tuple[Optional[int], str]:
    """The request's limit on new tokens (None when not given) and its field, ``max_completion_tokens``
    when the request gives it, else ``max_tokens``; a 400 naming the field when the limit is below 1,
    or naming ``min_tokens`` when that exceeds it."""
    given = getattr(req, "max_completion_tokens", None)
    field = "max_completion_tokens" if given is not None else "max_tokens"
    limit = given if given is not None else req.max_tokens
    if limit is not None and limit < 1:
        raise invalid(f"'{field}' must be an integer >= 1, got {limit}", field)
    if limit is not None and req.min_tokens > limit:
        raise invalid(f"min_tokens ({req.min_tokens}) must not exceed {field} ({limit})", "min_tokens")
    return limit, field


def _logit_bias(bias: Optional[Dict[str, float]], vocab: int) -> Optional[Dict[int, float]]:
    """OpenAI's ``logit_bias`` (token ids as strings) keyed by int (a 400 for a key that is no
    token id of the vocabulary: not decimal digits alone, or too large); None when absent or empty."""
    for key in bias or ():
        # isdecimal, not isdigit: "\u00b2" is a digit int() refuses; the length bound keeps int() from
        # refusing a key of thousands of digits
        if not (key.isdecimal() and len(key.lstrip("0")) <= len(str(vocab)) and int(key) < vocab):
            raise invalid(f"'logit_bias' keys must be token ids in [0, {vocab}), got {key!r}", "logit_bias")
    return {int(key): value for key, value in bias.items()} if bias else None


def truncated(prompts: List[Prompt], keep: Optional[int]) -> List[Prompt]:
    """``prompts`` cut to their last ``keep`` tokens (None: as they are); a cut prompt's text is
    dropped (it no longer spells the ids)."""
    if keep is None:
        return prompts
    return [p if len(p.ids) <= keep else Prompt(None, p.ids[-keep:]) for p in prompts]


def _budget(prompts: List[Prompt], requested: Optional[int], default: Optional[int], max_model_len: int,
            field: str, what: str) -> List[int]:
    """New tokens per prompt: ``requested`` (``field``, checked by ``_limit``; a 400 if a prompt and it
    exceed the context), else ``default`` cut to the room left, else all the room left; ``what``: the
    prompts' field."""
    out = []
    for p in prompts:
        room = max_model_len - len(p.ids)
        if room < 1:
            raise invalid(f"This model's maximum context length is {max_model_len} tokens; the {what} has "
                          f"{len(p.ids)} tokens, which leaves no room for a new token. Shorten the {what}.", what,
                          "context_length_exceeded")
        if requested is not None and requested > room:
            raise invalid(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{len(p.ids) + requested} tokens ({len(p.ids)} in the {what}, {requested} in the "
                          f"completion). Reduce the {what} or '{field}'.", field, "context_length_exceeded")
        out.append(requested if requested is not None else min(default or room, room))
    return out


def _stop_ids(ck: Checkpoint, params: SamplingParams) -> List[int]:
    try:
        return ck.stop_ids(params)
    except ValueError as e:
        raise invalid(str(e), "stop_token_ids") from None


def completion_prompts(prompt: Any, ck: Checkpoint) -> List[Prompt]:
    """``prompt`` as OpenAI takes it: a str, a list of str, a list of token ids, or a list of lists
    of token ids (a token id is an integer in the vocabulary, never a float or a bool)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(map(is_int, prompt))):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise invalid("'prompt' must be a string, a list of strings, a list of token ids or a list of lists of "
                      "token ids (not empty)", "prompt")
    out, vocab = [], ck.config.vocab_size
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 and item is prompt else f"prompt[{i}]"
        text = item if isinstance(item, str) else None
        if text is None and not isinstance(item, list):
            raise invalid(f"'{where}' must be a string or a list of token ids", "prompt")
        try:
            ids = ck.tokenizer.encode(text) if text is not None else checked_token_ids(item, where, vocab)
        except ValueError as e:  # the ids' errors name the prompt
            raise invalid(f"'{where}': {e}" if text is not None else str(e), "prompt") from None
        if not ids:
            raise invalid(f"'{where}' is empty", "prompt")
        out.append(Prompt(text, ids))
    return out


def plan_completion(req: CompletionRequest, ck: Checkpoint, max_model_len: int) -> Plan:
    """What a completion request runs. ``echo`` with ``logprobs`` asks the engine for the prompt's
    logprobs too (the larger of ``logprobs`` and ``prompt_logprobs`` top tokens), as vLLM does."""
    _refuse_neutral(req)
    shown = _prompt_logprobs(req)
    asked = max((k for k in (shown, req.logprobs if req.echo else None) if k is not None), default=None)
    structured, field = structured_of(req)
    limit, limit_field = _limit(req)
    base = _sampling(req, ck, req.logprobs, structured, asked)
    prompts = truncated(completion_prompts(req.prompt, ck), base.truncate_prompt_tokens)
    default = ck.defaults.max_new_tokens or DEFAULT_COMPLETION_TOKENS
    budget = _budget(prompts, limit, default, max_model_len, limit_field, "prompt")
    # choice j of each prompt; in a stream each computes the prompt logprobs (its first chunk echoes them)
    params = [choice_params(base, j, req.stream) for _ in prompts for j in range(req.n)]
    return Plan(prompts, req.n, params, budget, _stop_ids(ck, base), req.stream, _include_usage(req),
                req.return_token_ids, req.logprobs, echo=req.echo, prompt_logprobs=shown, constraint_field=field,
                continuous_usage=_continuous_usage(req))


def _prompt_logprobs(req: _Request) -> Optional[int]:
    """The ``prompt_logprobs`` the response shows: a 400 outside [0, MAX_LOGPROBS], or above 0 with
    ``stream`` (vLLM's rule: a stream shows none, and 0 passes)."""
    k = req.prompt_logprobs
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise invalid(f"'prompt_logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {k}", "prompt_logprobs")
    if k is not None and req.stream:
        if k > 0:
            raise invalid("'prompt_logprobs' is not available with 'stream': true", "prompt_logprobs")
        return None
    return k


def _include_usage(req: _Request) -> bool:
    if req.stream_options is not None and not req.stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return req.stream_options is not None and req.stream_options.include_usage


def _continuous_usage(req: _Request) -> bool:
    """vLLM's ``continuous_usage_stats``: only with ``include_usage`` (alone it changes nothing, as in vLLM)."""
    return _include_usage(req) and req.stream_options.continuous_usage_stats


def chat_messages(messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The messages as the chat template takes them (``modeling.chat.messages``), or a 400 naming
    the malformed one (a content part that is not text: "not supported")."""
    try:
        return template_messages(messages)
    except MessageError as e:
        raise (unsupported(e.field, e.detail) if e.unsupported else invalid(e.detail, "messages")) from None


def forced_tools(req: ChatCompletionRequest, tools: Optional[List[Dict[str, Any]]]) -> Optional[List[Dict[str, Any]]]:
    """The tools one of which the reply must call (``tool_choice`` "required": any; a named
    function: that one), None when the reply is free; a 400 naming what is wrong."""
    choice = req.tool_choice
    if choice not in ("required",) and not isinstance(choice, dict):
        return None
    if not tools:
        raise invalid("'tool_choice' forces a call, but no 'tools' are given", "tool_choice")
    if choice == "required":
        return tools
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise invalid("'tool_choice' must be {\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    named = [t for t in tools if t["function"]["name"] == name]
    if not named:
        raise invalid(f"'tool_choice' names {name!r}, which is not among 'tools'", "tool_choice")
    return named


def _mentions(ck: Checkpoint, text: str) -> bool:
    """Whether ``text`` occurs in the checkpoint's chat template or in one of its named ones."""
    template = ck.chat_template
    return any(text in source for source in (template.source, *template.named.values()))


def tool_form(ck: Checkpoint, parser: Optional[str]) -> str:
    """The tool-call form to parse and force: ``parser`` (``--tool-call-parser``) when given, else
    "xml" when the chat template writes ``<function=`` calls, else "json"."""
    if parser is not None:
        return TOOL_PARSERS[parser]
    return "xml" if _mentions(ck, "<function=") else "json"


def render_tools(tools: Optional[List[Dict[str, Any]]], ck: Checkpoint,
                 render: bool = True) -> Optional[List[Dict[str, Any]]]:
    """``tools`` checked (each ``{"type": "function", "function": {"name": ...}}``, its
    ``parameters`` as ``_check_parameters`` wants them), or None for none or when not ``render``
    (``tool_choice`` "none"); a 400 for tools given to a chat template that never reads them (they
    would be dropped unseen)."""
    for i, tool in enumerate(tools or []):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
        _check_parameters(fn.get("parameters"), f"tools[{i}].function.parameters")
    if not tools or not render:
        return None
    if not _mentions(ck, "tools"):
        raise unsupported("tools", f"the checkpoint's chat template ({ck.chat_template.origin}) does not render tools")
    return tools


def _check_parameters(params: Any, where: str) -> None:
    """A 400 (param ``tools``) unless the function's ``parameters`` schema is absent or a JSON
    object whose ``properties``, if given, is an object of schema objects and whose ``required``,
    if given, is a list of strings: the parts the server reads itself (forced calls, XML values)."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise invalid(f"'{where}' must be a JSON Schema object", "tools")
    props = params.get("properties")
    if props is not None and not (isinstance(props, dict) and all(isinstance(s, dict) for s in props.values())):
        raise invalid(f"'{where}.properties' must be an object of JSON Schema objects", "tools")
    required = params.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(k, str) for k in required)):
        raise invalid(f"'{where}.required' must be a list of strings", "tools")


def render_chat(ck: Checkpoint, messages: List[Dict[str, Any]], add_generation_prompt: bool,
                template_kwargs: Dict[str, Any], tools: Optional[List[Dict[str, Any]]]) -> str:
    """The prompt text of a conversation (``Checkpoint.render_chat``), or a 400 saying why not."""
    try:
        return ck.render_chat(messages, add_generation_prompt, chat_template_kwargs=template_kwargs, tools=tools)
    except TemplateKwargsError as e:
        raise invalid(str(e), "chat_template_kwargs") from None
    except (ChatTemplateError, ValueError) as e:
        raise invalid(f"the chat template could not render these messages: {e}", "messages") from None


def plan_chat(req: ChatCompletionRequest, ck: Checkpoint, max_model_len: int,
              tool_parser: Optional[str] = None) -> Plan:
    """What a chat request runs; ``tool_parser``: ``--tool-call-parser`` (None: from the template)."""
    _refuse_neutral(req)
    if None not in (req.max_tokens, req.max_completion_tokens) and req.max_tokens != req.max_completion_tokens:
        raise invalid("'max_tokens' and 'max_completion_tokens' differ: give one", "max_completion_tokens")
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise invalid(f"'top_logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                      "top_logprobs")
    messages = chat_messages(req.messages)
    choice = req.tool_choice
    if not (choice in (None, "auto", "none", "required") or isinstance(choice, dict)):
        raise invalid(f"'tool_choice' must be \"auto\", \"none\", \"required\" or an object, got {choice!r}",
                      "tool_choice")
    tools = render_tools(req.tools, ck, render=choice != "none")
    kwargs = dict(req.chat_template_kwargs or {})
    text = render_chat(ck, messages, req.add_generation_prompt, kwargs, tools)
    try:
        ids = ck.tokenizer.encode(text)
    except ValueError as e:
        raise invalid(f"the chat template could not render these messages: {e}", "messages") from None
    if not ids:
        raise invalid("the rendered conversation is empty", "messages")
    structured, constraint = structured_of(req)
    form = tool_form(ck, tool_parser)
    forced = forced_tools(req, tools)
    if forced is not None:
        if structured is not None:
            raise invalid(f"'tool_choice' forces a call: no '{constraint}' with it", "tool_choice")
        try:
            grammar = forced_call_grammar(forced, form)
        except ImportError as e:
            raise invalid(str(e), "tool_choice") from None
        except ValueError as e:
            raise invalid(f"'tools': {e}", "tools") from None
        structured, constraint = StructuredOutputs(grammar=grammar), "tool_choice"
    shown = _prompt_logprobs(req)
    limit, field = _limit(req)
    base = _sampling(req, ck, (req.top_logprobs or 0) if req.logprobs else None, structured, shown)
    prompts = truncated([Prompt(text, ids)], base.truncate_prompt_tokens)
    budget = _budget(prompts, limit, ck.defaults.max_new_tokens, max_model_len, field, "messages")
    types = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties") or {}
             for t in tools or ()}
    # the reply may hold a <think> block: the template knows the tag and the request did not turn it off
    thinking = _mentions(ck, "<think>") and kwargs.get("enable_thinking", True) is not False
    return Plan(prompts, req.n, [choice_params(base, j) for j in range(req.n)], budget, _stop_ids(ck, base), req.stream,
                _include_usage(req), req.return_token_ids, base.logprobs, prompt_logprobs=shown,
                tool_calls=tools is not None, parallel_tool_calls=req.parallel_tool_calls is not False,
                reasoning=thinking, prompt_text=text, constraint_field=constraint, tool_form=form, tool_types=types,
                continuous_usage=_continuous_usage(req))
