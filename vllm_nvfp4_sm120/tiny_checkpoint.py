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

Other layouts published checkpoints use, each an option of :func:`write_tiny_checkpoint`: ModelOpt
MIXED_PRECISION with FP8 (or W4A16 NVFP4) attention next to NVFP4 experts (``attention``), a
``quantized_layers`` map that names each MoE layer once (``experts_by_layer``), an FP8 KV cache
(``kv_cache_quant_algo``), several shards with an index (``shards``).  The tests craft broken checkpoints
from these: ``tensors`` replaces or drops tensors, ``config`` overrides ``config.json`` keys, and
:func:`edit_safetensors_header` rewrites a written file's header.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .checkpoint import INDEX_FILE
from .format import E4M3_MAX, GlobalScale, quantize_nvfp4

MODELOPT = "modelopt"
COMPRESSED_TENSORS = "compressed-tensors"
FORMATS = (MODELOPT, COMPRESSED_TENSORS)
SAFETENSORS_FILE = "model.safetensors"
NVFP4, W4A16_NVFP4, FP8 = "NVFP4", "W4A16_NVFP4", "FP8"  # ModelOpt's per-layer algorithm names
LAYER_ALGOS = (NVFP4, W4A16_NVFP4, FP8)

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


def modelopt_quant_config(layer_algos: dict[str, str], *, kv_cache_quant_algo: str | None = None) -> dict:
    """``hf_quant_config.json`` as ModelOpt writes it for the quantized modules ``{name: algo}``.

    All NVFP4: ``quant_algo: NVFP4``.  Anything else (W4A16_NVFP4, FP8 next to NVFP4) is a ``MIXED_PRECISION``
    config with a ``quantized_layers`` map: vLLM 0.33 accepts ``W4A16_NVFP4`` only per layer (a top-level one is
    rejected as an unknown algo).  ``kv_cache_quant_algo`` is mandatory for vLLM (null is fine).
    """
    quant = {"quant_algo": NVFP4, "kv_cache_quant_algo": kv_cache_quant_algo, "group_size": 16,
             "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}
    if set(layer_algos.values()) != {NVFP4}:
        quant["quant_algo"] = "MIXED_PRECISION"
        quant["quantized_layers"] = {m: {"quant_algo": a, **({"group_size": 16} if a != FP8 else {})}
                                     for m, a in layer_algos.items()}
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


def _is_attention(group: str) -> bool:
    return ".self_attn." in group


def _fp8_tensors(name: str, w: torch.Tensor, input_amax: float) -> dict[str, torch.Tensor]:
    """ModelOpt FP8 (per-tensor, static input scale): e4m3 weight and the two decode scales amax / 448."""
    scale = w.abs().max() / E4M3_MAX
    return {f"{name}.weight": (w / scale).to(torch.float8_e4m3fn), f"{name}.weight_scale": scale.to(torch.float32),
            f"{name}.input_scale": torch.tensor(input_amax / E4M3_MAX, dtype=torch.float32)}


def _group_algo(group: str, w4a16: bool, attention: str | None) -> str:
    """The ModelOpt algorithm of a group of :func:`linear_groups`."""
    if attention is not None and _is_attention(group):
        return attention
    return W4A16_NVFP4 if w4a16 else NVFP4


def quantized_tensors(shape: TinyShape, fmt: str, *, w4a16: bool = False, shared_fused_globals: bool = False,
                      attention: str | None = None, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The quantized linears' tensors under ``fmt``'s names; ``attention``: q/k/v/o's own ModelOpt algorithm
    (FP8, NVFP4 or W4A16_NVFP4; None: as the experts)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")
    if attention not in (None, *LAYER_ALGOS):
        raise ValueError(f"attention: expected one of {LAYER_ALGOS} or None, got {attention!r}")
    out: dict[str, torch.Tensor] = {}
    for group, members in linear_groups(shape):
        algo = _group_algo(group, w4a16, attention)
        # Different magnitudes per part, so independent globals differ (by 20-60%).
        weights = [torch.randn(n, k, generator=gen) * 0.05 * (1.0 + 0.2 * j + 0.2 * float(torch.rand((), generator=gen)))
                   for j, (_, n, k) in enumerate(members)]
        shared = GlobalScale.of(torch.cat([w.reshape(-1) for w in weights])) if shared_fused_globals else None
        input_amax = 2.0 + 6.0 * float(torch.rand((), generator=gen))
        input_gs = GlobalScale.from_amax(input_amax)
        if algo == FP8:
            for (name, _, _), w in zip(members, weights):
                out.update(_fp8_tensors(name, w, input_amax))
            continue
        static_input = algo == NVFP4  # W4A4: a static input scale per part (W4A16_NVFP4 has none)
        for (name, _, _), w in zip(members, weights):
            gs = shared or GlobalScale.of(w)
            q = quantize_nvfp4(w, gs, name=name)
            if fmt == MODELOPT:
                out[f"{name}.weight"] = q.codes
                out[f"{name}.weight_scale"] = q.scales
                out[f"{name}.weight_scale_2"] = gs.dec.clone()
                if static_input:
                    out[f"{name}.input_scale"] = input_gs.dec.clone()
            else:
                out[f"{name}.weight_packed"] = q.codes
                out[f"{name}.weight_scale"] = q.scales
                out[f"{name}.weight_global_scale"] = gs.enc.reshape(1).clone()
                if static_input:
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


def layer_algos(shape: TinyShape, *, w4a16: bool = False, attention: str | None = None,
                experts_by_layer: bool = False) -> dict[str, str]:
    """The ModelOpt algorithm of each quantized module; with ``experts_by_layer`` one entry per MoE layer
    (``model.layers.{i}.mlp.experts``), as some exporters write the ``quantized_layers`` map."""
    out = {}
    for group, members in linear_groups(shape):
        algo = _group_algo(group, w4a16, attention)
        for name, _, _ in members:
            key = name.rsplit(".", 2)[0] if experts_by_layer and ".mlp.experts." in name else name
            out[key] = algo
    return out


def _kv_scales(shape: TinyShape) -> dict[str, torch.Tensor]:
    """An FP8 KV cache's per-layer k/v scales (1.0: the tiny model's activations are small)."""
    return {f"model.layers.{i}.self_attn.{proj}_proj.{proj}_scale": torch.tensor(1.0)
            for i in range(shape.layers) for proj in ("k", "v")}


def _write_safetensors(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    """One ``model.safetensors``, or ``shards`` files and the index that maps every tensor to its file."""
    from safetensors.torch import save_file

    if shards == 1:
        save_file(tensors, str(out / SAFETENSORS_FILE), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per:(i + 1) * per]}
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def write_tiny_checkpoint(
    out_dir: str | Path,
    fmt: str = MODELOPT,
    *,
    w4a16: bool = False,
    shared_fused_globals: bool = False,
    seed: int = 0,
    shape: TinyShape = TinyShape(),
    tokenizer: bool = True,
    attention: str | None = None,
    experts_by_layer: bool = False,
    kv_cache_quant_algo: str | None = None,
    shards: int = 1,
    tensors: dict[str, torch.Tensor | None] | None = None,
    config: dict | None = None,
) -> Path:
    """Write the checkpoint into ``out_dir`` (created if needed) and return it.

    ``w4a16``: the NVFP4 layers are weight-only.  ModelOpt only: ``attention``, q/k/v/o's own algorithm ("FP8",
    "NVFP4", "W4A16_NVFP4"; a MIXED_PRECISION config when the layers differ), ``experts_by_layer`` (one
    ``quantized_layers`` entry per MoE layer; needs a MIXED_PRECISION config), ``kv_cache_quant_algo`` ("FP8": the
    config says so and each attention layer gets k/v scales).
    ``shards`` > 1 splits the tensors over that many files with an index.  ``tensors`` replaces tensors by name
    (None drops one) and ``config`` overrides ``config.json`` keys, after everything else.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")
    if fmt != MODELOPT and (attention or experts_by_layer or kv_cache_quant_algo):
        raise ValueError("attention, experts_by_layer and kv_cache_quant_algo: ModelOpt checkpoints only")
    algos = layer_algos(shape, w4a16=w4a16, attention=attention, experts_by_layer=experts_by_layer)
    if experts_by_layer and set(algos.values()) == {NVFP4}:
        raise ValueError("experts_by_layer: needs a MIXED_PRECISION config (w4a16, or another attention algorithm)")
    if shards < 1:
        raise ValueError(f"shards: expected at least 1, got {shards}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights = _plain_tensors(shape, gen)
    weights.update(quantized_tensors(shape, fmt, w4a16=w4a16, shared_fused_globals=shared_fused_globals,
                                     attention=attention, gen=gen))
    if kv_cache_quant_algo:
        weights.update(_kv_scales(shape))
    for name, t in (tensors or {}).items():
        if t is None:
            weights.pop(name, None)
        else:
            weights[name] = t
    _write_safetensors(weights, out, shards)
    hf = hf_config(shape)
    if fmt == MODELOPT:
        (out / "hf_quant_config.json").write_text(json.dumps(
            modelopt_quant_config(algos, kv_cache_quant_algo=kv_cache_quant_algo), indent=2))
    else:
        hf["quantization_config"] = compressed_tensors_quant_config(w4a16)
    hf.update(config or {})
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    if tokenizer:
        write_tokenizer(out, shape.vocab)
    (out / "tiny_checkpoint.json").write_text(json.dumps(
        {"format": fmt, "w4a16": w4a16, "shared_fused_globals": shared_fused_globals, "seed": seed,
         "attention": attention, "experts_by_layer": experts_by_layer,
         "kv_cache_quant_algo": kv_cache_quant_algo, "shards": shards, "shape": asdict(shape),
         "edited_tensors": sorted(tensors or {}), "edited_config": sorted(config or {})}, indent=2))
    return out


def edit_safetensors_header(path: str | Path, edit: Callable[[dict], object]) -> None:
    """Rewrite the JSON header of a written ``.safetensors`` file with ``edit(header)`` (any JSON value), keeping
    the data section: how the tests make a header that lies (an offset past the end, a list, ...)."""
    path = Path(path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.dumps(edit(json.loads(raw[8:8 + n]))).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])
