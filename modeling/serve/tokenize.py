"""``/tokenize`` and ``/detokenize``, in vLLM's shapes.

``POST /tokenize`` takes a prompt (``{"prompt": str, "add_special_tokens": true}``) or a conversation
(``{"messages": [...], "add_generation_prompt": true, "chat_template_kwargs", "tools"}``, rendered as
``/v1/chat/completions`` renders it) and answers ``{"count", "max_model_len", "tokens",
"token_strs"}`` (``token_strs``: each token's string when ``return_token_strs`` is true, else
null). ``POST /detokenize`` takes ``{"tokens": [ids]}`` and answers ``{"prompt": text}`` (``""`` for
no tokens).
"""

import json
from typing import Any, Dict, List, Optional

from ..api.checkpoint import Checkpoint
from ..engine.prompts import checked_token_ids
from .errors import invalid
from .protocol import Fields, chat_messages, parse, render_chat, render_tools


class TokenizeCompletionRequest(Fields):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Fields):
    model: Optional[str] = None
    messages: List[Dict[str, Any]]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    tools: Optional[List[Dict[str, Any]]] = None


class DetokenizeRequest(Fields):
    model: Optional[str] = None
    tokens: List[Any]


def tokenize_request(body: bytes, strict: bool) -> Fields:
    """The body as a chat request when it holds ``messages``, else as a prompt (a 400 naming a bad field)."""
    try:
        chat = "messages" in json.loads(body)
    except (ValueError, TypeError):  # not JSON, or not an object: ``parse`` says which
        chat = False
    return parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body, strict)


def tokenize(req: Fields, ck: Checkpoint, max_model_len: int) -> Dict[str, Any]:
    """The response of ``/tokenize``."""
    if isinstance(req, TokenizeChatRequest):
        text = render_chat(ck, chat_messages(req.messages), req.add_generation_prompt,
                           dict(req.chat_template_kwargs or {}), render_tools(req.tools, ck))
        where = "messages"
    else:
        text, where = req.prompt, "prompt"
    try:
        ids = ck.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    except ValueError as e:
        raise invalid(f"'{where}': {e}", where) from None
    strs = [ck.tokenizer.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(req: DetokenizeRequest, ck: Checkpoint) -> Dict[str, Any]:
    """The response of ``/detokenize``: the ids' text, special tokens included, ``""`` for no ids
    (as vLLM's)."""
    if not req.tokens:
        return {"prompt": ""}
    try:
        ids = checked_token_ids(req.tokens, "tokens", ck.config.vocab_size)
    except ValueError as e:
        raise invalid(str(e), "tokens") from None
    return {"prompt": ck.tokenizer.decode(ids)}
