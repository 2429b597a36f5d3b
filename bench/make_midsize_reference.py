"""A Qwen3.5-MoE reference large enough that recur's GPU prompts take the tensor-core paths (the
dense matmuls' term GEMMs and the experts' tiles, not the GEMV kernels the tiny references take),
made the way the shared references are: the project's make_reference.py (its helpers, run here
without its own jobs), random bf16 weights in the published layout, logits from transformers'
modules in float64. Used to report each prompt-activation form's error (recur verify --report).
Usage: python3 make_midsize_reference.py PATH/TO/make_reference.py OUTDIR
"""
import sys

script, out = sys.argv[1], sys.argv[2]
source = open(script).read()
source = source[:source.index("\nJOBS = [")]  # its helpers and configurations, not its jobs
sys.argv = [script, out]
namespace = {"__name__": "make_reference"}
exec(compile(source, script, "exec"), namespace)

# 4 layers (the fourth full attention), hidden 1024, 32 experts of 256 (top 8) and a shared one:
# a 600-token prompt's projections exceed the GEMV kernel's token groups and ~150 rows reach
# each expert.
text = dict(namespace["QWEN35_MOE_TINY"])
text.update(hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            head_dim=128, linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=128,
            linear_value_head_dim=128, num_experts=32, num_experts_per_tok=8,
            moe_intermediate_size=256, shared_expert_intermediate_size=512, vocab_size=2048,
            layer_types=namespace["lt"](4, {3}),
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25, "mrope_section": [6, 5, 5],
                             "mrope_interleaved": True})
namespace["qwen35"]("qwen3_5-moe-mid", text, True, False, [600, 300], 4, 31, bf16=True,
                    fused_experts=True)
