import torch, random
from cs149gpt import varlen_attention
random.seed(0); torch.manual_seed(0)
bad = 0
for it in range(40):
    B = random.randint(1, 5); page = random.choice([1, 3, 7, 16, 33])
    Hkv = random.choice([1, 2]); Hq = Hkv * random.choice([1, 4]); d = random.choice([16, 64, 80])
    dtype = random.choice([torch.float32, torch.bfloat16, torch.float16])
    lk = [random.choice([0, 1, 5, 40, 129]) for _ in range(B)]
    lq = [random.randint(0, x) if x else random.choice([0, 1]) for x in lk]
    if sum(lq) == 0 or sum(lk) == 0: continue
    nblk = [(x + page - 1) // page for x in lk]; maxb = max(nblk) + 1
    nb = sum(nblk) + 3
    perm = torch.randperm(nb).int()
    table = torch.full((B, maxb), -7, dtype=torch.int32)  # junk past each sequence's blocks
    pos = 0
    for b in range(B):
        table[b, :nblk[b]] = perm[pos:pos + nblk[b]]; pos += nblk[b]
    kc = torch.randn(nb, page, Hkv, d).to(dtype); vc = torch.randn(nb, page, Hkv, d).to(dtype)
    cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), Hq, d).to(dtype)
    ks = []; vs = []
    for b in range(B):
        t = torch.arange(lk[b]); ks.append(kc[table[b, t // page].long(), t % page]); vs.append(vc[table[b, t // page].long(), t % page])
    k = torch.cat(ks); v = torch.cat(vs)
    causal = random.random() < .5; sc = random.choice([0.0, 4.0]); al = random.choice([None, torch.rand(Hq)])
    o1, l1 = varlen_attention(q, kc, vc, cu_q, cu_k, max(lq), max(lk), is_causal=causal, softcap=sc, alibi_slopes=al, block_table=table, return_lse=True)
    o2, l2 = varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), is_causal=causal, softcap=sc, alibi_slopes=al, return_lse=True)
    e = (o1.float() - o2.float()).abs().max().item()
    el = (l1 - l2).nan_to_num(0).abs().max().item()
    if e > 1e-2 or el > 1e-3:
        bad += 1; print('BAD', lq, lk, page, Hq, Hkv, d, dtype, causal, e, el)
print('paged done, bad', bad)
