"""Deliberate breakages: does the CPU test suite notice each one?

    python -m tests.mutations [--only NAME ...] [--list]

Each mutation replaces one exact snippet of a source file in a scratch copy of the
repository and runs the test files that should catch it (under the Triton interpreter,
as CI does). A mutation "survives" when those tests still pass: a hole in the tests. One that
only "crashed" them (the interpreter died on an out-of-bounds access before any test reported a
failure) is not caught either: the tests should fail by assertion.
Each set of test files first runs on the unmutated copy: if it fails there, its mutations
show "baseline fails" instead of a meaningless "caught".
Not run in CI (it takes several minutes); docs/reliability.md keeps its last table.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

ROOT = Path(__file__).resolve().parents[1]


class Mutation(NamedTuple):
    name: str
    path: str
    old: str
    new: str
    tests: tuple
    gpu_only: bool = False  # only a `cuda` test can see it: reported, not run, without a GPU


MUTATIONS = [
    Mutation("every op takes its reference", "qwen_ops/registry.py",
             "if runs_kernels(\"cpu\", args[dispatch_arg].dtype):", "if False:", ("tests/test_ops_norm.py",)),
    Mutation("the direct Autograd path ignores the key set (fake tensors skip their mode)", "qwen_ops/registry.py",
             "impl = direct.get(keyset.raw_repr())", 'impl = direct.get(PLAIN_KEYSETS["CPU"].raw_repr())',
             ("tests/test_ops_contract.py",)),
    Mutation("cached launches ignore pointer alignment", "csrc_free_ops/launch.py",
             "return a.dtype, a.data_ptr() & 15 == 0", "return a.dtype, True", ("tests/test_launch.py",)),
    Mutation("the generated launch key ignores pointer alignment", "csrc_free_ops/launch.py",
             "{a}.data_ptr() & 15 == 0) if", "True) if", ("tests/test_launch.py",)),
    Mutation("the generated launch key treats i64 ints as i32", "csrc_free_ops/launch.py",
             "-0x80000000 <= {a} <= 0x7FFFFFFF", "-0x8000000000000000 <= {a} <= 0x7FFFFFFFFFFFFFFF",
             ("tests/test_launch.py",)),
    Mutation("launch plans ignore the inputs' alignment", "qwen_ops/plans.py",
             "a{i}.dtype, a{i}.data_ptr() & 15, a{i}.get_device()", "a{i}.dtype, a{i}.get_device()",
             ("tests/test_plans.py",)),
    Mutation("launch plans replay calls whose launcher ran other aten ops (copies)", "qwen_ops/plans.py",
             "    if log.other_ops:\n", "    if False:\n", ("tests/test_plans.py",)),
    Mutation("cached launches ignore the int == 1 specialization", "csrc_free_ops/launch.py",
             "return a == 1, a & 15 == 0,", "return False, a & 15 == 0,", ("tests/test_launch.py",)),
    Mutation("paged_attention without the NaN guard of fully masked rows", "csrc_free_ops/paged_attention.py",
             'm_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)', "m_new_safe = m_new",
             ("tests/test_ops_paged_attention.py",)),
    Mutation("paged_attention without its length clamp", "csrc_free_ops/paged_attention.py",
             "seq_len = _load_clamped(lens_ptr + seq * stride_lens, 0, MAX_CONTEXT)",
             "seq_len = tl.load(lens_ptr + seq * stride_lens).to(tl.int32)", ("tests/test_ops_paged_attention.py",)),
    Mutation("add_rms_norm normalises the unrounded sum", "csrc_free_ops/norm.py",
             "        x = x_rounded.to(tl.float32)\n", "", ("tests/test_ops_norm.py",)),
    Mutation("add_rms_norm stores the unrounded sum in fp32 then truncates", "csrc_free_ops/norm.py",
             "x_rounded = x.to(sum_ptr.dtype.element_ty)", "x_rounded = x.to(sum_ptr.dtype.element_ty, fp_downcast_rounding='rtz')",
             ("tests/test_ops_norm.py",)),
    Mutation("rms_norm without eps", "csrc_free_ops/norm.py",
             "rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)", "rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N)",
             ("tests/test_ops_norm.py",)),
    Mutation("rope's fused q/k norm without eps", "csrc_free_ops/rope.py",
             "rstd = tl.rsqrt(sq / D + eps)[:, None]\n        w1 = ", "rstd = tl.rsqrt(sq / D)[:, None]\n        w1 = ",
             ("tests/test_ops_rope.py",)),
    Mutation("rope's angle reduction drops the middle part of 2pi", "csrc_free_ops/rope.py",
             "r = tl.fma(k, -1.9353071693331003e-3, r)", "r = r", ("tests/test_ops_rope.py",)),
    Mutation("kv_cache_store_slots bound check loosened", "csrc_free_ops/paged_attention.py",
             "(slot >= 0) & (slot < NUM_SLOTS)", "(slot >= 0) & (slot <= NUM_SLOTS)",
             ("tests/test_ops_paged_attention.py",)),
    Mutation("norm_qkv_rope_store's slot bound check loosened", "csrc_free_ops/fused_decode.py",
             "(slot >= 0) & (slot < SLOTS)", "(slot >= 0) & (slot <= SLOTS)", ("tests/test_ops_fused_decode.py",)),
    Mutation("linear drops the bias", "csrc_free_ops/common.py",
             "    if HAS_BIAS:\n        acc += tl.load(bias_ptr", "    if False:\n        acc += tl.load(bias_ptr",
             ("tests/test_ops_linear.py",)),
    Mutation("TMA GEMM drops the bias", "csrc_free_ops/linear.py",
             "            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)\n            acc += tl.load(b_ptr",
             "            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)\n            acc -= tl.load(b_ptr",
             ("tests/test_ops_linear.py",)),
    Mutation("TMA GEMM K slices run to the end of K", "csrc_free_ops/linear.py",
             "for k0 in range(k_lo, min(k_lo + K_PER_SPLIT, K), BLOCK_K):", "for k0 in range(k_lo, K, BLOCK_K):",
             ("tests/test_ops_linear.py",)),
    Mutation("TMA GEMM persistent loop forgets the split work items", "csrc_free_ops/linear.py",
             "tl.range(tl.program_id(0), tiles * SPLIT_K, PROGRAMS", "tl.range(tl.program_id(0), tiles, PROGRAMS",
             ("tests/test_ops_linear.py",)),
    Mutation("TMA path takes misaligned rows", "csrc_free_ops/linear.py",
             "        if start % 16:\n", "        if False:\n", ("tests/test_ops_linear.py",)),
    Mutation("cached launches ignore a descriptor's block shape", "csrc_free_ops/launch.py",
             "tuple(a.block_shape), a.padding", "a.padding", ("tests/test_launch.py",)),
    Mutation("split-K reduce skips the last slice", "csrc_free_ops/common.py",
             "for s in range(SPLIT_K):", "for s in range(SPLIT_K - 1):", ("tests/test_ops_linear.py",)),
    Mutation("the SwiGLU GEMM epilogue drops the gate's sigmoid", "csrc_free_ops/linear.py",
             "acc = acc * tl.sigmoid(acc) * up", "acc = acc * up", ("tests/test_ops_linear.py",)),
    Mutation("the SwiGLU GEMM reads the gate rows as the up rows", "csrc_free_ops/linear.py",
             "w_desc.load([N + pid_n * BLOCK_N, k0])", "w_desc.load([pid_n * BLOCK_N, k0])",
             ("tests/test_ops_linear.py",)),
    Mutation("silu_mul uses sigmoid instead of silu", "csrc_free_ops/activation.py",
             "(g * tl.sigmoid(g) * u)", "(tl.sigmoid(g) * u)", ("tests/test_ops_activation.py",)),
    Mutation("attention's causal mask off by one", "csrc_free_ops/attention_forward_kernel.py",
             "(cols[None, :] <= offs_m[:, None] + delta)", "(cols[None, :] < offs_m[:, None] + delta)",
             ("tests/test_ops_attention.py",)),
    Mutation("random checkpoint replaces any directory", "modeling/model/random_checkpoint.py",
             "return MARKER in names and names <= set(FILES) | {MARKER, \"README.md\"}", "return True",
             ("tests/test_random_checkpoint.py",)),
    Mutation("shard names may leave the checkpoint", "modeling/model/loader.py",
             "if not isinstance(name, str) or Path(name).name != name or name in (\"\", \".\", \"..\"):",
             "if not isinstance(name, str):", ("tests/test_loading_errors.py",)),
    Mutation("cross-entropy counts ignored targets", "csrc_free_ops/cross_entropy.py",
             "return (t != ignore_index) & (t >= 0) & (t < V)", "return (t >= 0) & (t < V)",
             ("tests/test_training_ops.py",)),
    Mutation("GEMM ignores its output row offset", "csrc_free_ops/common.py",
             "c_rows = c_row0 + rm.to(tl.int64)", "c_rows = rm.to(tl.int64)", ("tests/test_training_ops.py",)),
    Mutation("cross-entropy chunk rows stored at row 0", "csrc_free_ops/cross_entropy.py",
             "tl.store(lse_ptr + R0 + rows, lse, mask=row_ok)", "tl.store(lse_ptr + rows, lse, mask=row_ok)",
             ("tests/test_training_ops.py",)),
    Mutation("patched decoder lets transformers build a causal mask", "modeling/model/transformers_patch.py",
             'kwargs["attention_mask"] = {"full_attention": None}', "pass", ("tests/test_training_patch.py",)),
    # Zero-size inputs and large values (tests/test_edge_cases.py).
    Mutation("rows flattened with reshape(-1, N) (fails for N = 0)", "csrc_free_ops/common.py",
             "return t.flatten(0, lead - 1) if lead > 1 else t.unsqueeze(0)",
             "return t.reshape(-1, *t.shape[lead:])", ("tests/test_edge_cases.py",)),
    Mutation("rope accepts theta <= 0, inf or NaN", "qwen_ops/rope.py",
             "if not 0.0 < theta < math.inf:", "if False:", ("tests/test_edge_cases.py",)),
    Mutation("kv_cache_store_slots block of D (head_dim not a power of two)", "csrc_free_ops/paged_attention.py",
             "BLOCK_D=next_power_of_2(d)", "BLOCK_D=d", ("tests/test_ops_head_dims.py",)),
    Mutation("attention backward returns unwritten dk, dv without queries", "csrc_free_ops/attention.py",
             "    if bsz == 0 or sk == 0:\n        return dq, dk, dv\n    if sq * hq == 0:",
             "    if bsz * hq == 0 or sk == 0:\n        return dq, dk, dv\n    if sq == 0:", ("tests/test_edge_cases.py",)),
    Mutation("attention's online softmax without headroom (p @ v overflows)", "csrc_free_ops/attention_forward_kernel.py",
             "p = tl.exp2((s - m_new[:, None]) * qk_scale) * P_SCALE", "p = tl.exp2((s - m_new[:, None]) * qk_scale)",
             ("tests/test_edge_cases.py",)),
    Mutation("attention accepts a scale <= 0 (its running max is taken on unscaled scores)", "qwen_ops/attention.py",
             "if not 0.0 < scale < math.inf:", "if False:", ("tests/test_edge_cases.py",)),
    Mutation("paged_attention's splits without headroom", "csrc_free_ops/paged_attention.py",
             "p = tl.exp2((s - m_new_safe[:, None]) * qk_scale) * P_SCALE",
             "p = tl.exp2((s - m_new_safe[:, None]) * qk_scale)", ("tests/test_edge_cases.py",)),
    Mutation("paged_attention combines unnormalised split weights", "csrc_free_ops/paged_attention.py",
             "    w = w / tl.maximum(tl.sum(w, axis=0), 1e-30)  # normalised before the sum: |out| <= max |part|, "
             "no overflow\n    out = tl.sum(parts * w[:, None], axis=0)",
             "    out = tl.sum(parts * w[:, None], axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)",
             ("tests/test_edge_cases.py",)),
    Mutation("fused GEMV forgets the norm's rsqrt", "csrc_free_ops/fused_decode.py",
             "            acc *= rstd\n", "", ("tests/test_ops_fused_decode.py",)),
    Mutation("linear_residual drops the residual", "csrc_free_ops/fused_decode.py",
             "y += tl.load(res_ptr", "y += 0.0 * tl.load(res_ptr", ("tests/test_ops_fused_decode.py",)),
    Mutation("fused split sum skips the last slice", "csrc_free_ops/fused_decode_blocks.py",
             "for s in tl.static_range(1, SPLIT_K):", "for s in tl.static_range(1, SPLIT_K - 1):", ("tests/test_ops_fused_decode.py",)),
    Mutation("fused GEMV leaves its arrival counter set", "csrc_free_ops/fused_decode.py",
             "tl.atomic_xchg(sem_ptr + tile, 0)  # ready for the next launch", "pass", ("tests/test_ops_fused_decode.py",)),
    Mutation("norm_gate_up_silu loses the up half", "csrc_free_ops/fused_decode.py",
             "y = y * tl.sigmoid(y) * up", "y = y * tl.sigmoid(y)", ("tests/test_ops_fused_decode.py",)),
    Mutation("norm_qkv_rope_store rotates the wrong way", "csrc_free_ops/fused_decode_blocks.py",
             "sign = tl.where(d < HALF, -1.0, 1.0)", "sign = tl.where(d < HALF, 1.0, -1.0)", ("tests/test_ops_fused_decode.py",)),
    Mutation("norm_qkv_rope_store sums slice squares from one slice", "csrc_free_ops/fused_decode.py",
             "            ss = _sum_row_slices(ss_ptr, rm, M, SPLIT_K)\n        rstd", "        rstd", ("tests/test_ops_fused_decode.py",)),
    # Loading hostile or careless checkpoints (tests/test_loading_errors.py, test_modeling_config.py, test_hub.py).
    Mutation("a tensor in two shards is accepted", "modeling/model/loader.py", "if name in shard_of:", "if False:",
             ("tests/test_loading_errors.py",)),
    Mutation("Hub ids ending in '.' accepted", "modeling/model/hub.py", ' and not name.endswith(".")', "", ("tests/test_hub.py",)),
    Mutation("checkpoint files opened without the regular-file check", "modeling/model/files.py", "if stat.S_ISREG(mode):",
             "if True:", ("tests/test_loading_errors.py",)),
    Mutation("config flags not type-checked", "modeling/model/config.py", "    if not isinstance(v, bool):", "    if False:",
             ("tests/test_modeling_config.py",)),
    Mutation("config sizes unbounded", "modeling/model/config.py", "    if v > limit:", "    if False:",
             ("tests/test_modeling_config.py",)),
    Mutation("config floats may be infinite", "modeling/model/config.py", "math.isfinite(v)", "True",
             ("tests/test_modeling_config.py",)),
    Mutation("weights files not checked against config.json's sizes", "modeling/model/loader.py",
             "if least > have:", "if False:", ("tests/test_loading_errors.py",)),
    Mutation("random checkpoint config ties the embedding whatever it is given", "modeling/model/random_checkpoint.py",
             "| DEFAULT_SIZES | sizes\n", "| DEFAULT_SIZES | sizes | {\"tie_word_embeddings\": True}\n",
             ("tests/test_random_checkpoint.py",)),
    # Kernel and op holes (tests/test_ops_*.py, test_plans.py, test_training_ops.py).
    Mutation("fused GEMV arrival counters shared by row blocks", "csrc_free_ops/fused_decode.py",
             "tile = pid_m * tl.num_programs(0) + pid_n", "tile = pid_n", ("tests/test_ops_fused_decode.py",)),
    Mutation("recurrent gated delta rule drops the value-block offset", "csrc_free_ops/gated_delta_rule_step.py",
             "cv = i_v * BV + tl.arange(0, BV)\n    s_ptrs", "cv = tl.arange(0, BV)\n    s_ptrs",
             ("tests/test_ops_gated_delta_rule.py",)),
    Mutation("gated delta rule state kernel drops the value-block offset", "csrc_free_ops/gated_delta_rule.py",
             "cv = i_v * BV + tl.arange(0, BV)\n    cv_ok = head_mask(cv, DV)\n    s_ok",
             "cv = tl.arange(0, BV)\n    cv_ok = head_mask(cv, DV)\n    s_ok",
             ("tests/test_ops_gated_delta_rule.py",)),
    Mutation("gated delta rule output kernel leaves the in-chunk scores unnormalised",
             "csrc_free_ops/gated_delta_rule.py",
             "a = tl.where(causal, a * r[:, None] * tl.exp(", "a = tl.where(causal, a * tl.exp(",
             ("tests/test_ops_gated_delta_rule.py",)),
    Mutation("the WY kernel runs 4 warps with value heads of 32 columns or fewer", "csrc_free_ops/gated_delta_rule.py",
             "num_warps=4 if block_k + block_v <= 256 and block_v > 32 else 8",
             "num_warps=4 if block_k + block_v <= 256 else 8", ("tests/test_ops_gated_delta_rule.py",), gpu_only=True),
    Mutation("the output kernel runs 4 warps on 32-column value blocks with Dk >= 64", "csrc_free_ops/gated_delta_rule.py",
             "num_warps=4 if block_k <= 128 and (bv_o > 32 or block_k <= 32) else 8",
             "num_warps=4 if block_k <= 128 else 8", ("tests/test_ops_gated_delta_rule.py",), gpu_only=True),
    Mutation("gated delta rule output kernel drops the value-block offset", "csrc_free_ops/gated_delta_rule.py",
             "cv = i_v * BV + tl.arange(0, BV)\n\n    q = tl.load", "cv = tl.arange(0, BV)\n\n    q = tl.load",
             ("tests/test_ops_gated_delta_rule.py",)),
    Mutation("gated_rms_norm leaves the weight product unrounded", "csrc_free_ops/gated_delta_rule_step.py",
             "ROUND_WEIGHT_PRODUCT=weight.dtype == x.dtype,", "ROUND_WEIGHT_PRODUCT=False,",
             ("tests/test_ops_gated_delta_rule.py",)),
    Mutation("paged_attention reads the table to its end, not the sequence length", "csrc_free_ops/paged_attention.py",
             "hi = min(lo + split_len, kv_end)", "hi = min(lo + split_len, MAX_CONTEXT)",
             ("tests/test_ops_paged_attention.py",)),
    Mutation("paged_attention's splits share the keys rounded down", "csrc_free_ops/paged_attention.py",
             "split_len = tl.cdiv(tl.cdiv(tl.maximum(kv_end, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N",
             "split_len = tl.maximum(kv_end, 0) // NUM_SPLITS // BLOCK_N * BLOCK_N", ("tests/test_ops_paged_attention.py",)),
    Mutation("launch plans ignore the inputs' shapes", "qwen_ops/plans.py", 'tensor = f"(a{i}.shape, a{i}.stride(), ',
             'tensor = f"(a{i}.stride(), ', ("tests/test_plans.py",)),
    Mutation("launch plans ignore the inputs' strides", "qwen_ops/plans.py", 'f"(a{i}.shape, a{i}.stride(), a{i}.dtype',
             'f"(a{i}.shape, a{i}.dtype', ("tests/test_plans.py",)),
    Mutation("launch plans ignore the inputs' devices", "qwen_ops/plans.py", 'a{i}.data_ptr() & 15, a{i}.get_device())"',
             'a{i}.data_ptr() & 15)"', ("tests/test_plans.py",)),
    Mutation("launch plans ignore the current device", "qwen_ops/plans.py", 'items = ["_device()", "_common._PDL_OFF"]',
             'items = ["_common._PDL_OFF"]', ("tests/test_plans.py",)),
    Mutation("launch plans replay calls with aliased inputs", "qwen_ops/plans.py",
             "inputs[a.data_ptr()] = None if a.data_ptr() in inputs else i", "inputs[a.data_ptr()] = i",
             ("tests/test_plans.py",)),
    Mutation("launch plans accept two allocations at one address", "qwen_ops/plans.py",
             "if len(allocated) < len(allocations) or 0 in allocated:", "if 0 in allocated:", ("tests/test_plans.py",)),
    Mutation("launch plan tables grow without bound", "qwen_ops/plans.py",
             "        if len(self) >= MAX_PLANS:\n            self.clear()\n", "", ("tests/test_plans.py",)),
    Mutation("linear_residual checks only the residual's last dim", "qwen_ops/fused_decode.py",
             "if tuple(residual.shape) != (*x.shape[:-1], weight.shape[0]):", "if residual.shape[-1] != weight.shape[0]:",
             ("tests/test_ops_fused_decode.py",)),
    Mutation("cross-entropy drops targets outside the vocabulary", "csrc_free_ops/cross_entropy.py",
             'tl.where(t == ignore_index, 0.0, float("nan"))', "0.0", ("tests/test_training_ops.py",)),
    Mutation("linear_cross_entropy skips its CPU target check", "qwen_ops/cross_entropy.py", "    if outside.numel():\n",
             "    if False:\n", ("tests/test_training_ops.py",)),
    Mutation("rope kernels take positions past 2^24", "csrc_free_ops/rope.py",
             'return tl.where((p >= -_MAX_POSITION) & (p <= _MAX_POSITION), p.to(tl.float32), float("nan"))',
             "return p.to(tl.float32)", ("tests/test_ops_rope.py",)),
    Mutation("rope skips its CPU position check", "qwen_ops/rope.py", "if lo < -MAX_POSITION or hi > MAX_POSITION:",
             "if False:", ("tests/test_ops_rope.py",)),
    Mutation("fused decode weight prefetch issued after the wait", "csrc_free_ops/fused_decode.py",
             "    if PREFETCH:  # the whole weight slice is in flight before the program waits for its input\n"
             "        w = _weight_slice(w_ptr, rn, N, k_lo, k_hi, stride_wn, BLOCK_K)\n        w_up = w",
             "    if PREFETCH:  # the whole weight slice is in flight before the program waits for its input\n"
             "        pdl_wait(USE_PDL)\n        w = _weight_slice(w_ptr, rn, N, k_lo, k_hi, stride_wn, BLOCK_K)\n"
             "        w_up = w", ("tests/test_decode_asm.py",)),
    # LLM and the first hour (tests/test_llm.py, test_engine_sampling.py, test_bench.py, test_generate_cli.py).
    Mutation("sampling without the minimum-temperature clamp", "modeling/engine/sampler.py",
             "temperature.clamp_min(MIN_TEMPERATURE)[:, None]", "temperature[:, None]",
             ("tests/test_engine_sampling.py",)),
    Mutation("stop strings found at one place: no longest-first tie-break", "modeling/api/outputs.py",
             '(end - len(s), -len(s)) < (start, -len(found or ""))', "end - len(s) < start", ("tests/test_llm.py",)),
    Mutation("float token ids are rounded", "modeling/engine/prompts.py", "            if not is_int(t):\n",
             "            if False:\n", ("tests/test_llm.py", "tests/test_engine.py")),
    Mutation("LLM.generate reads a dict prompt's keys as text", "modeling/api/llm.py",
             "        if isinstance(prompts, (str, Mapping)):\n            given = [prompts]",
             "        if isinstance(prompts, str):\n            given = [prompts]", ("tests/test_llm.py",)),
    Mutation("a seeded request's other completions sample with its seed", "modeling/engine/sampling_params.py",
             "seed=choice_seed(params.seed, i),", "seed=params.seed,",
             ("tests/test_llm.py",)),
    Mutation("a stop string leaves its sequence running in the engine", "modeling/api/llm.py",
             "                    if seq.status is not Status.FINISHED:  # a stop string: the engine does not know\n"
             "                        self._engine.abort(seq)\n", "", ("tests/test_llm.py",)),
    Mutation("the README's ops snippet hard-codes CUDA", "README.md",
             'device = "cuda" if torch.cuda.is_available() else "cpu"', 'device = "cuda"', ("tests/test_generate_cli.py",)),
    Mutation("--help names no Qwen3.5", "modeling/cli/args.py", "Qwen3, Qwen2/2.5 or Qwen3.5 checkpoint",
             "Qwen3/Qwen2 checkpoint", ("tests/test_generate_cli.py",)),
    # Chat templates (tests/test_chat.py).
    Mutation("chat templates see only JSON-like values", "modeling/chat/template.py", 'return f"<{type(value).__name__}>"',
             "return value", ("tests/test_chat.py",)),
    Mutation("a message's reasoning is not visible as thinking", "modeling/chat/template.py",
             'return {"thinking": reasoning, **message, "reasoning_content": reasoning}',
             'return {**message, "reasoning_content": reasoning}', ("tests/test_chat.py",)),
    Mutation("chat template loops are not counted", "modeling/chat/budget.py", "        budget.iterate()\n        if lazy:",
             "        if lazy:", ("tests/test_chat.py",)),
    Mutation("'*' is not checked before it runs", "modeling/chat/sandbox.py", "            _check_repeat(left, right)",
             "            pass", ("tests/test_chat.py",)),
    Mutation("captured blocks grow unchecked", "modeling/chat/sandbox.py", "        self._grow(len(piece))\n", "",
             ("tests/test_chat.py",)),
    Mutation("center's width is not checked", "modeling/chat/builtins.py", '        _check_chars(width, "center")',
             "        pass", ("tests/test_chat.py",)),
    # The engine (tests/test_engine.py, test_engine_scheduling.py).
    Mutation("a graph capture's warm-up reads a previous step's logits rows", "modeling/engine/step.py",
             "        f.logits_rows[len(sampling):] = 0\n", "", ("tests/test_engine.py",)),
    Mutation("step graphs captured after the step's batch is staged (the capture stages its own)",
             "modeling/engine/runner.py",
             "        self._capture_new(key, eager)\n        packed, host = self._stage(work, key)\n",
             "        packed, host = self._stage(work, key)\n        self._capture_new(key, eager)\n",
             ("tests/test_engine.py",)),
    Mutation("a mixed step's padding tokens keep the KV slots of an earlier step", "modeling/engine/step.py",
             "    f.slot_mapping[N:] = -1\n", "", ("tests/test_engine.py",)),
    Mutation("a pinned staging buffer is repacked before its last transfer has run", "modeling/engine/runner.py",
             "            self.staged[i].synchronize()\n", "            pass\n", ("tests/test_engine.py",),
             gpu_only=True),
    Mutation("the persistent decode kernel's padding rows write their key and value",
             "csrc_free_ops/decode_layers_tasks.py",
             "(pos >= 0) & (pos < seqlen):", "(pos >= 0) & (pos < CACHE_LEN):",
             ("tests/test_decode_layers.py", "tests/test_engine.py")),
    Mutation("the hybrid persistent kernel's padding rows write their conv and recurrent states",
             "csrc_free_ops/decode_hybrid_layers_tasks.py",
             "keeps = ok & (lens > 0) & (slot >= 0) & (slot < P)", "keeps = ok & (slot >= 0) & (slot < P)",
             ("tests/test_decode_hybrid_layers.py",)),
    Mutation("the hybrid persistent kernel's first tokens continue their slot's stale state",
             "csrc_free_ops/decode_hybrid_layers_tasks.py",
             "return slot, keeps, keeps & (lens > 1)", "return slot, keeps, keeps",
             ("tests/test_decode_hybrid_layers.py",)),
    Mutation("an inference model's weights are stacked at its first decode step, under earlier graphs",
             "modeling/engine/runner.py", "            model.stack_layer_weights()", "            pass",
             ("tests/test_decode_layers.py",)),
    Mutation("the engine's decode steps never take the kernels chosen for them", "modeling/engine/runner.py",
             'kernels = self.decode_kernels(key[2]) if key[0] == "decode" else "ops"', 'kernels = "ops"',
             ("tests/test_engine.py",)),
    Mutation("capture_all leaves out the mixed shapes of t sequences in t tokens", "modeling/engine/runner.py",
             "for lower, s in zip(seq, seq[1:]) if lower <= t]", "for lower, s in zip(seq, seq[1:]) if lower < t]",
             ("tests/test_engine.py",)),
    Mutation("a prefill chunk that samples nothing is skipped", "modeling/engine/engine.py",
             "        logits = self.runner.run(batch)\n",
             "        logits = self.runner.run(batch) if batch.sampling else None\n",
             ("tests/test_engine.py",)),
    Mutation("preemption picks the oldest running sequence", "modeling/engine/scheduler.py",
             "victim = self.running[-1]", "victim = self.running[0]", ("tests/test_engine_scheduling.py",)),
    Mutation("sampling streams ignore the position", "modeling/engine/sampler.py",
             "^ (positions & M32))", "^ 0)", ("tests/test_engine_scheduling.py",)),
    Mutation("the lookahead gives a finished sequence the token in flight", "modeling/engine/engine.py",
             "                if seq.status is Status.FINISHED:  # aborted, or finished by the token before this one\n"
             "                    continue\n", "", ("tests/test_engine_lookahead.py",)),
    Mutation("the lookahead step keeps placeholder input ids", "modeling/engine/engine.py",
             "            batch.input_ids.index_copy_(0, dst, prev.sampled.tokens.index_select(0, src))\n",
             "            pass\n", ("tests/test_engine_lookahead.py",)),
    Mutation("the lookahead step's aligned rows keep placeholder input ids", "modeling/engine/engine.py",
             "                batch.input_ids[:len(src)].copy_(prev.sampled.tokens[:len(src)])",
             "                pass", ("tests/test_engine_lookahead.py",)),
    Mutation("a step shape's graph capture counts as scheduling", "modeling/engine/engine.py",
             "st.schedule_s += (t1 - t0 - captured)", "st.schedule_s += (t1 - t0)", ("tests/test_engine.py",)),
    Mutation("a block table that grew is not copied to the device", "modeling/engine/runner.py",
             "any(a is not b or m != n for", "any(a is not b for", ("tests/test_engine.py",)),
    Mutation("another sequence's block table of the same length is not copied", "modeling/engine/runner.py",
             "any(a is not b or m != n for", "any(m != n for", ("tests/test_engine.py",)),
    Mutation("a step launched ahead samples penalised rows before the tokens before it are read", "modeling/engine/engine.py",
             "    return seq.params.has_penalty or (seq.controls is not None and seq.controls.needs_history)",
             "    return seq.controls is not None and seq.controls.needs_history", ("tests/test_engine_lookahead.py",)),
    Mutation("a step launched ahead samples masked rows before the tokens before it are read", "modeling/engine/engine.py",
             "    return seq.params.has_penalty or (seq.controls is not None and seq.controls.needs_history)",
             "    return seq.params.has_penalty", ("tests/test_engine_controls.py",)),
    Mutation("a greedy batch skips its penalties", "modeling/engine/sampler.py",
             'if modes == {"greedy"} and penalties is None:', 'if modes == {"greedy"}:',
             ("tests/test_engine_sampling.py",)),
    Mutation("the host reads sampled tokens before their copy lands", "modeling/engine/sampler.py",
             "            self._event.synchronize()\n", "            pass\n", ("tests/test_engine.py",), gpu_only=True),
    Mutation("a preempted sequence queues behind the waiting ones", "modeling/engine/scheduler.py",
             "self.waiting.appendleft(seq)", "self.waiting.append(seq)", ("tests/test_engine_scheduling.py",)),
    Mutation("a preempted sequence is readmitted with its token in flight", "modeling/engine/scheduler.py",
             "            if seq.num_pending:  # preempted with a token still on its way to the host: next step\n"
             "                break\n", "", ("tests/test_engine_scheduling.py",)),
    Mutation("a freed table's leading blocks are reused first", "modeling/engine/block_manager.py",
             "for block in reversed(table):", "for block in table:", ("tests/test_engine_scheduling.py",)),
    Mutation("the prefix lookup takes every known block, the prompt's last included", "modeling/engine/block_manager.py",
             "for h in known[:(len(tokens) - 1) // self.block_size]:", "for h in known:",
             ("tests/test_engine_scheduling.py",)),
    Mutation("a prompt asking for its logprobs takes cached blocks", "modeling/engine/scheduler.py",
             "lookup = not seq.needs_prompt_logprobs", "lookup = True", ("tests/test_engine_prompt_logprobs.py",)),
    Mutation("a preempted prompt is scored again from its start", "modeling/engine/prefill_logprobs.py",
             "first, end = max(start, len(seq.prompt_logprobs) - 1),", "first, end = start,",
             ("tests/test_engine_prompt_logprobs.py",)),
    Mutation("abort finishes a sequence without the engine's lock", "modeling/engine/engine.py",
             '        with self._lock:\n            if seq.status is not Status.FINISHED:\n                self.scheduler.finish(seq, "abort")',
             '        if True:\n            if seq.status is not Status.FINISHED:\n                self.scheduler.finish(seq, "abort")',
             ("tests/test_engine.py",)),
    # The server (tests/test_serve.py, test_serve_units.py).
    Mutation("the API key check takes a prefix of the key", "modeling/serve/app.py",
             "if not hmac.compare_digest(token.strip().encode(), key.encode()):",
             "if not key.startswith(token.strip()):", ("tests/test_serve.py",)),
    Mutation("a chunked body is not held to the size limit", "modeling/serve/app.py",
             "        if size > limit:\n            raise APIError(413, f\"The request body is larger",
             "        if False:\n            raise APIError(413, f\"The request body is larger", ("tests/test_serve.py",)),
    Mutation("without max_tokens the default is not cut to the room left", "modeling/serve/protocol.py",
             "min(default or room, room)", "default or room", ("tests/test_serve_units.py",)),
    Mutation("a matched stop string leaves its choice running in the engine", "modeling/serve/generation.py",
             "            if c.stops.matched is not None:\n                self.loop.abort(c.rid)", "            if False:\n                pass",
             ("tests/test_serve_units.py",)),
    # Kernel bounds: each bad value fails a test by assertion, never by crashing the interpreter.
    Mutation("paged_attention_reference gives NaN for a query that sees no key", "qwen_ops/paged_attention.py",
             "p = torch.where(keep.any(-1)[:, None, None, None], torch.softmax(s, dim=-1), 0.0)",
             "p = torch.softmax(s, dim=-1)",
             ("tests/test_ops_paged_attention.py",)),
    Mutation("paged_attention's kernel reads block ids unclamped", "csrc_free_ops/paged_attention.py",
             "block = tl.minimum(tl.maximum(block, 0), NUM_BLOCKS - 1)", "block = block",
             ("tests/test_ops_paged_attention.py",)),
    Mutation("paged_attention's kernel reads seq_lens unclamped", "csrc_free_ops/paged_attention.py",
             "seq_len = _load_clamped(lens_ptr + seq * stride_lens, 0, MAX_CONTEXT)",
             "seq_len = tl.load(lens_ptr + seq * stride_lens).to(tl.int32)", ("tests/test_ops_paged_attention.py",)),
    Mutation("paged_attention's kernel reads cu_seqlens_q unclamped", "csrc_free_ops/paged_attention.py",
             "start = _load_clamped(cu_ptr + seq * stride_cu, 0, N)\n    qlen = _load_clamped(cu_ptr + (seq + 1) * stride_cu, "
             "start, N) - start", "start = tl.load(cu_ptr + seq * stride_cu)\n    qlen = tl.load(cu_ptr + (seq + 1) * "
             "stride_cu) - start", ("tests/test_ops_paged_attention.py",)),
    Mutation("the fixed-length conv leaves conv_states unwritten", "csrc_free_ops/causal_conv1d.py",
             "    if conv_states is not None:\n        conv_states.copy_(final)\n", "",
             ("tests/test_ops_causal_conv1d.py",)),
    Mutation("the fixed-length delta rule drops a strided state's final value", "csrc_free_ops/gated_delta_rule.py",
             "        if work is not state:\n            state.copy_(work)\n", "", ("tests/test_ops_head_dims.py",)),
    Mutation("decreasing cu_seqlens accepted (packed sequences)", "qwen_ops/causal_conv1d.py",
             " or any(b < a for a, b in zip(cu, cu[1:])):", ":",
             ("tests/test_ops_causal_conv1d.py", "tests/test_ops_gated_delta_rule_varlen.py")),
    Mutation("cu_seqlens ending before N accepted (packed sequences)", "qwen_ops/causal_conv1d.py",
             "if cu[0] != 0 or cu[-1] != n or any(", "if cu[0] != 0 or any(",
             ("tests/test_ops_causal_conv1d.py", "tests/test_ops_gated_delta_rule_varlen.py")),
    Mutation("state slots outside the pool accepted (packed sequences)", "qwen_ops/causal_conv1d.py",
             "if state_slots.numel() and not bool(((state_slots >= 0) & (state_slots < pool_rows)).all()):", "if False:",
             ("tests/test_ops_causal_conv1d.py", "tests/test_ops_gated_delta_rule_varlen.py")),
    # The trainer (tests/test_train.py, test_train_interrupt.py).
    Mutation("a sequence starting at position 0 continues its state slot's stale state", "modeling/engine/step.py",
             "self.seq_lens > (cu[1:] - cu[:-1])", "self.seq_lens >= (cu[1:] - cu[:-1])", ("tests/test_engine.py",)),
    Mutation("the best weights alias the live ones (fp32 saves)", "modeling/train/trainer.py",
             "m.detach().to(self.save_dtype, copy=True)", "m.detach().to(self.save_dtype)", ("tests/test_train.py",)),
    Mutation("the time-budget schedule takes the smaller progress", "modeling/train/trainer.py",
             "progress = max(progress, elapsed_s", "progress = min(progress, elapsed_s", ("tests/test_train.py",)),
    # FP8 checkpoints and experts (tests/test_fp8_checkpoints.py, test_ops_moe.py) and grammars
    # (tests/test_engine_controls.py).
    Mutation("FP8 scales read in the wrong block order", "modeling/model/loader.py",
             "s.copy_(handles[name + SCALE_SUFFIX].get_tensor(name + SCALE_SUFFIX))",
             "s.copy_(handles[name + SCALE_SUFFIX].get_tensor(name + SCALE_SUFFIX).flip(0))",
             ("tests/test_fp8_checkpoints.py",)),
    Mutation("FP8 experts' up rows take the gate rows' block scales (GEMV)", "csrc_free_ops/moe.py",
             "fp8_block_scales(ws_e, N + rows, k0, stride_wsn, 1)", "fp8_block_scales(ws_e, rows, k0, stride_wsn, 1)",
             ("tests/test_ops_moe.py",)),
    Mutation("FP8 weight tiles narrower than a block step their scales every K step", "csrc_free_ops/common.py",
             "ws_ptrs += tl.where((k0 + BLOCK_K) // _FP8_BLOCK > k0 // _FP8_BLOCK, stride_wsk, 0)",
             "ws_ptrs += stride_wsk", ("tests/test_ops_moe.py",)),
    Mutation("FP8 experts quantised at load as one [E * N, K] weight", "modeling/model/loader.py",
             "fp8.quantize(weight)", "fp8.quantize(out)", ("tests/test_fp8_checkpoints.py",)),
    # FP8 weights in the fused decode ops (tests/test_ops_fused_decode.py, tests/test_fp8_checkpoints.py).
    Mutation("fused FP8 GEMV scales every K step by the first block column's scales",
             "csrc_free_ops/fused_decode_blocks.py",
             "scales = fp8_block_scales(sw_ptr, rows, k0, stride_sn, stride_sk)",
             "scales = fp8_block_scales(sw_ptr, rows, 0, stride_sn, stride_sk)", ("tests/test_ops_fused_decode.py",)),
    Mutation("fused FP8 gate_up scales the up half by the gate rows' scales", "csrc_free_ops/fused_decode.py",
             "scale_rows_up = N + rn % N", "scale_rows_up = rn % N", ("tests/test_ops_fused_decode.py",)),
    Mutation("fused FP8 prefetch takes slices deeper than a scale block", "csrc_free_ops/fused_decode.py",
             "if PREFETCH and fits and not (fp8 and step > FP8_BLOCK):", "if PREFETCH and fits:",
             ("tests/test_ops_fused_decode.py",)),
    Mutation("fused FP8 loop keeps a config's K steps deeper than a scale block", "csrc_free_ops/fused_decode.py",
             "        cfg = cfg._replace(block_k=min(cfg.block_k, FP8_BLOCK))\n", "",
             ("tests/test_ops_fused_decode.py",)),
    Mutation("the fused in_proj drops its FP8 weight's unquantised tail", "modeling/model/fp8.py",
             "    if tail is None:\n        return ops.norm_linear(", "    if True:\n        return ops.norm_linear(",
             ("tests/test_fp8_checkpoints.py",)),
    Mutation("wide models take the persistent kernel by default", "modeling/engine/runner.py",
             "model.config.hidden_size <= PERSISTENT_MAX_HIDDEN", "True", ("tests/test_engine.py",)),
    Mutation("small decode batches on CUDA run op by op", "modeling/engine/runner.py",
             "if num_seqs > 1 and not (cuda and num_seqs <= FUSED_MAX_SEQS):", "if num_seqs > 1:",
             ("tests/test_engine.py",)),
    Mutation("small decode batches of an FP8 model take the persistent kernel's row loop", "modeling/engine/runner.py",
             "persistent = model.supports_persistent_decode and not model.holds_fp8",
             "persistent = model.supports_persistent_decode", ("tests/test_engine.py",)),
    Mutation("an FP8 Qwen3.5 model may take the hybrid persistent kernel", "modeling/model/causal_lm.py",
             "and c.qk_norm and not c.qkv_bias and not self.holds_fp8 and", "and c.qk_norm and not c.qkv_bias and",
             ("tests/test_fp8_checkpoints.py",)),
    Mutation("the persistent kernel's FP8 GEMV drops its block scales", "csrc_free_ops/decode_layers_tasks.py",
             "axis=2) * scales, axis=1)", "axis=2), axis=1)", ("tests/test_decode_layers.py",)),
    Mutation("the persistent kernel's batched GEMV keeps one K chunk's products", "csrc_free_ops/decode_layers_tasks.py",
             "return tl.trans(tl.sum(acc, axis=0))", "return tl.trans(tl.max(acc, axis=0))",
             ("tests/test_decode_layers.py",)),
    # Tensor parallelism's processes (tests/test_tensor_parallel.py).
    Mutation("a worker keeps the lookahead's placeholder inputs", "modeling/engine/workers.py",
             "            batch.input_ids.index_copy_(0, dst, self.tokens.index_select(0, src))\n", "",
             ("tests/test_tensor_parallel.py",)),
    Mutation("a dead worker is not named when a collective fails", "modeling/engine/engine.py",
             "                while time.monotonic() < deadline:\n                    self.workers.check()",
             "                while time.monotonic() < deadline:\n                    pass",
             ("tests/test_tensor_parallel.py",)),
    Mutation("the LLM drops a step in flight when it builds a larger engine", "modeling/api/llm.py",
             "            engine.drain()  # a step in flight", "            pass  # a step in flight",
             ("tests/test_tensor_parallel.py",)),
    Mutation("close drops a step in flight", "modeling/api/llm.py",
             "                        engine.drain()\n", "                        pass\n", ("tests/test_tensor_parallel.py",)),
    Mutation("a worker stages its step without rank 0's block table rows", "modeling/engine/runner.py",
             "        if staged.tables is not None:\n", "        if False:\n", ("tests/test_tensor_parallel.py",)),
    Mutation("a grammar-only row's dead end goes unnoticed (batch fill)", "modeling/engine/token_masks.py",
             "            seqs[i].controls.dead_end = dead\n", "            pass\n", ("tests/test_engine_controls.py",)),
    Mutation("the rows no grammar fills keep the bitmask's old bytes", "modeling/engine/token_masks.py",
             "        host[np.setdiff1d(np.arange(len(seqs)), grammar)] = -1\n", "        pass\n",
             ("tests/test_engine_controls.py",)),
    Mutation("a completed grammar does not end its sequence", "modeling/engine/sequence.py",
             "if token in self.stop_token_ids or (self.controls is not None and self.controls.terminated):",
             "if token in self.stop_token_ids:", ("tests/test_engine_controls.py",)),
]


def outcome(tests: tuple, scratch: Path) -> str:
    """'pass', 'fail' (pytest reported a failed test) or 'crash' (the process ended without
    reporting one: killed by a signal, or aborted by the interpreter)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if proc.returncode == 0:
        return "pass"
    return "fail" if re.search(r"\b\d+ (failed|errors?)\b", proc.stdout) else "crash"


