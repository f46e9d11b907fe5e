"""Qwen tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, ChatML token ids (``chat``,
with ``modeling.chat.template.format_chat``), and an incremental detokenizer for streaming."""

from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from ..chat.template import Message, format_chat
from ..model.files import TOKENIZER_LIMIT, read_file, read_json


class QwenTokenizer:
    """Encode/decode with a checkpoint's tokenizer. ``eos_token_ids``: the end-of-sequence ids of
    generation_config.json (``eos_token_id``, int or list), tokenizer_config.json (``eos_token``) and
    config.json (``eos_token_id``), in that order, without repeats; ``pad_token_id``:
    tokenizer_config.json's ``pad_token`` (None if absent). All files but tokenizer.json may be absent
    (each is read with ``modeling.model.files``). ``from_pretrained(path, vocab_size)``: an EOS id at or
    above the model's ``vocab_size`` (one it can never produce) is a ``ValueError`` naming its file."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Sequence[int], pad_token_id: Optional[int] = None):
        self.tokenizer = tokenizer
        self.eos_token_ids: Tuple[int, ...] = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id

    @classmethod
    def from_pretrained(cls, path: Union[str, Path], vocab_size: Optional[int] = None) -> "QwenTokenizer":
        path = Path(path)
        data = read_file(path / "tokenizer.json", TOKENIZER_LIMIT)
        try:
            tokenizer = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # the Rust side raises plain Exception: a ValueError with its text
            raise ValueError(f"tokenizer.json: {' '.join(str(e).split()) or type(e).__name__}") from None
        tokenizer_config = read_json(path / "tokenizer_config.json", optional=True)
        eos = []
        for ids, where in ((_eos_ids(read_json(path / "generation_config.json", optional=True),
                                     "generation_config.json"), "generation_config.json: eos_token_id"),
                           (_token_ids(tokenizer, tokenizer_config, "eos_token"), "tokenizer_config.json: eos_token"),
                           (_eos_ids(read_json(path / "config.json", optional=True), "config.json"),
                            "config.json: eos_token_id")):
            outside = [i for i in ids if vocab_size is not None and i >= vocab_size]
            if outside:
                raise ValueError(f"{where} {outside[0]} lies outside the model's vocabulary [0, {vocab_size})")
            eos += ids
        pad = _token_ids(tokenizer, tokenizer_config, "pad_token")
        return cls(tokenizer, list(dict.fromkeys(eos)), pad[0] if pad else None)

    @property
    def special_tokens(self) -> Dict[str, int]:
        """The special added tokens (``<|im_start|>``, ``<|im_end|>``, ...) and their ids."""
        added = self.tokenizer.get_added_tokens_decoder()
        return {token.content: i for i, token in sorted(added.items()) if token.special}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) are matched;
        ``add_special_tokens``: what tokenizer.json's post-processor adds (none for Qwen's).
        ``ValueError`` for text that is not a str or not valid Unicode (``unicode_error``).
        ``encode_batch_fast`` skips the character offsets nothing here reads (faster)."""
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a str, got {type(text).__name__}")
        problem = unicode_error(text)
        if problem:
            raise ValueError(f"the text {problem}")
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> List[int]:
        """Token ids of ``format_chat(messages, add_generation_prompt)``."""
        return self.encode(format_chat(messages, add_generation_prompt))


class IncrementalDetokenizer:
    """Turns token ids, one at a time, into newly completed text.

    Steps ``tokenizers.decoders.DecodeStream`` (its windowed decode runs in Rust: faster a token
    than two ``decode`` calls from Python, which a server pays for every streamed token): text
    ending in U+FFFD (an incomplete multi-byte UTF-8 character) is held back until the following
    tokens complete it. ``flush`` returns what is still held back, decoded the same way (the tail of
    a completion that ends inside a character, which DecodeStream lacks).
    """

    def __init__(self, tokenizer: QwenTokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: List[int] = []
        self.prefix_offset = 0  # start of the last emitted text's window: flush's context
        self.read_offset = 0  # ids before this have been emitted
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token id; return the text it completes ('' if none yet)."""
        self.ids.append(int(token_id))
        text = self._stream.step(self.tokenizer.tokenizer, self.ids[-1])
        if text is None:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes as U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        text = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.ids)
        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        return text[len(prefix_text):]


def unicode_error(text: str) -> Optional[str]:
    """None for text that encodes as UTF-8; else what is wrong with it, e.g. "is not valid UTF-8
    (byte 0xe9 at character 3)" for a byte that Python kept as a surrogate escape (a command line
    argument or file name in another encoding), or "holds a lone surrogate U+D800 at character 0"."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        if 0xDC80 <= code <= 0xDCFF:
            return f"is not valid UTF-8 (byte 0x{code - 0xDC00:02x} at character {e.start})"
        return f"holds a lone surrogate U+{code:04X} at character {e.start}"


def _token_ids(tokenizer: Tokenizer, tokenizer_config: Mapping[str, Any], field: str) -> List[int]:
    """[id] of the token named by ``tokenizer_config[field]`` (a string or {"content": ...}), or []."""
    token = tokenizer_config.get(field)
    if isinstance(token, dict):
        token = token.get("content")
    if token is None:
        return []
    if not isinstance(token, str):
        raise ValueError(f"tokenizer_config.json {field} must be a string or {{\"content\": ...}}, got {token!r}")
    if tokenizer.token_to_id(token) is None:
        raise ValueError(f"tokenizer_config.json {field} {token!r} is not in tokenizer.json")
    return [tokenizer.token_to_id(token)]


def _eos_ids(config: Mapping[str, Any], name: str) -> List[int]:
    """``eos_token_id`` of a config dict (an int, a list of ints, or absent/null) as a list;
    ``ValueError`` naming the file (``name``) for anything else."""
    ids = config.get("eos_token_id")
    if ids is None:
        return []
    values = ids if isinstance(ids, list) else [ids]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**63 for i in values):
        raise ValueError(f"{name}: eos_token_id must be a token id (an integer >= 0) or a list of them, got {ids!r}")
    return list(values)
