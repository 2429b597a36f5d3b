"""Kimi-Linear references of shapes no other test uses (models/kimi-linear-var, -bf16 and their
tests/data/golden entries), made with the shared float64 generator on a machine with torch and
transformers >= 5.17:  python3 scripts/make_kimi_references.py OUTDIR PATH/TO/make_reference.py
"""
import runpy, sys
out, generator = sys.argv[1], sys.argv[2]
sys.argv = ["make_reference.py", out, "--only", "__none__"]  # load its functions, run no job
ns = runpy.run_path(generator)
base = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, model_max_length=4096,
            rope_theta=10000.0, rope_scaling=None, mla_use_nope=True, moe_router_activation_func="sigmoid",
            hidden_act="silu", tie_word_embeddings=False, num_nextn_predict_layers=0, moe_layer_freq=1,
            q_lora_rank=None)
# odd head counts, conv width 3, two dense layers, grouped top-k over 2 groups, two shared experts,
# v_head_dim unlike the key dims
var = dict(base, hidden_size=96, num_hidden_layers=7, intermediate_size=160, moe_intermediate_size=40,
           num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=24,
           v_head_dim=20, num_experts=6, num_experts_per_token=2, num_shared_experts=2, vocab_size=320,
           first_k_dense_replace=2, routed_scaling_factor=1.5, use_grouped_topk=True, num_expert_group=2,
           topk_group=1, moe_renormalize=True,
           linear_attn_config={"head_dim": 32, "num_heads": 3, "short_conv_kernel_size": 3,
                               "full_attn_layers": [3, 7], "kda_layers": [1, 2, 4, 5, 6]})
# bf16 weights, five heads of KDA, wider latent, no renormalisation, plain top-k
bf = dict(base, hidden_size=80, num_hidden_layers=5, intermediate_size=96, moe_intermediate_size=24,
          num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
          v_head_dim=16, num_experts=8, num_experts_per_token=3, num_shared_experts=1, vocab_size=256,
          first_k_dense_replace=1, routed_scaling_factor=2.446, use_grouped_topk=False, num_expert_group=1,
          topk_group=1, moe_renormalize=False,
          linear_attn_config={"head_dim": 16, "num_heads": 5, "short_conv_kernel_size": 4,
                              "full_attn_layers": [3], "kda_layers": [1, 2, 4, 5]})
for name, pub, lengths, gen, seed, b in [("kimi-linear-var", var, [1, 17, 65], 16, 31, False),
                                         ("kimi-linear-bf16", bf, [1, 9, 70], 16, 32, True)]:
    try:
        ns["kimi"](name, pub, lengths, gen, seed, bf16=b)
    except Exception as e:
        import traceback
        print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc(limit=8)
