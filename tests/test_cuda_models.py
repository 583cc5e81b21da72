"""Real models on our CUDA kernels: Hugging Face transformers' Llama (GQA) and GPT-2, built from small configs
(nothing downloaded, head dim 64: the tensor-core kernels'), in bfloat16/float16 on the GPU. Skipped where torch sees
no GPU.

- attn_implementation="cs149gpt" (register_transformers, our SDPA): a padded batch's forward, padded greedy
  generate, static-cache generate, GPT-2 training steps with dropout;
- the flash path (register_transformers_flash, cs149gpt.flash_attn): a padding-free (varlen) training step.

Each counts with torch.profiler: every call of an attention module runs one cs149gpt operator and launches our
kernels (namespace cs149gpt::cuda: flash_fwd*, flash_bwd*, the decode and varlen kernels), and no kernel of torch's
attention runs (no SDPA or softmax operator; no kernel of aten's FlashAttention pytorch_flash::flash_*, its
memory-efficient fmha_*, cuDNN's *sdpa*).
Results against the same weights on "eager" attention in float32, with the same model in the same 16-bit dtype on
torch's own attention as the yardstick (ours may be at most twice as far, or within a small floor); generated tokens
are checked teacher-forced: each token ours picks is the float32 eager model's choice at that step, up to that
yardstick's margin (a near-tie in 16 bits may go either way, in torch's attention as in ours).
"""
import pytest
import torch

import cs149gpt
from tests._helpers import padded_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")
transformers = pytest.importorskip("transformers")

CUDA = "cuda"
VOCAB = 96
DTYPES = (torch.bfloat16, torch.float16)
# A floor for the logits' error, relative to their largest magnitude: a few roundings of the dtype.
FLOOR = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


@pytest.fixture(scope="module", autouse=True)
def registered():
    from cs149gpt.integration import register_transformers_flash

    assert cs149gpt.register_transformers() == "cs149gpt"
    return register_transformers_flash()


def llama_config():
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                    max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=None)


def gpt2_config(dropout=0.0):
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=256, n_layer=2, n_head=4,
                                   attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout, pad_token_id=0,
                                   bos_token_id=1, eos_token_id=None)


def build(make_config, implementation, dtype, state=None):
    """The model of make_config() on `implementation`, on the GPU in dtype, eval mode; state: weights to load."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config(), attn_implementation=implementation)
    if state is not None:
        model.load_state_dict(state)
    return model.to(CUDA, dtype).eval()


def trio(make_config, implementation, dtype):
    """(ours, torch's attention in dtype, eager in float32): the same weights."""
    ours = build(make_config, implementation, dtype)
    state = {k: v.float().cpu() for k, v in ours.state_dict().items()}
    return ours, build(make_config, "sdpa", dtype, state), build(make_config, "eager", torch.float32, state)


def attention_modules(model):
    if hasattr(model, "transformer"):  # GPT-2
        return [block.attn for block in model.transformer.h]
    return [layer.self_attn for layer in model.model.layers]


def ours_kernel(name):
    """Every kernel of csrc/cuda lives in namespace cs149gpt::cuda (aten's FlashAttention: pytorch_flash::)."""
    return "cs149gpt::cuda" in name


def torch_attention_kernel(name):
    n = name.lower()
    # (inductor's fused pointwise kernels are named after the ops they feed, ours included: "triton_poi_..._flash_...")
    return (not ours_kernel(name) and not n.startswith("triton_")
            and any(w in n for w in ("fmha", "flash", "sdpa", "attention")))


def run_counted(model, fn, backward_ops=0, softmax_elsewhere=False):
    """fn()'s result, after checking with torch.profiler that every call of an attention module ran one cs149gpt
    operator (at the top: not counting those it calls inside), that they launched our kernels (at least one per
    call, forward and backward), and that nothing of torch's attention ran: no SDPA or softmax operator, no
    attention kernel of aten or cuDNN. backward_ops: the cs149gpt backward operators the call must run.
    softmax_elsewhere: the model has softmax outside attention (a mixture of experts' router): softmax not counted."""
    calls = []
    hooks = [m.register_forward_hook(lambda *a: calls.append(1)) for m in attention_modules(model)]
    try:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            result = fn()
            torch.cuda.synchronize()
    finally:
        for h in hooks:
            h.remove()
    events = prof.events()

    def ours_op(e):
        return e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cs149gpt::")

    def nested(e):
        p = e.cpu_parent
        while p is not None:
            if ours_op(p):
                return True
            p = p.cpu_parent
        return False

    top = [e.name for e in events if ours_op(e) and "backward" not in e.name and not nested(e)]
    backward = [e.name for e in events if ours_op(e) and "backward" in e.name and not nested(e)]
    kernels = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    mine = [n for n in kernels if ours_kernel(n)]
    theirs = sorted({n for n in kernels if torch_attention_kernel(n)})
    softmax = () if softmax_elsewhere else ("aten::softmax", "aten::_softmax", "aten::_safe_softmax")
    torch_ops = sorted({e.name for e in events if "scaled_dot_product" in e.name or e.name in softmax})
    assert calls, "no attention module ran"
    # At least one of our ops per call: the static cache's generate compiles its decoding step, whose attention calls
    # the modules' hooks do not see (44 ops for 20 hooked calls); every attention is ours either way (below).
    assert len(top) >= len(calls), f"{len(calls)} attention calls, {len(top)} cs149gpt ops: {sorted(set(top))}"
    assert len(backward) == backward_ops, f"{len(backward)} cs149gpt backward ops, expected {backward_ops}"
    assert len(mine) >= len(calls) + backward_ops, f"{len(mine)} of our kernels for {len(calls)} calls: {kernels}"
    assert not theirs and not torch_ops, f"torch's attention ran: {theirs} {torch_ops}"
    return result


def err(a, b, keep=None):
    d = (a.float() - b.float()).abs()
    return (d[keep] if keep is not None else d).max().item()


def check_logits(ours, yardstick, reference, dtype, what, keep=None):
    """ours within max(2 × the yardstick's error, FLOOR) of the float32 reference, relative to its largest logit."""
    scale = reference[keep].abs().max().item() if keep is not None else reference.abs().max().item()
    e_ours, e_torch = err(ours, reference, keep) / scale, err(yardstick, reference, keep) / scale
    assert e_ours <= max(2 * e_torch, FLOOR[dtype]), f"{what}: relative error {e_ours:.3g} vs torch's {e_torch:.3g}"
    return max(2 * e_torch, FLOOR[dtype]) * scale


def check_tokens_teacher_forced(sequences, n_prompt, mask, eager, margin):
    """Each generated token is the float32 eager model's greedy choice given the same prefix, up to `margin` (its
    logit within margin of the best)."""
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], sequences.shape[1] - n_prompt)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers a left-padded row
    with torch.no_grad():
        logits = eager(input_ids=sequences, attention_mask=full_mask, position_ids=positions).logits.float()
    steps = logits[:, n_prompt - 1:-1]  # the logits each generated token was chosen from
    chosen = steps.gather(-1, sequences[:, n_prompt:, None])[..., 0]
    gap = (steps.max(-1).values - chosen).max().item()
    assert gap <= margin, f"a generated token is {gap:.3g} below eager's best logit (margin {margin:.3g})"


