"""models/kimi-seed-48L: a tiny random Kimi-Linear of the original report's depth (48 layers: 36
Kimi Delta Attention, 12 latent attention, every fourth), in the published remote-code layout
(linear_attn_config with 1-based kda_layers / full_attn_layers, block_sparse_moe.*), for the
engine's long-decode test. Standard library only; the same seed writes the same bytes.
    python3 scripts/make_kimi_seed.py models/kimi-seed-48L
"""
import array, json, math, os, random, struct, sys

LAYERS, HIDDEN, VOCAB = 48, 32, 256
KDA_HEADS, KDA_DIM, CONV = 2, 16, 4
HEADS, RANK, NOPE, ROPE, VDIM = 2, 16, 16, 8, 16
EXPERTS, TOP_K, MOE_FF, FF = 4, 2, 16, 64

config = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": FF,
    "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
    "tie_word_embeddings": False, "model_max_length": 32768, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 0, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "moe_intermediate_size": MOE_FF, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "num_experts": EXPERTS,
    "num_experts_per_token": TOP_K, "num_shared_experts": 1, "routed_scaling_factor": 2.446,
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "q_lora_rank": None,
    "kv_lora_rank": RANK, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE,
    "v_head_dim": VDIM, "mla_use_nope": True, "num_nextn_predict_layers": 0,
    "linear_attn_config": {
        "full_attn_layers": [i for i in range(1, LAYERS + 1) if i % 4 == 0],
        "kda_layers": [i for i in range(1, LAYERS + 1) if i % 4 != 0],
        "head_dim": KDA_DIM, "num_heads": KDA_HEADS, "short_conv_kernel_size": CONV},
    "torch_dtype": "float32", "transformers_version": "5.17.0",
}

rng = random.Random(48)
tensors = {}  # name -> (shape, values)


def uniform(name, shape, lo, hi):
    n = math.prod(shape)
    tensors[name] = (shape, [rng.uniform(lo, hi) for _ in range(n)])


def matrix(name, shape, out_proj=False):
    a = math.sqrt(3.0 / shape[-1])  # unit-variance outputs for unit-variance inputs
    if out_proj:  # into the residual stream: small enough that 48 layers stay finite
        a /= math.sqrt(2.0 * LAYERS)
    uniform(name, shape, -a, a)


def norm(name, size):
    uniform(name, [size], 0.9, 1.1)


def swiglu(p, ff):
    matrix(p + "gate_proj.weight", [ff, HIDDEN])
    matrix(p + "up_proj.weight", [ff, HIDDEN])
    matrix(p + "down_proj.weight", [HIDDEN, ff], out_proj=True)


uniform("model.embed_tokens.weight", [VOCAB, HIDDEN], -1.7, 1.7)
norm("model.norm.weight", HIDDEN)
matrix("lm_head.weight", [VOCAB, HIDDEN])
D = KDA_HEADS * KDA_DIM
for i in range(LAYERS):
    p = f"model.layers.{i}."
    norm(p + "input_layernorm.weight", HIDDEN)
    norm(p + "post_attention_layernorm.weight", HIDDEN)
    a = p + "self_attn."
    if (i + 1) % 4 != 0:  # Kimi Delta Attention
        for x in "qkv":
            matrix(a + f"{x}_proj.weight", [D, HIDDEN])
            matrix(a + f"{x}_conv1d.weight", [D, 1, CONV])
        matrix(a + "b_proj.weight", [KDA_HEADS, HIDDEN])
        matrix(a + "f_a_proj.weight", [KDA_DIM, HIDDEN])
        matrix(a + "f_b_proj.weight", [D, KDA_DIM])
        matrix(a + "g_a_proj.weight", [KDA_DIM, HIDDEN])
        matrix(a + "g_b_proj.weight", [D, KDA_DIM])
        matrix(a + "o_proj.weight", [HIDDEN, D], out_proj=True)
        uniform(a + "A_log", [1, 1, KDA_HEADS, 1], 0.0, 2.77)
        uniform(a + "dt_bias", [D], 0.5, 1.5)
        norm(a + "o_norm.weight", KDA_DIM)
    else:  # latent attention
        matrix(a + "q_proj.weight", [HEADS * (NOPE + ROPE), HIDDEN])
        matrix(a + "kv_a_proj_with_mqa.weight", [RANK + ROPE, HIDDEN])
        norm(a + "kv_a_layernorm.weight", RANK)
        matrix(a + "kv_b_proj.weight", [HEADS * (NOPE + VDIM), RANK])
        matrix(a + "o_proj.weight", [HIDDEN, HEADS * VDIM], out_proj=True)
    if i < config["first_k_dense_replace"]:
        swiglu(p + "mlp.", FF)
    else:
        m = p + "block_sparse_moe."
        matrix(m + "gate.weight", [EXPERTS, HIDDEN])
        uniform(m + "gate.e_score_correction_bias", [EXPERTS], -0.1, 0.1)
        for e in range(EXPERTS):
            x = m + f"experts.{e}."
            matrix(x + "w1.weight", [MOE_FF, HIDDEN])
            matrix(x + "w3.weight", [MOE_FF, HIDDEN])
            matrix(x + "w2.weight", [HIDDEN, MOE_FF], out_proj=True)
        swiglu(m + "shared_experts.", MOE_FF)

# safetensors: an 8-byte little-endian header size, the JSON header, then the data (f32).
header, offset = {"__metadata__": {"format": "pt"}}, 0
for name in sorted(tensors):
    shape, values = tensors[name]
    header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + 4 * len(values)]}
    offset += 4 * len(values)
head = json.dumps(header, separators=(",", ":")).encode()
head += b" " * (-len(head) % 8)
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(head)))
    f.write(head)
    for name in sorted(tensors):
        data = array.array("f", tensors[name][1])
        if sys.byteorder != "little":
            data.byteswap()
        f.write(data.tobytes())
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
    f.write("\n")
with open(os.path.join(out, "generation_config.json"), "w") as f:
    json.dump({"bos_token_id": 1, "eos_token_id": 2, "transformers_version": "5.17.0"}, f, indent=2)
    f.write("\n")
print(f"{out}: {len(tensors)} tensors, {offset / 1e6:.2f} MB")
