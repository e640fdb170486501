"""One layer's attention, forward and backward, on two packed rows of 330 slots (a 24-token
prefix and four 77-slot sequences, block-causal mask): SDPA in bf16, in fp32, through an fp32
cast (the recipe's), causal without a mask, and a math path (bf16 products, fp32 softmax),
eager and compiled. torch's threads, median of 20 calls.

    OMP_NUM_THREADS=2 python benchmarks/bounds/attention_variants.py
"""
import torch, time, torch.nn.functional as F
def t(fn, n=20):
    for _ in range(3): fn()
    ts=[]
    for _ in range(n):
        s=time.perf_counter(); fn(); ts.append(time.perf_counter()-s)
    ts.sort(); return ts[len(ts)//2]
R,H,L,D=2,9,330,64
seg=torch.tensor(sum([[0]*24]+[[i]*77 for i in range(1,5)],[]))[:L]
seg=torch.cat([seg, torch.full((L-len(seg),),99)])
causal=torch.tril(torch.ones(L,L,dtype=torch.bool))
mask=((seg[:,None]==seg[None,:])|(seg[None,:]==0))&causal
mask=mask.expand(R,1,L,L)
for dt in (torch.bfloat16, torch.float32):
    q,k,v=[torch.randn(R,H,L,D,dtype=dt,requires_grad=True) for _ in range(3)]
    g=torch.randn(R,H,L,D,dtype=dt)
    def fb(m=mask, c=False):
        o=F.scaled_dot_product_attention(q,k,v,attn_mask=m,is_causal=c); o.backward(g)
    def f32cast():
        o=F.scaled_dot_product_attention(q.float(),k.float(),v.float(),attn_mask=mask).to(dt); o.backward(g)
    print(dt, f"masked fwd+bwd {t(fb)*1e3:.2f} ms; causal (no mask) {t(lambda: fb(None, True))*1e3:.2f} ms" + (f"; via fp32 cast {t(f32cast)*1e3:.2f} ms" if dt==torch.bfloat16 else ""))
def math_attn(q,k,v,m):
    s=(q @ k.transpose(-1,-2)).float() * (q.shape[-1] ** -0.5)
    s=s.masked_fill(~m, float('-inf'))
    p=torch.softmax(s,-1).to(q.dtype)
    return p @ v
cm=torch.compile(math_attn)
for dt in (torch.bfloat16,):
    q,k,v=[torch.randn(R,H,L,D,dtype=dt,requires_grad=True) for _ in range(3)]
    g=torch.randn(R,H,L,D,dtype=dt)
    ref=F.scaled_dot_product_attention(q.float(),k.float(),v.float(),attn_mask=mask)
    print("max diff math vs fp32 sdpa", (math_attn(q,k,v,mask).float()-ref).abs().max().item(), "bf16 spacing-ish", ref.abs().max().item()/128)
    print(dt, f"math eager fwd+bwd {t(lambda: math_attn(q,k,v,mask).backward(g))*1e3:.2f} ms; compiled {t(lambda: cm(q,k,v,mask).backward(g))*1e3:.2f} ms")