# ---------------------------------------------------------------------------------------------------------
# attn_implementation="cs149gpt": our SDPA, with the masks transformers builds
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_padded_batch_forward(name, dtype, side):
    make = {"llama": llama_config, "gpt2": gpt2_config}[name]
    ours, theirs, eager = trio(make, "cs149gpt", dtype)
    ids, mask = (t.to(CUDA) for t in padded_batch(VOCAB, [77, 40, 1, 64], 77, side, low=3))
    with torch.no_grad():
        got = run_counted(ours, lambda: ours(input_ids=ids, attention_mask=mask).logits)
        yardstick = theirs(input_ids=ids, attention_mask=mask).logits
        want = eager(input_ids=ids, attention_mask=mask).logits
    check_logits(got, yardstick, want, dtype, f"{name} {side} padding", keep=mask.bool())


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_llama_padded_generate(dtype, cache):
    """Greedy generate on a left-padded batch: the prefill and every decode step (a (B, 1, 1, Nk) mask over the
    cache; the static cache's over its whole length) run ours."""
    ours, theirs, eager = trio(llama_config, "cs149gpt", dtype)
    ids, mask = (t.to(CUDA) for t in padded_batch(VOCAB, [30, 12, 21], 30, "left", seed=1, low=3))
    new = 10
    kwargs = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                  output_logits=True, return_dict_in_generate=True)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        got = run_counted(ours, lambda: ours.generate(input_ids=ids, **kwargs))
        prefill_ours = ours(input_ids=ids, attention_mask=mask).logits
        prefill_theirs = theirs(input_ids=ids, attention_mask=mask).logits
        prefill_eager = eager(input_ids=ids, attention_mask=mask).logits
    margin = check_logits(prefill_ours, prefill_theirs, prefill_eager, dtype, "prefill", keep=mask.bool())
    assert got.sequences.shape == (3, 30 + new)
    check_tokens_teacher_forced(got.sequences, 30, mask, eager, 2 * margin)


