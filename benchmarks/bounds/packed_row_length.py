"""The loss micro-step on one packed layout laid out in more or fewer rows: SmolLM2-135M's policy
and value model (random weights, bf16, fp32 attention, eager), forward and backward, 8 sequences
of 71 slots after a 30-token shared prefix (the long-answer workload's shape), each row with its
own prefix copy; 5 interleaved rounds after 2 warm-up ones, median seconds per row count.

    OMP_NUM_THREADS=2 python benchmarks/bounds/packed_row_length.py 1 2 4 8
"""
import sys, time, statistics, torch
from torchtune_ppo._patches.torchtune_modules import final_hidden_states, use_fp32_attention
from torchtune_ppo.models import smollm2_135m, smollm2_135m_classifier
from torchtune_ppo.models.embedding import use_fp32_grad_embeddings
from torchtune_ppo.rlhf import block_causal_masks
torch.manual_seed(0)
dtype = torch.bfloat16
policy = smollm2_135m(max_seq_len=1024).to(dtype); value = smollm2_135m_classifier(max_seq_len=1024).to(dtype)
for m in (policy, value):
    use_fp32_attention(m); use_fp32_grad_embeddings(m)
C = 30
seqs = [71] * 8  # non-prefix slots of 8 sequences
def layout(n_rows):
    per = [seqs[i::n_rows] for i in range(n_rows)]
    L = max(C + sum(p) for p in per)
    seg = torch.zeros(n_rows, L, dtype=torch.long); pre = torch.zeros(n_rows, L, dtype=torch.long)
    pos = torch.zeros(n_rows, L, dtype=torch.long)
    for r, p in enumerate(per):
        seg[r, :C] = 1; pos[r, :C] = torch.arange(C); at = C; sid = 2
        for s in p:
            seg[r, at:at+s] = sid; pre[r, at:at+s] = 1; pos[r, at:at+s] = torch.arange(C, C+s); at += s; sid += 1
        seg[r, at:] = 999 + r; pos[r, at:] = 0
    masks = block_causal_masks(seg, pre)
    tokens = torch.randint(0, 49152, (n_rows, L))
    return tokens, masks, pos
def step(lay):
    tokens, masks, pos = lay
    h = final_hidden_states(policy, tokens, mask=masks, input_pos=pos)
    hv = final_hidden_states(value, tokens, mask=masks, input_pos=pos)
    reads = torch.arange(0, h.shape[0]*h.shape[1], 2)[:480]
    lp = torch.log_softmax(policy.output(h.flatten(0,1)[reads]).float(), -1)[:, 5].sum()
    (lp + value.output(hv.flatten(0,1)[reads]).float().square().sum()).backward()
    policy.zero_grad(set_to_none=True); value.zero_grad(set_to_none=True)
cands = [int(a) for a in sys.argv[1:]] or [1, 2, 4]
lays = {k: layout(k) for k in cands}
for k, l in lays.items(): print(k, "rows", tuple(l[0].shape), "slots", l[0].numel())
times = {k: [] for k in cands}
for i in range(2 + 5):
    order = cands if i % 2 == 0 else cands[::-1]
    for k in order:
        t = time.perf_counter(); step(lays[k]); times[k].append(time.perf_counter() - t)
for k in cands: print(k, "rows: median", round(statistics.median(times[k][2:]), 3), [round(x, 2) for x in times[k][2:]])
