"""A tiny but real NVFP4 checkpoint: a 2-layer Qwen3-MoE with random weights, in ModelOpt or compressed-tensors form.

Used by ``examples/make_tiny_checkpoint.py``, ``vllm-nvfp4-sm120 inspect`` (its demo default) and the CLI tests.
Only torch, safetensors and (for the tokenizer) ``tokenizers`` are needed; vLLM is not imported.

What is "real" about it (so vLLM loads it like a production export):

* ``config.json`` is a ``Qwen3MoeForCausalLM`` config (every layer sparse, 4 experts, top-2);
* tensor names are Hugging Face's Qwen3-MoE names (``model.layers.{i}.self_attn.q_proj``,
  ``model.layers.{i}.mlp.experts.{e}.gate_proj``, ...), which vLLM's loader maps to ``qkv_proj`` / ``w13``;
* quantized linears carry the names each exporter writes:
  ModelOpt   ``weight`` u8 ``[N, K/2]``, ``weight_scale`` e4m3 ``[N, K/16]``, ``weight_scale_2`` f32 ``[]`` (decode
             global), ``input_scale`` f32 ``[]`` (decode), with ``hf_quant_config.json``;
  compressed-tensors  ``weight_packed``, ``weight_scale``, ``weight_global_scale`` f32 ``[1]`` (encode global),
             ``input_global_scale`` f32 ``[1]`` (encode), with ``quantization_config`` in ``config.json``
             (format ``nvfp4-pack-quantized``);
* the router (``mlp.gate``), embeddings, norms and ``lm_head`` stay bf16 and are excluded from quantization;
* W4A16 variants drop the input scales and say so in the quant config (``W4A16_NVFP4`` / no
  ``input_activations``).

Fused parts (q/k/v, gate/up) are quantized part by part with their own global, as exporters do unless they
share the amax; by default the parts get different magnitudes, so their globals differ by more than 5% (the
case the plugin warns about).  ``shared_fused_globals=True`` quantizes every fused group with one global.
Parts that read the same input (q/k/v, gate/up) share one input scale, as calibration gives them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .format import GlobalScale, quantize_nvfp4

MODELOPT = "modelopt"
COMPRESSED_TENSORS = "compressed-tensors"
FORMATS = (MODELOPT, COMPRESSED_TENSORS)
SAFETENSORS_FILE = "model.safetensors"

# Specials of the byte-level tokenizer (ids 256, 257, 258 after the 256 byte tokens).
EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyShape:
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    experts: int = 4
    top_k: int = 2
    moe_intermediate: int = 64
    vocab: int = 320  # 259 tokenizer entries, padded to a multiple of 64 as real models do


_FP4_ARGS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
             "dynamic": False, "observer": "minmax", "actorder": None, "block_structure": None}


def modelopt_quant_config(w4a16: bool = False, modules: list[str] | None = None) -> dict:
    """``hf_quant_config.json`` as ModelOpt writes it (``kv_cache_quant_algo`` is mandatory for vLLM, null is fine).

    W4A16: vLLM 0.33 accepts ``W4A16_NVFP4`` only per layer, under ``quant_algo: MIXED_PRECISION`` with a
    ``quantized_layers`` map (a top-level ``W4A16_NVFP4`` is rejected as an unknown algo), so that is what we
    write; ``modules`` are the quantized modules' names.
    """
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
             "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}
    if w4a16:
        quant["quant_algo"] = "MIXED_PRECISION"
        quant["quantized_layers"] = {m: {"quant_algo": "W4A16_NVFP4", "group_size": 16} for m in modules or []}
    return {"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": quant}


def compressed_tensors_quant_config(w4a16: bool = False) -> dict:
    """``quantization_config`` of an llm-compressor NVFP4 export (W4A4: static input globals, local activations)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": "nvfp4-pack-quantized",
                "weights": dict(_FP4_ARGS),
                "input_activations": None if w4a16 else dict(_FP4_ARGS, dynamic="local"),
                "output_activations": None,
            }
        },
        "ignore": ["lm_head", "re:.*mlp.gate$"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def hf_config(shape: TinyShape) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": shape.hidden,
        "intermediate_size": 4 * shape.hidden,
        "moe_intermediate_size": shape.moe_intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "num_experts": shape.experts,
        "num_experts_per_tok": shape.top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "vocab_size": shape.vocab,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "bos_token_id": 256,
        "eos_token_id": 256,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
    }


def linear_groups(shape: TinyShape) -> list[tuple[str, list[tuple[str, int, int]]]]:
    """Quantized linears grouped by the input they read: ``(group, [(module name, N, K), ...])``.

    A group with several members is a fused part set in vLLM (q/k/v → ``qkv_proj``, gate/up → ``w13``).
    """
    s = shape
    groups = []
    for i in range(s.layers):
        p = f"model.layers.{i}"
        groups.append((f"{p}.self_attn.qkv", [(f"{p}.self_attn.q_proj", s.heads * s.head_dim, s.hidden),
                                             (f"{p}.self_attn.k_proj", s.kv_heads * s.head_dim, s.hidden),
                                             (f"{p}.self_attn.v_proj", s.kv_heads * s.head_dim, s.hidden)]))
        groups.append((f"{p}.self_attn.o", [(f"{p}.self_attn.o_proj", s.hidden, s.heads * s.head_dim)]))
        for e in range(s.experts):
            q = f"{p}.mlp.experts.{e}"
            groups.append((f"{q}.gate_up", [(f"{q}.gate_proj", s.moe_intermediate, s.hidden),
                                            (f"{q}.up_proj", s.moe_intermediate, s.hidden)]))
            groups.append((f"{q}.down", [(f"{q}.down_proj", s.hidden, s.moe_intermediate)]))
    return groups