def test_gpt2_training_steps_with_dropout():
    """GPT-2 training (attention dropout 0.1, as GPT-2's config has it) in bfloat16: every attention call, forward
    and backward, is ours with its dropout; torch.manual_seed reproduces a step (the loss bit for bit; the gradients
    up to the order of atomic additions, ours and torch's); another seed gives another loss; the steps drop the
    loss; and the dropout is real (a step's loss differs from the eval-mode one)."""
    dtype = torch.bfloat16
    model = build(lambda: gpt2_config(dropout=0.1), "cs149gpt", dtype).train()
    ids, mask = (t.to(CUDA) for t in padded_batch(VOCAB, [64, 50], 64, "right", seed=4, low=3))
    labels = ids.masked_fill(mask == 0, -100)

    def step():
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach().float(), [p.grad.clone() for p in model.parameters()]

    torch.manual_seed(3)
    loss, grads = run_counted(model, step, backward_ops=2)
    torch.manual_seed(3)
    again, grads_again = step()
    assert torch.equal(loss, again)
    for a, b in zip(grads, grads_again):
        assert (a.float() - b.float()).norm() <= 1e-2 * a.float().norm() + 1e-6
    assert all(torch.isfinite(g).all() for g in grads)
    torch.manual_seed(4)
    assert not torch.equal(step()[0], loss)
    model.eval()
    with torch.no_grad():
        eval_loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss.float()
    assert loss.item() != eval_loss.item()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss, _ = step()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpt2_training_step_without_dropout_matches_eager(dtype):
    """A training step's loss and gradients against float32 eager, with torch's attention in dtype as yardstick."""
    ours, theirs, eager = trio(gpt2_config, "cs149gpt", dtype)
    ids, mask = (t.to(CUDA) for t in padded_batch(VOCAB, [64, 37], 64, "right", seed=5, low=3))
    labels = ids.masked_fill(mask == 0, -100)

    def step(model):
        model.train()
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}

    loss, grads = run_counted(ours, lambda: step(ours), backward_ops=2)
    loss_t, grads_t = step(theirs)
    loss_e, grads_e = step(eager)
    assert abs(loss.item() - loss_e.item()) <= max(2 * abs(loss_t.item() - loss_e.item()), FLOOR[dtype])
    for n in grads:
        size = grads_e[n].norm().item() + 1e-12
        e_ours, e_torch = (grads[n] - grads_e[n]).norm().item() / size, (grads_t[n] - grads_e[n]).norm().item() / size
        assert e_ours <= max(2 * e_torch, 4 * FLOOR[dtype]), f"{n}: {e_ours:.3g} vs torch's {e_torch:.3g}"


# ---------------------------------------------------------------------------------------------------------
# the flash path: padding-free (varlen) training
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_llama_padding_free_training_step(registered, dtype, flash_kwargs):
    """One packed row of four sequences (DataCollatorWithFlattening) on the flash path: one varlen call per
    attention module, forward and backward, ours; loss and gradients against float32 eager, which masks the row
    block-diagonally, with eager in dtype as the yardstick."""
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(3)
    features = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in (50, 117, 1, 80)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs, return_tensors="pt")(features)
    batch = {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    batch["use_cache"] = False
    eager_batch = {k: batch[k] for k in ("input_ids", "labels", "position_ids", "use_cache")}
    ours = build(llama_config, registered, dtype)
    state = {k: v.float().cpu() for k, v in ours.state_dict().items()}
    yardstick, eager = build(llama_config, "eager", dtype, state), build(llama_config, "eager", torch.float32, state)

    def step(model, b):
        model.train()
        model.zero_grad()
        out = model(**b)
        out.loss.backward()
        return out.loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}

    loss, grads = run_counted(ours, lambda: step(ours, dict(batch)), backward_ops=2)
    loss_t, grads_t = step(yardstick, eager_batch)
    loss_e, grads_e = step(eager, eager_batch)
    assert abs(loss.item() - loss_e.item()) <= max(2 * abs(loss_t.item() - loss_e.item()), FLOOR[dtype])
    for n in grads:
        size = grads_e[n].norm().item() + 1e-12
        e_ours, e_torch = (grads[n] - grads_e[n]).norm().item() / size, (grads_t[n] - grads_e[n]).norm().item() / size
        assert e_ours <= max(2 * e_torch, 4 * FLOOR[dtype]), f"{n}: {e_ours:.3g} vs eager's {e_torch:.3g}"


# ---------------------------------------------------------------------------------------------------------
# Attention sinks (gpt-oss: one learned logit per head in every row's softmax, passed as s_aux): our kernel's output
# rescaled by sigmoid(lse − sink) (integration.py); transformers refuses "sdpa" for such models, so the yardstick is
# its eager attention in the same dtype. Sliding-window layers alternate with full ones.
# ---------------------------------------------------------------------------------------------------------
def gpt_oss_config():
    return transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=None,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sink_model_padded_batch(dtype, side):
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no gpt-oss")
    ours = build(gpt_oss_config, "cs149gpt", dtype)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("sinks"):  # away from 0: some rows put most of their weight on the sink
                p.copy_(torch.linspace(-2.0, 3.0, p.numel(), device=CUDA))
    state = {k: v.float().cpu() for k, v in ours.state_dict().items()}
    yardstick = build(gpt_oss_config, "eager", dtype, state)
    eager = build(gpt_oss_config, "eager", torch.float32, state)
    ids, mask = (t.to(CUDA) for t in padded_batch(VOCAB, [40, 23, 1, 33], 40, side, low=3))
    with torch.no_grad():
        got = run_counted(ours, lambda: ours(input_ids=ids, attention_mask=mask).logits, softmax_elsewhere=True)
        theirs = yardstick(input_ids=ids, attention_mask=mask).logits
        want = eager(input_ids=ids, attention_mask=mask).logits
    check_logits(got, theirs, want, dtype, f"gpt-oss {side} padding", keep=mask.bool())
