"""A small random Qwen3 (or Qwen3.5) checkpoint built with this package's own code (no transformers,
no download).

``build_random_checkpoint(path)`` writes a directory that ``QwenForCausalLM.from_pretrained`` and
``QwenTokenizer.from_pretrained`` load like a real one: ``config.json`` (``config_dict``), the
tokenizer files (``build_tokenizer`` or ``build_word_tokenizer``, then ``write_tokenizer_files``)
and ``model.safetensors`` under Hugging Face names (``modeling.model.loader.load_plan``, values
from ``random_tensor``). ``ensure_random_checkpoint`` builds it once, by default in
``default_random_model_dir()``, where ``python -m modeling.generate`` keeps it when run without
``--model``. ``random_model(config, ...)`` builds a random ``QwenForCausalLM`` in memory (no
files; used by the GPU tests and the benchmark for full-size shapes): ``QWEN3_0_6B`` and
``QWEN3_5_0_8B`` are the config.json fields of those shapes.
"""

import itertools
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Union

import torch
from safetensors.torch import save_file

from . import fp8
from .causal_lm import QwenForCausalLM
from .config import QwenConfig
from .files import read_json
from .loader import fp8_targets, load_plan

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The meaning of life is a question that people have asked for thousands of years.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "You are a helpful assistant. What is the capital of France? The capital of France is Paris.",
    "Machine learning models turn numbers into text, one token at a time.",
    "def generate(prompt, max_new_tokens):\n    return model(prompt)\n",
    "Hello world! Bonjour le monde. Hallo Welt. こんにちは世界。 你好，世界！ Привет, мир! 🙂",
    "1 2 3 4 5 6 7 8 9 10, and the numbers go on: 100, 1000, 3.14159.",
]
# The default shape: tiny, but every feature of the decoder (GQA, q/k norm, tied embedding).
DEFAULT_SIZES = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
)
QWEN3_0_6B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=40960)
"""config.json fields of the Qwen3-0.6B shape, for random models in GPU tests and benchmarks."""
QWEN3_5_SIZES = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=4096,
)
"""The default Qwen3.5 shape of ``build_random_checkpoint(model_type="qwen3_5_text")``: tiny, but
every feature (three Gated DeltaNet layers with 2 key / 4 value heads, then gated attention with
GQA, partial RoPE, zero-centred norms, tied embedding)."""
QWEN3_5_0_8B = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=1024, intermediate_size=3584,
                    num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                    tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=262144,
                    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25))
"""config.json fields of the Qwen3.5-0.8B text model, for random models in GPU tests and benchmarks."""
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def default_random_model_dir() -> Path:
    """``$XDG_CACHE_HOME`` (or ~/.cache) / qwen-triton-ops / random-qwen3-tiny."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "qwen-triton-ops" / "random-qwen3-tiny"


def build_tokenizer(vocab_size: int = 512, corpus: Sequence[str] = CORPUS):
    """A byte-level BPE (``tokenizers.Tokenizer``) trained on ``corpus`` (default ``CORPUS``), with
    all 256 byte symbols (any UTF-8 text encodes) and ``SPECIAL_TOKENS`` as ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok


UNK_TOKEN = "<unk>"
"""Id 0 of ``build_word_tokenizer``: what any text outside its vocabulary encodes to."""
SYLLABLES = [c + v for c in "bcdfghjklmnprstvz" for v in "aeiou"]
"""The 85 syllables of the word-level tokenizer's pseudo-words."""


