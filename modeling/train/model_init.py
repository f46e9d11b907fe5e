"""The model: its config from the flags, built and initialised as transformers initialises
Qwen3 (or from ``--init DIR``), its weights under Hugging Face names, dropout as forward hooks."""

import argparse
from typing import Any, Dict

from .constants import INIT_SETTINGS, UsageError


def model_config_dict(a: argparse.Namespace, vocab_size: int) -> Dict[str, Any]:
    """config.json: ``random_checkpoint.config_dict`` with this run's sizes."""
    from ..model.random_checkpoint import config_dict

    cfg = config_dict(vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      head_dim=a.head_dim, max_position_embeddings=a.seq_len)
    cfg.update(rope_theta=float(a.rope_theta), initializer_range=a.init_std,
               torch_dtype="bfloat16" if a.save_dtype == "bf16" else "float32")
    return cfg


def build_model(config, seed: int, std: float):
    """``QwenForCausalLM(config)`` in fp32 on the CPU, initialised like transformers' Qwen3:
    every matrix (embedding included) ~ N(0, std^2) from a generator seeded with ``seed``, every
    norm weight 1."""
    import torch

    from ..model.causal_lm import QwenForCausalLM

    with torch.device("cpu"):
        model = QwenForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                if "norm" not in name.rsplit(".", 1)[-1]:
                    raise ValueError(f"unexpected 1-d parameter {name!r}: only norm weights are expected in a qwen3")
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=g)
    return model


def take_init_settings(a: argparse.Namespace) -> None:
    """--init DIR: the model's settings (``INIT_SETTINGS``) from DIR/config.json, which must describe a
    model this trainer builds (a tied-embedding qwen3); UsageError otherwise, or when one of them is
    given on the command line too."""
    from ..model.config import QwenConfig

    given = [f"--{k.replace('_', '-')}" for k in INIT_SETTINGS if k in a.given]
    if given:
        raise UsageError(f"--init {a.init}: the model's settings come from its config.json; drop {', '.join(given)}")
    try:
        cfg = QwenConfig.from_pretrained(a.init)
    except (OSError, ValueError) as e:
        raise UsageError(f"--init {a.init}: {e}") from None
    for k, key in INIT_SETTINGS.items():
        setattr(a, k, getattr(cfg, key))
    if QwenConfig.from_dict(model_config_dict(a, cfg.vocab_size)) != cfg:
        raise UsageError(f"--init {a.init}: not a model this trainer builds (a {cfg.model_type} with "
                         f"tie_word_embeddings={cfg.tie_word_embeddings}; it builds tied-embedding qwen3 models)")


def load_init_weights(model, path: str) -> None:
    """``model``'s parameters set to those of the checkpoint ``path`` (fp32)."""
    import torch

    from ..model.loader import load_state_dict

    try:
        model.load_state_dict(load_state_dict(path, model.config, dtype=torch.float32), strict=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise UsageError(f"--init {path}: {' '.join(str(e).split())}") from None


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def hf_tensors(named: Dict[str, Any], config, dtype) -> Dict[str, Any]:
    """Our fused tensors (``name -> tensor`` as in the model's state_dict) split back into the
    Hugging Face tensors of ``loader.load_plan``, in ``dtype`` on the CPU, contiguous."""
    from ..model.loader import load_plan

    out = {}
    for target, sources in load_plan(config).items():
        t, row = named[target], 0
        for name, shape in sources:
            out[name] = t[row:row + shape[0]].detach().to(device="cpu", dtype=dtype).contiguous()
            row += shape[0]
        if row != t.shape[0]:
            raise ValueError(f"{target}: {t.shape[0]} rows, the load plan accounts for {row}")
    return out


def attach_dropout(model, p: float) -> list:
    """``F.dropout(p)`` (training mode only) on the embedding (the first layer's input) and on each
    layer's output, the MLP's, which the next layer (or the final norm) adds to the residual
    stream. Returns the hook handles."""
    import torch.nn.functional as F

    def drop_embedding(module, args):
        if not module.training:
            return None
        if not args:
            raise RuntimeError("--dropout: the decoder layer is no longer called with positional arguments")
        return (F.dropout(args[0], p, True),) + tuple(args[1:])

    def drop_mlp_output(module, args, out):
        if not module.training:
            return None
        if not (isinstance(out, tuple) and len(out) == 2 and out[0].shape == out[1].shape):
            raise RuntimeError("--dropout: a decoder layer no longer returns (mlp output, residual)")
        return F.dropout(out[0], p, True), out[1]

    handles = [model.layers[0].register_forward_pre_hook(drop_embedding)]
    handles += [layer.register_forward_hook(drop_mlp_output) for layer in model.layers]
    return handles
