"""k-quant models (`--dtype gguf`): a GGUF file's Q4_K and Q6_K blocks run as stored, each token's
activations in int8 per 256 columns; width-invariant to the bit, so the model is its own
reference for exactness, as an int8 model is (test_int8.py).

The files here are small GGUF files written by gguf's own writer with random blocks, and
float checkpoints holding what gguf's own reader dequantizes them to: the kernel's layout is
checked against gguf's decoding, its products against an integer reference computed here,
bit for bit, and whole models for width invariance, greedy identity and exact sampling.
"""

import json

import numpy as np
import pytest
import torch

from speculative import NGramProposer, SpeculativeConfig, SpeculativeDecoder, autoregressive_generate, load_model
from speculative.models.kernels import Int8Linear
from speculative.models.kquant import KQuantLinear, load_checkpoint_blocks, read_gguf_tensors
from speculative.models.native import checkpoint_reader, native_config
from speculative.models import isa
from tests.helpers import kernel_isas
from tests.test_int8 import WIDTHS, rows_alone, widths_agree
from tests.test_lossless import DRAWS, LENGTH, P_MIN, VOCAB, draw, exact_joint, g_test_pvalue

gguf = pytest.importorskip("gguf")

Q4_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16 = 12, 14, 2, 3, 6, 7, 8, 1
OFFSETS = {Q4_0: 8, Q5_0: 16, Q8_0: 128}  # w = d (u - o); Q4_1, Q5_1: w = d u + m
ISAS = ["auto", *isa.LEVELS[1:4], "plain"]