def build_word_tokenizer(vocab_size: int):
    """A word-level ``tokenizers.Tokenizer`` of exactly ``vocab_size`` entries: ``UNK_TOKEN`` (id 0)
    then distinct lowercase pseudo-words of equally many ``SYLLABLES`` ("bababa", "bababe", ...),
    split on whitespace. Without a decoder, decode joins the words with single spaces, so
    ``encode(decode(ids)).ids == ids`` for any ids; no special tokens (no EOS to sample). Builds
    Qwen3's 151,936 entries in well under a second."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    if vocab_size < 2:
        raise ValueError(f"a word-level vocabulary needs at least 2 entries (<unk> and a word), got {vocab_size}")
    length = 1
    while len(SYLLABLES) ** length < vocab_size - 1:
        length += 1
    words = ("".join(w) for w in itertools.product(SYLLABLES, repeat=length))
    vocab = {UNK_TOKEN: 0, **{w: i for i, w in enumerate(itertools.islice(words, vocab_size - 1), 1)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def write_tokenizer_files(path: Union[str, Path], tok, max_length: int, tokenizer_config: Mapping[str, Any] = {},
                          generation: Mapping[str, Any] = {}) -> None:
    """tokenizer.json, tokenizer_config.json (EOS ``<|im_end|>``, pad ``<|endoftext|>``, plus
    ``tokenizer_config``) and generation_config.json (EOS ``<|im_end|>`` then ``<|endoftext|>``,
    plus ``generation``) for ``tok`` into ``path``."""
    path = Path(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "model_max_length": max_length,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tokenizer_config,
    }, indent=2))
    (path / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
        "pad_token_id": tok.token_to_id("<|endoftext|>"),
        **generation,
    }, indent=2))


def config_dict(vocab_size: int, **sizes: Any) -> Dict[str, Any]:
    """A Hugging Face style Qwen3 config.json dict (Qwen3.5 with ``model_type="qwen3_5_text"``):
    ``DEFAULT_SIZES`` (``QWEN3_5_SIZES``) and the defaults below (tied embedding, silu, ...), each
    overridden by the field of that name in ``sizes`` (``tie_word_embeddings=False`` gives a model
    with its own lm_head). Another ``model_type`` is a ``ValueError``."""
    model_type = sizes.get("model_type", "qwen3")
    if model_type not in ("qwen3", "qwen3_5_text"):
        raise ValueError(f"model_type must be 'qwen3' or 'qwen3_5_text', got {model_type!r}")
    d = {"architectures": ["Qwen3_5ForCausalLM" if model_type == "qwen3_5_text" else "Qwen3ForCausalLM"],
         "model_type": model_type, "vocab_size": vocab_size, "hidden_act": "silu", "rms_norm_eps": 1e-6,
         "tie_word_embeddings": True, "attention_bias": False, "bos_token_id": 0, "eos_token_id": 2,
         "torch_dtype": "float32"}
    if model_type == "qwen3":
        return d | {"rope_theta": 1000000.0, "use_sliding_window": False} | DEFAULT_SIZES | sizes
    d |= {"rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
          "attn_output_gate": True} | QWEN3_5_SIZES | sizes
    interval = d.pop("full_attention_interval")
    d["layer_types"] = d.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                                for i in range(d["num_hidden_layers"])]
    return d


def random_tensor(config: QwenConfig, name: str, shape, std: float, generator: torch.Generator, dtype=torch.float32,
                  device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """N(0, std^2); a norm weight (1-d, name containing 'norm') is centred on 1, or on 0 for a
    zero-centred norm (Qwen3.5's ``1 + weight`` norms; its Gated DeltaNet output norm has a plain
    weight): 1 - config.norm_offset + N(0, std^2)."""
    t = torch.randn(shape, generator=generator, dtype=torch.float32, device=device) * std
    if "norm" in name and len(shape) == 1:
        t += 1.0 if "linear_attn.norm" in name or name.endswith("norm_weight") else 1.0 - config.norm_offset
    return t.to(dtype)


MARKER = ".random-checkpoint"
"""Written last into every checkpoint this module builds: the file sizes of a complete build."""


def is_complete(path: Union[str, Path]) -> bool:
    """True when ``path`` holds a checkpoint this module built, every file whole (sizes match the marker)."""
    path = Path(path)
    try:
        sizes = read_json(path / MARKER)  # a regular file: a FIFO here cannot block the check
        return all((path / f).is_file() and (path / f).stat().st_size == sizes[f] for f in FILES)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _is_ours(path: Path) -> bool:
    """A directory this module built: it carries the marker and nothing but the files it writes."""
    names = {p.name for p in path.iterdir()}
    return MARKER in names and names <= set(FILES) | {MARKER, "README.md"}


TOKENIZERS = ("bpe", "words")


def build_random_checkpoint(path: Union[str, Path], seed: int = 0, std: Optional[float] = None,
                            vocab_size: int = 512, tokenizer: str = "bpe", dtype: torch.dtype = torch.float32,
                            **sizes: Any) -> Path:
    """Write a random Qwen3 checkpoint to ``path`` (created; replaced atomically if it exists).

    ``std`` defaults to min(0.2, 2 / sqrt(hidden)), large enough for logits that are not flat.
    ``tokenizer``: ``"bpe"`` (``build_tokenizer(vocab_size)``: at most ``vocab_size`` entries, as many
    as its small corpus gives, EOS ``<|im_end|>``) or ``"words"`` (``build_word_tokenizer(vocab_size)``:
    exactly ``vocab_size``, and no EOS in any file: config.json's ``eos_token_id`` and
    ``bos_token_id`` are null). ``dtype``: of the weights (``torch_dtype`` in config.json).
    ``sizes`` override ``DEFAULT_SIZES`` (hidden_size, num_hidden_layers, ...). With
    ``model_type="qwen3_5_text"`` the checkpoint is a Qwen3.5 text model (``QWEN3_5_SIZES``
    overridden by the other sizes, e.g. ``linear_num_value_heads`` or ``full_attention_interval``).

    Only a directory this module built (or an empty one) is replaced: anything else at ``path``
    raises ``FileExistsError`` and is left untouched. Concurrent builds of one path are
    serialised by a lock file beside it; each finished build is complete (written to a temporary
    directory, then renamed into place).
    """
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {tokenizer!r}")
    path = Path(path)
    with _lock(path):
        _build(path, seed, std, vocab_size, tokenizer, dtype, **sizes)
    return path


def _build(path: Path, seed: int = 0, std: Optional[float] = None, vocab_size: int = 512, tokenizer: str = "bpe",
           dtype: torch.dtype = torch.float32, **sizes: Any) -> None:
    """build_random_checkpoint's body (its defaults: ``ensure_random_checkpoint``'s checkpoint); the
    caller holds the lock."""
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not _is_ours(path))):
        raise FileExistsError(f"{str(path)!r} exists and is not a random checkpoint built here; "
                              "refusing to replace it")
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    os.chmod(tmp, 0o755)
    try:
        fields: Dict[str, Any] = {"torch_dtype": str(dtype).removeprefix("torch.")}
        if tokenizer == "words":
            tok = build_word_tokenizer(vocab_size)
            write_tokenizer_files(tmp, tok, 4096, {"eos_token": None, "pad_token": None, "unk_token": UNK_TOKEN,
                                                   "clean_up_tokenization_spaces": False},
                                  {"eos_token_id": None, "pad_token_id": None})
            fields.update(bos_token_id=None, eos_token_id=None)
        else:
            tok = build_tokenizer(vocab_size)
            write_tokenizer_files(tmp, tok, 4096)
        cfg = config_dict(tok.get_vocab_size(with_added_tokens=True), **{**fields, **sizes})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        config = QwenConfig.from_dict(cfg)
        std = min(0.2, 2.0 / config.hidden_size**0.5) if std is None else std
        g = torch.Generator().manual_seed(seed)
        tensors = {name: random_tensor(config, name, shape, std, g, dtype)
                   for sources in load_plan(config).values() for name, shape in sources}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        family = "Qwen3.5" if config.linear_conv_kernel_dim else "Qwen3"
        (tmp / "README.md").write_text(
            f"Random {family} weights written by modeling.model.random_checkpoint (seed "
            f"{seed}, std {std:.4g}, {tokenizer} tokenizer): a test fixture, its text is gibberish.\n")
        (tmp / MARKER).write_text(json.dumps({f: (tmp / f).stat().st_size for f in FILES}))
        if path.exists():  # ours or empty: move it aside into a directory we own, then swap
            old = Path(tempfile.mkdtemp(prefix=path.name + ".old.", dir=path.parent))
            os.replace(path, old / "checkpoint")
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def _lock(path: Path):
    """An exclusive lock on ``<path>.lock`` (POSIX advisory lock; a no-op where fcntl is missing),
    ``path``'s parent created first if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    with open(path.parent / (path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_random_checkpoint(path: Optional[Union[str, Path]] = None) -> Path:
    """The random checkpoint at ``path`` (default ``default_random_model_dir()``), built if missing
    or incomplete (checked again under the lock, so concurrent callers build it once)."""
    path = Path(path) if path is not None else default_random_model_dir()
    if not is_complete(path):
        with _lock(path):
            if not is_complete(path):
                _build(path)
    return path


@torch.no_grad()
def random_model(config: QwenConfig, dtype: torch.dtype = torch.bfloat16, device: Union[str, torch.device] = "cpu",
                 std: float = 0.02, seed: int = 0, quantization: Optional[str] = None) -> QwenForCausalLM:
    """A ``QwenForCausalLM`` with random weights, built in memory on ``device``, each parameter made
    in ``dtype`` directly (a 61 GB bf16 model never holds an fp32 copy). ``quantization="fp8"``:
    the weights ``from_pretrained(..., quantization="fp8")`` quantises, quantised as each is made
    (a 30B mixture of experts never holds its bf16 weights)."""
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in QwenForCausalLM(config).named_parameters()}
    quantized = fp8_targets(config) if quantization else set()
    g = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, shape in shapes.items():
        t = random_tensor(config, name, shape, std, g, dtype, device)
        if name in quantized:
            state[name], state[name + "_scale_inv"] = fp8.quantize(t)
        else:
            state[name] = t
    return QwenForCausalLM.from_state(config, state)
