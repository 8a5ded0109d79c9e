"""Whether cuDNN attention's private forward/backward can run attention tiles: shapes of what it
returns, GQA, and a 2-block tiled result (merged log-sum-exp) against whole-segment SDPA."""
import torch
import torch.nn.functional as F

aten = torch.ops.aten
print(aten._scaled_dot_product_cudnn_attention.default._schema)
print(aten._scaled_dot_product_cudnn_attention_backward.default._schema)
L, H, KV, D = 512, 8, 2, 128
q = torch.randn(1, L, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
k = torch.randn(1, L, KV, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
v = torch.randn(1, L, KV, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
do = torch.randn(1, L, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
for kk, vv, name in ((k, v, "gqa"), (k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), "expanded")):
    try:
        r = aten._scaled_dot_product_cudnn_attention(q, kk, vv, None, True, 0.0, True, False, scale=D ** -0.5)
        print(name, [(tuple(t.shape), t.dtype, t.stride()) if isinstance(t, torch.Tensor) else t for t in r])
        out, lse = r[0], r[1]
        ref = F.scaled_dot_product_attention(q.float(), kk.float(), vv.float(), is_causal=True, enable_gqa=True)
        print(name, "fwd err", (out.float() - ref).abs().max().item())
        g = aten._scaled_dot_product_cudnn_attention_backward(do, q, kk, vv, out, lse, r[6], r[7], None, r[2], r[3], r[4], r[5], 0.0, True, scale=D ** -0.5)
        print(name, "bwd shapes", [tuple(t.shape) for t in g])
    except Exception as e:
        print(name, "failed:", type(e).__name__, str(e).splitlines()[0][:200])