def _plain_tensors(shape: TinyShape, gen: torch.Generator) -> dict[str, torch.Tensor]:
    s = shape

    def rand(*dims, std=0.02):
        return (torch.randn(*dims, generator=gen) * std).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    t = {"model.embed_tokens.weight": rand(s.vocab, s.hidden), "model.norm.weight": ones(s.hidden),
         "lm_head.weight": rand(s.vocab, s.hidden)}
    for i in range(s.layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = ones(s.hidden)
        t[f"{p}.post_attention_layernorm.weight"] = ones(s.hidden)
        t[f"{p}.self_attn.q_norm.weight"] = ones(s.head_dim)
        t[f"{p}.self_attn.k_norm.weight"] = ones(s.head_dim)
        t[f"{p}.mlp.gate.weight"] = rand(s.experts, s.hidden)  # the router stays bf16
    return t


def quantized_tensors(shape: TinyShape, fmt: str, *, w4a16: bool = False, shared_fused_globals: bool = False,
                      gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The quantized linears' tensors under ``fmt``'s names."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")
    out: dict[str, torch.Tensor] = {}
    for _, members in linear_groups(shape):
        # Different magnitudes per part, so independent globals differ (by 20-60%).
        weights = [torch.randn(n, k, generator=gen) * 0.05 * (1.0 + 0.2 * j + 0.2 * float(torch.rand((), generator=gen)))
                   for j, (_, n, k) in enumerate(members)]
        shared = GlobalScale.of(torch.cat([w.reshape(-1) for w in weights])) if shared_fused_globals else None
        input_gs = GlobalScale.from_amax(2.0 + 6.0 * float(torch.rand((), generator=gen)))
        for (name, _, _), w in zip(members, weights):
            gs = shared or GlobalScale.of(w)
            q = quantize_nvfp4(w, gs, name=name)
            if fmt == MODELOPT:
                out[f"{name}.weight"] = q.codes
                out[f"{name}.weight_scale"] = q.scales
                out[f"{name}.weight_scale_2"] = gs.dec.clone()
                if not w4a16:
                    out[f"{name}.input_scale"] = input_gs.dec.clone()
            else:
                out[f"{name}.weight_packed"] = q.codes
                out[f"{name}.weight_scale"] = q.scales
                out[f"{name}.weight_global_scale"] = gs.enc.reshape(1).clone()
                if not w4a16:
                    out[f"{name}.input_global_scale"] = input_gs.enc.reshape(1).clone()
    return out


def write_tokenizer(out_dir: Path, vocab: int) -> bool:
    """A byte-level BPE tokenizer (256 byte tokens, no merges, 3 specials); False if ``tokenizers`` is missing."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return False
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # GPT-2's byte → printable character map fixes the id of each byte: sort the alphabet by the byte it encodes.
    table = _bytes_to_unicode()
    vocab_map = {table[b]: b for b in range(256)}
    assert set(vocab_map) == set(byte_chars)
    tok = Tokenizer(models.BPE(vocab=vocab_map, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS, IM_START, IM_END])
    if tok.get_vocab_size() > vocab:
        raise AssertionError(f"tokenizer has {tok.get_vocab_size()} entries, more than vocab_size {vocab}")
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": EOS, "pad_token": EOS, "unk_token": None,
        "model_max_length": 1024, "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 256, "max_new_tokens": 16}))
    return True


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable stand-in for each byte (what tokenizers' ByteLevel pre-tokenizer emits).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_tiny_checkpoint(
    out_dir: str | Path,
    fmt: str = MODELOPT,
    *,
    w4a16: bool = False,
    shared_fused_globals: bool = False,
    seed: int = 0,
    shape: TinyShape = TinyShape(),
    tokenizer: bool = True,
) -> Path:
    """Write the checkpoint into ``out_dir`` (created if needed) and return it."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = _plain_tensors(shape, gen)
    tensors.update(quantized_tensors(shape, fmt, w4a16=w4a16, shared_fused_globals=shared_fused_globals, gen=gen))
    save_file(tensors, str(out / SAFETENSORS_FILE), metadata={"format": "pt"})
    config = hf_config(shape)
    if fmt == MODELOPT:
        modules = [name for _, members in linear_groups(shape) for name, _, _ in members]
        (out / "hf_quant_config.json").write_text(json.dumps(modelopt_quant_config(w4a16, modules), indent=2))
    else:
        config["quantization_config"] = compressed_tensors_quant_config(w4a16)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer:
        write_tokenizer(out, shape.vocab)
    (out / "tiny_checkpoint.json").write_text(json.dumps(
        {"format": fmt, "w4a16": w4a16, "shared_fused_globals": shared_fused_globals, "seed": seed,
         "shape": asdict(shape)}, indent=2))
    return out