def run(mutation: Mutation, scratch: Path) -> str:
    """'caught', 'SURVIVED', 'CRASHED' (no test failed: the process died), 'stale' (the snippet is
    no longer in the file) or 'GPU only' (a mutation only a `cuda` test sees, on a machine without
    CUDA)."""
    target = scratch / mutation.path
    original = target.read_text()
    if original.count(mutation.old) != 1:
        return "stale"
    if mutation.gpu_only and not torch.cuda.is_available():
        return "GPU only"
    target.write_text(original.replace(mutation.old, mutation.new))
    try:
        return {"pass": "SURVIVED", "fail": "caught", "crash": "CRASHED"}[outcome(mutation.tests, scratch)]
    finally:
        target.write_text(original)


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m tests.mutations", description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", help="run only mutations whose name contains one of these words")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    a = p.parse_args()
    chosen = [m for m in MUTATIONS if not a.only or any(w in m.name for w in a.only)]
    if a.list:
        for m in chosen:
            print(f"{m.name}  ({m.path})")
        return 0
    with tempfile.TemporaryDirectory(prefix="qwen-mutations-") as tmp:
        scratch = Path(tmp) / "repo"
        shutil.copytree(ROOT, scratch, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build"))
        rows = []
        baseline = {}
        for m in chosen:
            t0 = time.time()
            if m.tests not in baseline:
                baseline[m.tests] = outcome(m.tests, scratch) == "pass"
                if not baseline[m.tests]:
                    print(f"the unmutated copy fails {' '.join(m.tests)}", flush=True)
            rows.append((m.name, run(m, scratch) if baseline[m.tests] else "baseline fails", time.time() - t0))
            print(f"{rows[-1][1]:9s} {rows[-1][2]:6.1f} s  {m.name}", flush=True)
    caught = sum(r[1] == "caught" for r in rows)
    gpu_only = sum(r[1] == "GPU only" for r in rows)
    print(f"\n| mutation | result |\n|---|---|\n" + "\n".join(f"| {n} | {r} |" for n, r, _ in rows))
    print(f"\n{caught} of {len(rows) - gpu_only} caught" + (f" ({gpu_only} GPU only, not run)" if gpu_only else ""))
    return 0 if caught == len(rows) - gpu_only else 1


if __name__ == "__main__":
    sys.exit(main())