def random_blocks(rows: int, columns: int, kind: int, seed: int) -> np.ndarray:
    """Rows of random Q4_K or Q6_K blocks, (rows, row bytes) uint8, with sane scales."""
    rng = np.random.default_rng(seed)
    blocks = rows * columns // 256
    if kind == Q4_K:  # d, dmin (halves), 12 bytes of 6-bit scales and mins, 128 of nibbles
        raw = rng.integers(0, 256, (blocks, 144), dtype=np.uint8)
        d = rng.uniform(2e-4, 2e-3, blocks).astype(np.float16)
        raw[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        raw[:, 2:4] = (d * 7.5).astype(np.float16).view(np.uint8).reshape(-1, 2)  # centred weights
    else:  # 128 + 64 bytes of 6-bit quants, 16 int8 scales, d (half)
        raw = rng.integers(0, 256, (blocks, 210), dtype=np.uint8)
        raw[:, 192:208] = rng.integers(-40, 40, (blocks, 16)).astype(np.int8).view(np.uint8)
        raw[:, 208:210] = rng.uniform(1e-4, 1e-3, blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def gguf_blocks(rows: int, columns: int, kind: int, seed: int) -> np.ndarray:
    """Rows of 32-column blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) as gguf's quantizer writes them."""
    weights = np.random.default_rng(seed).normal(0, 0.05, (rows, columns)).astype(np.float32)
    return gguf.quants.quantize(weights, gguf.GGMLQuantizationType(kind))


def blocks_of(rows: int, columns: int, kind: int, seed: int) -> np.ndarray:
    return random_blocks(rows, columns, kind, seed) if kind in (Q4_K, Q6_K) else gguf_blocks(rows, columns, kind, seed)


def dequantize(raw: np.ndarray, kind: int, columns: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(kind))).reshape(len(raw), columns)


def unpack(packed: torch.Tensor, bits: int, rows: int):
    """(quants, sub-block scales, mins, d, dmin) per row from the kernel's layout (see
    csrc/kquant_matmul.cpp), each (rows, ...) in column order."""
    groups, blocks, _ = packed.shape
    subs = 8 if bits == 4 else 16
    chunks = packed[:, :, :2048].reshape(groups, blocks, 32, 16, 4)  # 8 columns each, the first 4 in low nibbles
    quants = torch.stack([chunks & 15, chunks >> 4], 4).permute(0, 3, 1, 2, 4, 5).reshape(groups * 16, -1)
    quant_bytes = 2048
    if bits == 6:  # per sub-block of 16 columns, each row's byte i: the high 2 bits of columns i, 4+i, 8+i, 12+i
        two = packed[:, :, 2048:3072].reshape(groups, blocks, 16, 16, 4)
        high = torch.stack([(two >> shift) & 3 for shift in (0, 2, 4, 6)], 4)  # (.., sub, row, 4 columns, 4 bytes)
        quants = quants | (high.permute(0, 3, 1, 2, 4, 5).reshape(groups * 16, -1) << 4)
        quant_bytes = 3072
    by_pairs = lambda at: packed[:, :, at:at + subs * 16].view(torch.int8).reshape(  # noqa: E731
        groups, blocks, subs // 2, 16, 2).permute(0, 3, 1, 2, 4).reshape(groups * 16, blocks * subs)[:rows]
    scales = by_pairs(quant_bytes)
    mins = by_pairs(quant_bytes + subs * 16) if bits == 4 else scales
    at = quant_bytes + subs * 16 * (2 if bits == 4 else 1)
    floats = packed[:, :, at:at + 128].contiguous().view(torch.float32).reshape(groups, blocks, 2, 16)
    d, dmin = (floats[:, :, i].permute(0, 2, 1).reshape(groups * 16, blocks)[:rows] for i in (0, 1))
    return quants[:rows].long(), scales.long(), mins.long(), d, dmin


def unpack32(packed: torch.Tensor, kind: int, rows: int):
    """(unsigned quants, d, m or None) per row from q32_matmul.cpp's layout, each (rows, ...) in
    column order."""
    groups, blocks, _ = packed.shape
    if kind == Q8_0:  # 8 chunks of 4 columns
        quants = packed[:, :, :512].reshape(groups, blocks, 8, 16, 4).permute(0, 3, 1, 2, 4)
        at = 512
    else:  # 4 chunks of 8 columns (low nibbles the first 4), then for 5 bits each row's 4 bytes of fifth bits
        nibbles = packed[:, :, :256].reshape(groups, blocks, 4, 16, 4)
        quants = torch.stack([nibbles & 15, nibbles >> 4], 4)  # (.., chunk, row, half, 4 columns)
        at = 256
        if kind in (Q5_0, Q5_1):
            fifth = packed[:, :, 256:320].reshape(groups, blocks, 1, 16, 1, 4)
            shifts = (2 * torch.arange(4).view(1, 1, 4, 1, 1, 1) + torch.arange(2).view(1, 1, 1, 1, 2, 1)).to(torch.uint8)
            quants = quants | (((fifth >> shifts) & 1) << 4)
            at = 320
        quants = quants.permute(0, 3, 1, 2, 4, 5)
    halves = lambda at: packed[:, :, at:at + 32].contiguous().view(torch.float16).reshape(  # noqa: E731
        groups, blocks, 16).permute(0, 2, 1).reshape(groups * 16, blocks)[:rows].float()
    m = halves(at + 32) if kind in (Q4_1, Q5_1) else None
    return quants.reshape(groups * 16, -1)[:rows].long(), halves(at), m


def reference(x: torch.Tensor, packed: torch.Tensor, kind: int, rows: int) -> torch.Tensor:
    """The kernel's product computed here: activations to int8 per 256 columns (32 for the
    32-column types), exact integer sums per sub-block, then the kernel's float operations in its order."""
    if kind not in (Q4_K, Q6_K):
        return reference32(x, packed, kind, rows)
    bits = 4 if kind == Q4_K else 6
    quants, scales, mins, d, dmin = unpack(packed, bits, rows)
    width, columns = x.shape
    blocks, sub = columns // 256, 32 if bits == 4 else 16
    chunks = x.reshape(width, blocks, 256)
    peak = chunks.abs().amax(-1, keepdim=True)
    inverse = torch.full_like(peak, 127.0) / peak  # a true division, as the kernel's (127 / t is 127 * t.reciprocal())
    xq = torch.round(chunks * inverse).clamp(-127, 127).long().reshape(width, blocks, -1, sub)
    dots = torch.einsum("mbjs,nbjs->mnbj", xq, quants.reshape(rows, blocks, -1, sub))
    isum = (dots * scales.reshape(rows, blocks, -1)).sum(-1)
    msum = (xq.sum(-1)[:, None] * mins.reshape(rows, blocks, -1)).sum(-1)
    part = d * isum.float() - dmin * msum.float()
    out = torch.zeros(width, rows)
    for block in range(blocks):
        out = out + (peak[:, block] / 127) * part[:, :, block]
    return out


def reference32(x: torch.Tensor, packed: torch.Tensor, kind: int, rows: int) -> torch.Tensor:
    quants, d, m = unpack32(packed, kind, rows)
    width, columns = x.shape
    blocks = columns // 32
    chunks = x.reshape(width, blocks, 32)
    peak = chunks.abs().amax(-1, keepdim=True)
    inverse = torch.full_like(peak, 127.0) / peak
    xq = torch.round(chunks * inverse).clamp(-127, 127).long()
    dots = torch.einsum("mbs,nbs->mnb", xq, quants.reshape(rows, blocks, 32))
    xs, xsum = peak[:, None, :, 0] / 127, xq.sum(-1)[:, None]  # (width, 1, blocks)
    out = torch.zeros(width, rows)
    for block in range(blocks):
        if m is None:  # xs * d * (dot - o * sum(x))
            isum = dots[:, :, block] - OFFSETS[kind] * xsum[:, :, block]
            out = out + (xs[:, :, block] * d[None, :, block]) * isum.float()
        else:  # xs * (d * dot + m * sum(x))
            part = d[None, :, block] * dots[:, :, block].float() + m[None, :, block] * xsum[:, :, block].float()
            out = out + xs[:, :, block] * part
    return out


@pytest.mark.parametrize("kind", [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0])
def test_packed_32_column_blocks_hold_what_gguf_decodes(ops, kind):
    raw = gguf_blocks(40, 896, kind, seed=kind)
    packed = ops.q32_pack(torch.from_numpy(raw), kind, 896)
    quants, d, m = unpack32(packed, kind, 40)
    per_column = lambda t: t.repeat_interleave(32, 1)  # noqa: E731
    if m is None:
        weights = per_column(d) * (quants - OFFSETS[kind]).float()
    else:
        weights = per_column(d) * quants.float() + per_column(m)
    assert torch.equal(weights, dequantize(raw, kind, 896))


@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_packed_blocks_hold_what_gguf_decodes(ops, kind):
    raw = random_blocks(40, 512, kind, seed=kind)
    packed = ops.kquant_pack(torch.from_numpy(raw), kind, 512)
    quants, scales, mins, d, dmin = unpack(packed, 4 if kind == Q4_K else 6, 40)
    sub = 32 if kind == Q4_K else 16
    per_sub = lambda t: t.double().repeat_interleave(256 // sub, 1)  # noqa: E731
    weights = (per_sub(d) * scales.double()).repeat_interleave(sub, 1) * quants.double() \
        - (per_sub(dmin) * mins.double()).repeat_interleave(sub, 1)
    assert torch.equal(weights.float(), dequantize(raw, kind, 512))


@pytest.mark.parametrize("level", ISAS)
@pytest.mark.parametrize("kinds, rows, columns", [([Q4_K], 48, 768), ([Q6_K], 40, 768), ([Q4_K, Q6_K], 37, 768),
                                                   ([Q5_0], 48, 896), ([Q8_0], 40, 896), ([Q5_0, Q8_0], 37, 896),
                                                   ([Q4_0], 48, 896), ([Q4_1, Q5_1], 37, 896)])
def test_a_kquant_layer_gives_each_row_the_bits_it_gets_alone(ops, level, kinds, rows, columns):
    if level not in kernel_isas():
        pytest.skip(f"this CPU does not run {level}")
    parts = [(blocks_of(rows, columns, kind, seed=rows + kind), kind) for kind in kinds]
    layer = KQuantLinear(parts, columns, torch.randn(rows * len(kinds)))
    layer.isa = level
    x = torch.randn(17, columns) * torch.rand(17, 1) * 10
    x[:, 5] *= 30  # an outlier channel
    x[3] = 0  # a row of zeros
    alone = rows_alone(layer, x)
    for width in WIDTHS:
        assert torch.equal(layer(x[:width]), alone[:width]), width
    assert torch.equal(layer(x.view(1, 17, -1))[0], alone)
    expected = torch.cat([reference(x, packed, kind, n) for packed, kind, n in layer.runs], 1) + layer.bias
    assert torch.equal(alone, expected)  # the kernel computes what its comment says, to the bit
    weights = torch.cat([dequantize(raw, kind, columns) for raw, kind in parts])
    plain = torch.randn(17, columns)  # without the outlier: int8 activations per 256 (or 32) columns lose little
    exact = plain @ weights.T + layer.bias
    assert (layer(plain) - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("kinds", [(Q4_K, Q6_K), (Q5_0, Q8_0), (Q4_0, Q4_1), (Q5_1, Q4_0)])
def test_every_instruction_set_gives_the_same_bits(ops, kinds):
    parts = [(blocks_of(64, 1024, kinds[0], 1), kinds[0]), (blocks_of(32, 1024, kinds[1], 2), kinds[1])]
    layer = KQuantLinear(parts, 1024)
    x = torch.randn(9, 1024)
    outputs = []
    for level in kernel_isas():
        layer.isa = level
        outputs.append(layer(x))
    assert all(torch.equal(outputs[0], out) for out in outputs[1:])


@pytest.mark.parametrize("kind, block", [(Q4_K, 256), (Q5_0, 32)])
def test_activations_quantize_alike_on_every_instruction_set_at_the_edges(ops, kind, block):
    """Ties round to even, a NaN element neither raises the peak nor spreads (it becomes -127),
    an infinite element makes its row NaN, zeros stay zeros: the vector quantizers (csrc/quantize.h)
    keep the scalar semantics, compared here bit for bit with the plain C++ path and the reference."""
    parts = [(blocks_of(32, 512, kind, 3), kind)]
    layer = KQuantLinear(parts, 512)
    x = torch.randn(5, 512)
    x[0, :256] = torch.arange(256) % 9 - 4.5  # peak 127 below: every element a tie at scale 1
    x[0, 7] = 127.0
    x[1, 300] = float("nan")
    x[2, 10] = float("inf")
    x[3] = 0
    outputs = {}
    for level in kernel_isas():
        layer.isa = level
        outputs[level] = layer(x)
    plain = outputs["plain"]
    for level, out in outputs.items():
        assert torch.equal(out.nan_to_num(7.0), plain.nan_to_num(7.0)), level
    assert plain[2].isnan().all() and not plain[[0, 1, 3, 4]].isnan().any()
    assert torch.equal(plain[[0, 3, 4]], reference(x[[0, 3, 4]], *layer.runs[0]))
    as_peak = x[[1]].nan_to_num(0.0)
    start = 300 // block * block
    as_peak[0, 300] = -as_peak[0, start:start + block].abs().max()  # what the NaN counts as: -127 at its block's peak
    assert torch.equal(plain[1], layer(as_peak)[0])


def test_bad_packing_input_is_refused_with_what_is_allowed(ops):
    raw = torch.from_numpy(random_blocks(4, 256, Q4_K, 3))
    with pytest.raises(RuntimeError, match="not Q4_K"):
        ops.kquant_pack(raw, Q8_0, 256)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops.kquant_pack(raw, Q4_K, 100)
    with pytest.raises(RuntimeError, match="bytes per row"):
        ops.kquant_pack(raw, Q4_K, 512)
    layer = KQuantLinear([(raw.numpy(), Q4_K)], 256)
    with pytest.raises(RuntimeError, match="columns"):
        layer(torch.randn(2, 512))
    raw = torch.from_numpy(gguf_blocks(4, 96, Q5_0, 3))
    with pytest.raises(RuntimeError, match=r"type 12 is not Q4_0 \(2\), Q4_1 \(3\), Q5_0 \(6\), Q5_1 \(7\) or Q8_0"):
        ops.q32_pack(raw, Q4_K, 96)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.q32_pack(raw, Q5_0, 100)
    with pytest.raises(RuntimeError, match="bytes per row"):
        ops.q32_pack(raw, Q8_0, 96)
    with pytest.raises(RuntimeError, match="columns"):
        KQuantLinear([(raw.numpy(), Q5_0)], 96)(torch.randn(2, 128))
    packed = ops.q32_pack(raw, Q5_0, 96)
    with pytest.raises(RuntimeError, match="do not match"):  # Q5_0's blocks read as Q4_1's
        ops.q32_linear(torch.randn(2, 96), packed, Q4_1, None, 4, "auto")


HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, LAYERS = 256, 4, 2, 512, 2


def write_model(root, vocab: int, seed: int, int8_layer: bool = False, q32: bool = False):
    """A Qwen2 checkpoint and the GGUF file it is "made from": random k-quant blocks (Q4_K_M's
    mix: some value and down projections and the output layer in Q6_K), the checkpoint holding
    their dequantized floats. `int8_layer`: layer 0's query in float16, which no kernel runs.
    `q32`: what Q4_K_M makes of rows that are no multiple of 256 columns (Qwen2.5-Coder 0.5B's):
    Q5_0 for Q4_K, Q8_0 for Q6_K, but the down projections."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    head_dim = HIDDEN // HEADS
    shapes = {"attn_q": (HEADS * head_dim, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HEADS * head_dim),
              "ffn_gate": (INTERMEDIATE, HIDDEN), "ffn_up": (INTERMEDIATE, HIDDEN), "ffn_down": (HIDDEN, INTERMEDIATE)}
    ours = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}
    writer = gguf.GGUFWriter(str(root / "model.gguf"), "qwen2")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)])  # string arrays to skip
    tensors = {"model.embed_tokens.weight": torch.randn(vocab, HIDDEN), "model.norm.weight": 1 + torch.rand(HIDDEN)}

    def add(name, ours_name, rows, columns, kind, seed):
        if kind == F16:  # a type no kernel runs
            raw = (torch.randn(rows, columns) * 0.05).numpy().astype(np.float16)
        else:
            raw = blocks_of(rows, columns, kind, seed)
        floats = dequantize(raw, kind, columns)
        # (blocks: their shape is in bytes per row)
        writer.add_tensor(name, raw, raw_dtype=None if kind == F16 else gguf.GGMLQuantizationType(kind))
        tensors[ours_name] = floats

    for layer in range(LAYERS):
        for index, (part, (rows, columns)) in enumerate(shapes.items()):
            six = part in ("attn_v", "ffn_down") and layer % 2 == 0
            kind = F16 if int8_layer and (layer, part) == (0, "attn_q") else Q6_K if six else Q4_K
            if q32 and part != "ffn_down":
                kind = {Q4_K: Q5_0, Q6_K: Q8_0}.get(kind, kind)
            add(f"blk.{layer}.{part}.weight", f"model.layers.{layer}.{ours[part]}.weight", rows, columns, kind,
                seed * 100 + layer * 10 + index)
        for part in ("q_proj", "k_proj", "v_proj"):
            rows = shapes["attn_" + part[0]][0]
            tensors[f"model.layers.{layer}.self_attn.{part}.bias"] = torch.randn(rows) * 0.1
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{layer}.{norm}.weight"] = 1 + torch.rand(HIDDEN) * 0.1
    add("output.weight", "lm_head.weight", vocab, HIDDEN, Q8_0 if q32 else Q6_K, seed * 100 + 99)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(root / "model.safetensors"))
    config = {"model_type": "qwen2", "vocab_size": vocab, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "intermediate_size": INTERMEDIATE,
              "max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "hidden_act": "silu"}
    (root / "config.json").write_text(json.dumps(config))
    return root


def load(root):
    cfg = native_config(json.loads((root / "config.json").read_text()))
    return load_checkpoint_blocks(root, cfg, root / "model.gguf", checkpoint_reader(root, cfg))


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory, ops):
    return load(write_model(tmp_path_factory.mktemp("kquant"), vocab=96, seed=1))


def test_our_gguf_index_reads_what_gguf_reads(kquant_model, tmp_path_factory):
    root = write_model(tmp_path_factory.mktemp("index"), vocab=40, seed=2)
    ours = read_gguf_tensors(root / "model.gguf")
    theirs = gguf.GGUFReader(str(root / "model.gguf")).tensors
    assert sorted(ours) == sorted(tensor.name for tensor in theirs)
    for tensor in theirs:
        mine = ours[tensor.name]
        assert (mine.tensor_type, mine.shape) == (int(tensor.tensor_type), tuple(int(n) for n in tensor.shape))
        assert np.array_equal(mine.data, np.asarray(tensor.data).reshape(mine.data.shape))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_tensors(root / "config.json")


def test_a_kquant_model_computes_its_checkpoint_and_is_width_invariant(kquant_model, tmp_path_factory):
    assert all(isinstance(module, KQuantLinear) for name, module in kquant_model.named_modules()
               if name.endswith(("_proj", "lm_head")))
    assert kquant_model.layers[0].self_attn.compiled is not None  # norms and attention compiled too
    root = write_model(tmp_path_factory.mktemp("float"), vocab=96, seed=1)
    reference = load_model(root, dtype="float32")
    for name, layer in kquant_model.named_modules():  # each layer on the weights its checkpoint holds
        if isinstance(layer, KQuantLinear):
            x = torch.randn(5, layer.in_features)
            exact = reference.get_submodule(name)(x)
            assert ((layer(x) - exact).norm() / exact.norm()) < 0.02, name
    assert widths_agree(kquant_model)


def test_layers_of_other_types_run_in_int8(tmp_path, ops):
    model = load(write_model(tmp_path, vocab=64, seed=3, int8_layer=True))
    assert isinstance(model.layers[0].self_attn.qkv_proj, Int8Linear)
    assert isinstance(model.layers[1].self_attn.qkv_proj, KQuantLinear)
    assert widths_agree(model)


def test_a_draft_on_32_column_blocks_is_width_invariant_and_never_changes_the_output(kquant_model, tmp_path, ops):
    """A draft stored as Qwen2.5-Coder 0.5B's file is (Q5_0 and Q8_0 but the down projections)
    runs on its blocks, computes its checkpoint, gives every width the same bits, gives a reduced
    vocabulary the rows of its output layer as stored, and drafts for a k-quant target whose
    greedy output stays its own."""
    root = write_model(tmp_path / "q32", vocab=96, seed=5, q32=True)
    draft = load(root)
    kinds = {layer.extra_repr().rpartition(", ")[2] for layer in draft.modules() if isinstance(layer, KQuantLinear)}
    assert kinds == {"Q5_0", "Q5_0+Q8_0", "Q8_0", "Q4_K", "Q6_K"}
    reference = load_model(root, dtype="float32")
    for name, layer in draft.named_modules():
        if isinstance(layer, KQuantLinear):
            x = torch.randn(5, layer.in_features)
            exact = reference.get_submodule(name)(x)
            assert ((layer(x) - exact).norm() / exact.norm()) < 0.02, name
    assert widths_agree(draft)
    ids = torch.tensor([5, 0, 77, 31, 95])
    hidden = torch.randn(3, HIDDEN)
    assert torch.equal(draft.output_head(ids)(hidden), draft.lm_head(hidden)[:, ids])
    for vocab in (None, torch.arange(0, 96, 2)):
        decoder = SpeculativeDecoder(kquant_model, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=4),
                                     draft_vocab=vocab)
        for prompt in ([1, 2, 3], list(range(10, 40)) * 2):
            assert decoder.generate(prompt, 30) == autoregressive_generate(kquant_model, prompt, 30)


@pytest.mark.parametrize("level", isa.LEVELS[:4])
def test_every_instruction_set_runs_whole_models_width_invariant_and_exact(kquant_model, level, tmp_path):
    """Under each ceiling this CPU runs (SPECULATIVE_ISA, models/isa.py), every compiled op of a
    forward takes that level's code: a k-quant target and a draft on 32-column blocks give every
    width the same bits, the same bits as at the CPU's best level, and greedy speculation
    reproduces plain decoding."""
    if level not in isa.runnable():
        pytest.skip(f"this CPU does not run {level}")
    draft = load(write_model(tmp_path / "q32", vocab=96, seed=5, q32=True))
    prompt = torch.tensor([list(range(10, 40))])
    with torch.inference_mode():
        best = [model.forward(prompt, model.new_state(1, 64)) for model in (kquant_model, draft)]
        with isa.forced(level):
            assert torch.ops.speculative_kernels.isa() == level
            assert widths_agree(kquant_model) and widths_agree(draft)
            for model, logits in zip((kquant_model, draft), best):
                assert torch.equal(model.forward(prompt, model.new_state(1, 64)), logits)
            decoder = SpeculativeDecoder(kquant_model, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=4))
            for start in ([1, 2, 3], list(range(10, 40)) * 2):
                assert decoder.generate(start, 24) == autoregressive_generate(kquant_model, start, 24)
    assert torch.ops.speculative_kernels.isa() == isa.ceiling()  # restored after the block


@pytest.mark.parametrize("draft_kind", ["ngram", "self", "float draft"])
def test_greedy_speculation_on_a_kquant_target_is_its_own_greedy_decoding(kquant_model, draft_kind,
                                                                           tmp_path_factory):
    draft = {"ngram": lambda: NGramProposer(max_ngram=3), "self": lambda: kquant_model,
             "float draft": lambda: load_model(write_model(tmp_path_factory.mktemp("draft"), 96, 1), "cpu",
                                               "float32")}[draft_kind]()
    decoder = SpeculativeDecoder(kquant_model, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=5,
                                                                        prompt_lookup=False))
    prompts = [[1, 2, 3], list(range(10, 40)) * 2, [7] * 5]
    for prompt in prompts:
        assert decoder.generate(prompt, 40) == autoregressive_generate(kquant_model, prompt, 40)
    assert decoder.generate(prompts, 24) == [autoregressive_generate(kquant_model, p, 24) for p in prompts]
    if draft_kind == "self":
        assert decoder.acceptance_rate() == 1.0


def test_auto_runs_a_model_made_from_a_gguf_on_its_blocks_only_where_int8_would_run(tmp_path, ops, monkeypatch):
    """auto takes the GGUF's own blocks for a model made from one (a preset; here the file
    the test model is made from) on a CPU where it would pick int8, and not elsewhere."""
    from speculative.models import kquant, precision, presets

    root = write_model(tmp_path, vocab=64, seed=4, int8_layer=True)
    layer_weights = {part: rows * HIDDEN for part, rows in (("q", HIDDEN), ("k", HIDDEN // HEADS * KV_HEADS),
                                                            ("v", HIDDEN // HEADS * KV_HEADS), ("o", HIDDEN))}
    total = LAYERS * (sum(layer_weights.values()) + 3 * INTERMEDIATE * HIDDEN)
    assert kquant.kquant_share(root / "model.gguf") == pytest.approx(1 - layer_weights["q"] / total)
    share_of = kquant.kquant_share
    monkeypatch.setattr(presets, "source_gguf", lambda path: root / "model.gguf" if path == root else None)
    monkeypatch.setattr(precision, "INT8_MIN_WEIGHTS", 0)  # the test model is tiny
    monkeypatch.setattr(kquant, "int8_on_tiles", lambda: False)  # a CPU without AMX
    for vnni, share, blocks in ((True, None, True), (False, None, False), (True, 0.4, False)):
        monkeypatch.setattr(precision, "int8_runs_fast", lambda features=None, vnni=vnni: vnni)
        if share is not None:  # a file with less than half its layers' weights in Q4_K or Q6_K
            monkeypatch.setattr(kquant, "kquant_share", lambda gguf, kinds=None, share=share: share)
        model = load_model(root, dtype="auto")
        assert isinstance(model.layers[1].mlp.down_proj, KQuantLinear) == blocks, (vnni, share)
        if vnni and not blocks:
            assert isinstance(model.layers[1].mlp.down_proj, Int8Linear)  # int8, as before
    monkeypatch.setattr(precision, "int8_runs_fast", lambda features=None: True)
    monkeypatch.setattr(kquant, "kquant_share", share_of)
    assert isinstance(load_model(root, dtype="auto").layers[1].mlp.down_proj, KQuantLinear)
    trainable = load_model(root, dtype="auto", pack=False)  # to save, export or train with: never the blocks
    assert isinstance(trainable.layers[1].mlp.down_proj, Int8Linear)
    monkeypatch.setattr(kquant, "int8_on_tiles", lambda: True)  # int8 on AMX tiles: a target takes int8
    assert isinstance(load_model(root, dtype="auto").layers[1].mlp.down_proj, Int8Linear)


def test_auto_runs_a_draft_on_its_32_column_blocks_where_a_target_would_take_int8(tmp_path, ops, monkeypatch):
    """A file mostly in Q5_0 and Q8_0 (the 0.5B draft's): auto runs it on its blocks as a draft,
    whose forward is bound by the bytes it reads, on a CPU where it would pick int8; a target
    needs half of its weights in k-quants."""
    from speculative.models import kquant, loading, precision, presets

    root = write_model(tmp_path, vocab=64, seed=4, q32=True)
    monkeypatch.setattr(kquant, "int8_on_tiles", lambda: True)  # on AMX too, a draft keeps its blocks
    monkeypatch.setattr(presets, "source_gguf", lambda path: root / "model.gguf" if path == root else None)
    monkeypatch.setattr(precision, "INT8_MIN_WEIGHTS", 0)  # the test model is tiny
    monkeypatch.setattr(loading, "SMALL_MODEL", 0)
    for vnni in (True, False):
        monkeypatch.setattr(precision, "int8_runs_fast", lambda features=None, vnni=vnni: vnni)
        layer = loading.load_draft(root).layers[1].self_attn.qkv_proj
        assert isinstance(layer, KQuantLinear if vnni else Int8Linear), vnni
    monkeypatch.setattr(precision, "int8_runs_fast", lambda features=None: True)
    assert isinstance(load_model(root, dtype="auto").layers[1].self_attn.qkv_proj, Int8Linear)


def test_dtype_gguf_names_what_it_needs(tmp_path):
    from tests.helpers import tiny
    from speculative import save_model

    save_model(tiny("decoder_only", seed=5), tmp_path / "m")
    with pytest.raises(ValueError, match="made from a GGUF file by a preset"):
        load_model(tmp_path / "m", dtype="gguf")


@pytest.mark.slow
def test_sampling_from_a_kquant_target_follows_its_own_distribution(tmp_path, ops):
    """G-test against the k-quant model's exact distribution (from wide forwards: exact because
    it is width-invariant); negative control: the same model at temperature 1.3."""
    target = load(write_model(tmp_path / "target", vocab=VOCAB, seed=7))
    draft = load_model(write_model(tmp_path / "draft", vocab=VOCAB, seed=8), dtype="float32")
    config = SpeculativeConfig(adaptive=False, greedy_verification=False, num_draft_tokens=3, seed=0)
    decoder = SpeculativeDecoder(target, draft, config)
    counts = draw(decoder, chunk=1_000)  # a cache of 512 key slots per row: 5000 rows would hold 11 GB
    assert 0 < decoder.acceptance_rate() < 1
    assert g_test_pvalue(counts, exact_joint(target, config)) > P_MIN
    warmer = SpeculativeConfig(adaptive=False, greedy_verification=False, target_temperature=1.3)
    assert g_test_pvalue(counts, exact_joint(target, warmer)) < P_MIN
    assert counts.sum() == DRAWS and LENGTH == 3
