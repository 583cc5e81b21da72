"""Real models on our kernel: Hugging Face transformers' Llama (GQA), GPT-2 and BERT, built from tiny configs
(nothing downloaded), with attn_implementation="cs149gpt" (cs149gpt.register_transformers()), against the same
weights on torch's "sdpa" attention.

Each test counts operators with torch.profiler: every attention call runs ours (cs149gpt::flash_attention, one
per layer and forward pass) and none runs torch's SDPA; outputs match torch's within float32 tolerance, greedy
generation gives identical tokens. Padded batches (left and right) pass boolean masks (float 0/−inf ones under
torch.compile), which our kernel takes.
"""
import contextlib

import pytest
import torch
from torch.profiler import profile

import cs149gpt
from tests._helpers import padded_batch

transformers = pytest.importorskip("transformers")

OURS = "cs149gpt::flash_attention"
OURS_BACKWARD = "cs149gpt::flash_attention_backward"
DECODE = "cs149gpt::flash_decode"  # the decode kernel (calls of <= 16 query rows), inside OURS's event
TORCH_SDPA = ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_attention_math")
# float32 logits/hidden states of two attention implementations of the same weights (measured: <= 3e-7 here).
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert cs149gpt.register_transformers() == "cs149gpt"


def twins(make_config, model_class):
    """The same randomly initialised model on our attention and on torch's SDPA (separate configs: from_config
    writes the implementation into the config it is given)."""
    torch.manual_seed(0)
    ours = model_class.from_config(make_config(), attn_implementation="cs149gpt").eval()
    theirs = model_class.from_config(make_config(), attn_implementation="sdpa").eval()
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def attention_calls(fn):
    """(result of fn(), {operator: count} of ours and torch's attention operators)."""
    with profile() as prof:
        result = fn()
    counts = {}
    for event in prof.events():
        if event.name in (OURS, OURS_BACKWARD, DECODE, *TORCH_SDPA):
            counts[event.name] = counts.get(event.name, 0) + 1
    return result, counts


def assert_all_ours(counts, expected):
    assert counts.get(OURS, 0) == expected and not any(counts.get(n) for n in TORCH_SDPA), counts


def llama_config():
    return transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    pad_token_id=0, bos_token_id=1, eos_token_id=None)


def gpt2_config(dropout=0.0):
    return transformers.GPT2Config(vocab_size=96, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                                   attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=None)


def bert_config():
    return transformers.BertConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=128, max_position_embeddings=64, pad_token_id=0)


CAUSAL_LMS = {"llama": llama_config, "gpt2": gpt2_config}


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", list(CAUSAL_LMS))
def test_causal_lm_padded_batch(name, side):
    ours, theirs = twins(CAUSAL_LMS[name], transformers.AutoModelForCausalLM)
    ids, mask = padded_batch(96, [13, 7, 1, 10], 13, side)
    with torch.no_grad():
        out, counts = attention_calls(lambda: ours(input_ids=ids, attention_mask=mask).logits)
        want = theirs(input_ids=ids, attention_mask=mask).logits
    assert_all_ours(counts, expected=2)
    valid = mask.bool()
    assert (out - want)[valid].abs().max().item() <= TOL


@pytest.mark.parametrize("name", list(CAUSAL_LMS))
def test_padded_greedy_generation_gives_torchs_tokens(name):
    ours, theirs = twins(CAUSAL_LMS[name], transformers.AutoModelForCausalLM)
    ids, mask = padded_batch(96, [9, 4, 6], 9, "left", seed=1)
    new = 8
    kwargs = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        tokens, counts = attention_calls(lambda: ours.generate(input_ids=ids, **kwargs))
        want = theirs.generate(input_ids=ids, **kwargs)
    assert_all_ours(counts, expected=2 * new)  # prefill, then one step per further token; 2 layers each
    assert counts.get(DECODE) == 2 * new  # masked, <= 16 query rows (a 9-token prefill too): the decode kernel
    assert torch.equal(tokens, want)


def test_static_cache_generation():
    """A static KV cache passes a mask on every step (prefill and decode): all of them ours."""
    ours, theirs = twins(llama_config, transformers.AutoModelForCausalLM)
    ids, mask = padded_batch(96, [7, 5], 7, "left", seed=2)
    new = 5
    kwargs = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                  cache_implementation="static")
    with torch.no_grad():
        tokens, counts = attention_calls(lambda: ours.generate(input_ids=ids, **kwargs))
        want = theirs.generate(input_ids=ids, **kwargs)
    assert_all_ours(counts, expected=2 * new)
    assert counts.get(DECODE) == 2 * new  # a (B, 1, Nq, max_len) mask on every step: the decode kernel
    assert torch.equal(tokens, want)


@pytest.mark.parametrize("side", ["left", "right"])
def test_bert_padded_batch(side):
    ours, theirs = twins(bert_config, transformers.AutoModel)
    ids, mask = padded_batch(96, [11, 3, 8], 11, side, seed=3)
    with torch.no_grad():
        out, counts = attention_calls(lambda: ours(input_ids=ids, attention_mask=mask).last_hidden_state)
        want = theirs(input_ids=ids, attention_mask=mask).last_hidden_state
    assert_all_ours(counts, expected=2)
    assert (out - want)[mask.bool()].abs().max().item() <= TOL


def test_gpt2_training_step():
    """One training step of GPT-2 on a padded batch, without dropout: the loss and every parameter's gradient
    match torch's; forward and backward both ours."""
    ours, theirs = twins(gpt2_config, transformers.AutoModelForCausalLM)
    ours.train()
    theirs.train()
    ids, mask = padded_batch(96, [12, 9], 12, "right", seed=4)
    labels = ids.masked_fill(mask == 0, -100)

    def step(model):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach()

    loss, counts = attention_calls(lambda: step(ours))
    want = step(theirs)
    assert_all_ours(counts, expected=2)
    assert counts.get(OURS_BACKWARD) == 2
    assert abs(loss.item() - want.item()) <= TOL
    theirs_params = dict(theirs.named_parameters())
    worst = max((p.grad - theirs_params[n].grad).abs().max().item() for n, p in ours.named_parameters())
    assert worst <= 1e-4


def test_compiled_llama_padded_batch():
    """Under torch.compile transformers always builds a mask: it still runs ours, and gives torch's logits."""
    torch._dynamo.reset()
    ours, theirs = twins(llama_config, transformers.AutoModelForCausalLM)
    ids, mask = padded_batch(96, [10, 6], 10, "left", seed=5)
    compiled = torch.compile(ours)
    with torch.no_grad():
        compiled(input_ids=ids, attention_mask=mask)  # compile outside the profiled call
        out, counts = attention_calls(lambda: compiled(input_ids=ids, attention_mask=mask).logits)
        want = theirs(input_ids=ids, attention_mask=mask).logits
    torch._dynamo.reset()
    assert_all_ours(counts, expected=2)
    assert (out - want)[mask.bool()].abs().max().item() <= TOL


def calls_under_autocast(fn):
    """(fn(), calls of our kernel, calls of torch's SDPA): under autocast our operators' autocast rule calls the
    operator again below itself, so an event nested in one of ours is not another call."""
    names = ("cs149gpt::attention", OURS)
    with profile() as prof:
        result = fn()
    ours = sum(e.name in names and (e.cpu_parent is None or e.cpu_parent.name not in names) for e in prof.events())
    theirs = sum(e.name in TORCH_SDPA[:1] for e in prof.events())
    return result, ours, theirs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("how", ["cs149gpt", "sdpa_installed"])
def test_llama_under_autocast_runs_ours(how, dtype):
    """torch.autocast("cpu") over a float32 Llama (GQA; q and k leave the rotary embedding in float32, v a Linear
    in the autocast dtype): every attention call runs ours, in autocast's dtype as torch's SDPA does, and the logits
    are torch's within that dtype's rounding; a padded batch (a bool mask) too."""
    ours, theirs = twins(llama_config, transformers.AutoModelForCausalLM)
    model = ours if how == "cs149gpt" else theirs
    ids, mask = padded_batch(96, [11, 6], 11, "left", seed=8)
    for attention_mask in (None, mask):
        scope = cs149gpt.sdpa_installed() if how == "sdpa_installed" else contextlib.nullcontext()
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype), scope:
            out, n_ours, n_theirs = calls_under_autocast(
                lambda: model(input_ids=ids, attention_mask=attention_mask).logits)
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            want = theirs(input_ids=ids, attention_mask=attention_mask).logits
        assert (n_ours, n_theirs) == (2, 0) and out.dtype == want.dtype
        rows = mask.bool() if attention_mask is not None else torch.ones_like(mask, dtype=torch.bool)
        assert (out.float() - want.float())[rows].abs().max().item() <= 0.02 * want.float().abs().max().item()


def test_mask_function_hands_compiled_models_a_float_mask(monkeypatch):
    """Our registered mask function returns transformers' bool sdpa mask as it is, and under torch.compile the same
    mask as float32 0/−inf (inductor writes bool masks slowly; the kernel takes both as the same key ranges)."""
    import transformers.masking_utils as masking_utils
    from cs149gpt.integration import _transformers_mask

    want = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(3)) < 0.6
    monkeypatch.setattr(masking_utils, "sdpa_mask", lambda *args, **kwargs: want.clone())
    eager = _transformers_mask(batch_size=2, q_length=5, kv_length=7)
    torch._dynamo.reset()
    compiled = torch.compile(lambda: _transformers_mask(batch_size=2, q_length=5, kv_length=7), fullgraph=True)()
    torch._dynamo.reset()
    assert eager.dtype == torch.bool and torch.equal(eager, want)
    assert compiled.dtype == torch.float32
    assert torch.equal(compiled == 0, want) and torch.isneginf(compiled[~want]).all()


def test_position_bias_takes_the_compiled_float_mask():
    """T5-style position biases are folded into the mask by transformers' create_position_bias_mask, which wants a
    bool mask (or adds a float one): the float 0/−inf mask our mask function hands compiled models gives the same
    output as the bool one."""
    from types import SimpleNamespace

    from cs149gpt.integration import _transformers_attention

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    bias = torch.randn(1, 4, 5, 5, generator=g)
    keep = torch.rand(2, 1, 5, 5, generator=g) < 0.7
    keep[..., 0] = True  # every row sees a key
    as_float = torch.where(keep, 0.0, float("-inf"))
    module = SimpleNamespace(is_causal=False)
    want, _ = _transformers_attention(module, q, k, v, keep, position_bias=bias)
    got, _ = _transformers_attention(module, q, k, v, as_float, position_bias=bias)
    assert torch.equal(got, want)


def test_sdpa_installed_runs_a_model_written_for_torchs_sdpa():
    """install_sdpa's scope: transformers' own "sdpa" attention (which calls torch.nn.functional's) runs ours
    inside it and torch's after."""
    _, theirs = twins(gpt2_config, transformers.AutoModelForCausalLM)
    ids, mask = padded_batch(96, [8, 5], 8, "left", seed=6)
    with torch.no_grad():
        with cs149gpt.sdpa_installed():
            out, counts = attention_calls(lambda: theirs(input_ids=ids, attention_mask=mask).logits)
        want, after = attention_calls(lambda: theirs(input_ids=ids, attention_mask=mask).logits)
    assert_all_ours(counts, expected=2)
    assert after.get(OURS, 0) == 0 and after.get(TORCH_SDPA[0]) == 2
    assert (out - want)[mask.bool()].abs().max().item() <= TOL


def test_models_are_copies():
    """twins() really gives two models with one set of weights and two attention implementations."""
    ours, theirs = twins(gpt2_config, transformers.AutoModelForCausalLM)
    assert ours.config._attn_implementation == "cs149gpt" and theirs.config._attn_implementation == "sdpa"
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))


def test_gpt2_training_step_with_dropout():
    """GPT-2's default attention dropout (0.1) in training: every attention call ours (forward and backward), a
    finite loss and gradients, the same bits again under the same torch.manual_seed, others under another."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(gpt2_config(dropout=0.1), attn_implementation="cs149gpt")
    model.train()
    ids, mask = padded_batch(96, [12, 9], 12, "right", seed=7)
    labels = ids.masked_fill(mask == 0, -100)

    def step(seed):
        model.zero_grad()
        torch.manual_seed(seed)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    (loss, grads), counts = attention_calls(lambda: step(1))
    assert_all_ours(counts, expected=2)
    assert counts.get(OURS_BACKWARD) == 2
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    again, grads_again = step(1)
    assert torch.equal(loss, again) and all(torch.equal(a, b) for a, b in zip(grads, grads_again))
    assert not torch.equal(step(2)[0], loss)


def test_compiled_gpt2_training_step_with_dropout():
    """GPT-2 training under torch.compile with attention dropout 0.1 on a padded batch (a mask on every layer):
    forward and backward both ours; torch.manual_seed reproduces the compiled step's bits and another seed
    changes them; without dropout the compiled step's loss and gradients are torch's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(gpt2_config(dropout=0.1), attn_implementation="cs149gpt")
    model.train()
    compiled = torch.compile(model)
    ids, mask = padded_batch(96, [12, 9], 12, "right", seed=8)
    labels = ids.masked_fill(mask == 0, -100)

    def step(seed):
        model.zero_grad()
        torch.manual_seed(seed)
        loss = compiled(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    step(1)  # compile outside the profiled call
    (loss, grads), counts = attention_calls(lambda: step(1))
    again, grads_again = step(1)
    other = step(2)[0]
    torch._dynamo.reset()
    assert_all_ours(counts, expected=2)
    assert counts.get(OURS_BACKWARD) == 2
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(loss, again) and all(torch.equal(a, b) for a, b in zip(grads, grads_again))
    assert not torch.equal(other, loss)


def test_compiled_gpt2_training_step_matches_torch():
    """The same compiled step without dropout: loss and every parameter's gradient are torch's (eager SDPA)."""
    torch._dynamo.reset()
    ours, theirs = twins(gpt2_config, transformers.AutoModelForCausalLM)
    ours.train()
    theirs.train()
    compiled = torch.compile(ours)
    ids, mask = padded_batch(96, [12, 9], 12, "left", seed=9)
    labels = ids.masked_fill(mask == 0, -100)
    compiled(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()  # compile
    ours.zero_grad()

    def step():
        loss = compiled(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach()

    loss, counts = attention_calls(step)
    want = theirs(input_ids=ids, attention_mask=mask, labels=labels).loss
    want.backward()
    torch._dynamo.reset()
    assert_all_ours(counts, expected=2)
    assert counts.get(OURS_BACKWARD) == 2
    assert abs(loss.item() - want.item()) <= TOL
    theirs_params = dict(theirs.named_parameters())
    worst = max((p.grad - theirs_params[n].grad).abs().max().item() for n, p in ours.named_parameters())
    assert worst <= 1e-4


# ---------------------------------------------------------------------------------------------------------
# Attention sinks (gpt-oss: one learned logit per head in every row's softmax, passed as s_aux). transformers
# refuses "sdpa" for such models; the reference is its "eager" attention.
# ---------------------------------------------------------------------------------------------------------
def gpt_oss_config():
    return transformers.GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=4, max_position_embeddings=128,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=None,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def sink_twins():
    """gpt-oss on ours and on eager attention, with sinks large enough to matter (initialised near 0, a sink already
    takes a share of every row's weight; scaled up, some rows put most of it there)."""
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no gpt-oss")
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(gpt_oss_config(), attn_implementation="cs149gpt").eval()
    theirs = transformers.AutoModelForCausalLM.from_config(gpt_oss_config(), attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.linspace(-2.0, 3.0, p.numel()))
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


@pytest.mark.parametrize("side", ["left", "right"])
def test_sink_model_padded_batch(side):
    """Inference: each row's output is our kernel's rescaled by sigmoid(lse − sink): the logits match eager's, and
    every attention call (one per layer, sliding-window layers included) ran our kernel."""
    ours, theirs = sink_twins()
    ids, mask = padded_batch(96, [10, 6, 8], 10, side, seed=5)
    with torch.no_grad():
        logits, counts = attention_calls(lambda: ours(input_ids=ids, attention_mask=mask).logits)
        want = theirs(input_ids=ids, attention_mask=mask).logits
    assert_all_ours(counts, expected=2)
    keep = mask.bool()
    assert (logits - want)[keep].abs().max().item() <= TOL


def test_sink_model_greedy_generation():
    ours, theirs = sink_twins()
    ids, mask = padded_batch(96, [9, 5], 9, "left", seed=6)
    new = 6
    kwargs = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        tokens, counts = attention_calls(lambda: ours.generate(input_ids=ids, **kwargs))
        want = theirs.generate(input_ids=ids, **kwargs)
    assert_all_ours(counts, expected=2 * new)
    assert torch.equal(tokens, want)


def test_sink_model_training_step():
    """With gradients the sink goes through eager's math (our lse takes no gradient): the loss and every gradient,
    the sinks' included, match eager's."""
    ours, theirs = sink_twins()
    ours.train()
    theirs.train()
    ids, mask = padded_batch(96, [10, 7], 10, "right", seed=7)
    labels = ids.masked_fill(mask == 0, -100)
    losses = []
    for model in (ours, theirs):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= TOL
    theirs_params = dict(theirs.named_parameters())
    worst = max((p.grad - theirs_params[n].grad).abs().max().item() for n, p in ours.named_parameters()
                if p.grad is not None)
    assert worst <= 1e-4
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in ours.named_parameters() if n.endswith("sinks"))


# ---------------------------------------------------------------------------------------------------------
# Models transformers does not run on "sdpa" (_supports_sdpa = False) still build their masks through the mask
# function registered under config._attn_implementation, and read them as eager's float masks: they get eager's.
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["bloom", "mpt"])
def test_models_without_sdpa_get_eager_masks(arch):
    """Registered under "cs149gpt", such a model (its own attention, adding the mask to its scores) computes what
    it computes under "eager": with padding, and without (where sdpa's mask function would return None)."""
    make = {
        "bloom": lambda: (transformers.BloomConfig(vocab_size=96, hidden_size=64, n_layer=2, n_head=4),
                          transformers.BloomForCausalLM),
        "mpt": lambda: (transformers.MptConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, max_seq_len=64),
                        transformers.MptForCausalLM),
    }[arch]
    config, cls = make()
    assert not cls._supports_sdpa
    torch.manual_seed(0)
    ours = cls._from_config(make()[0], attn_implementation="cs149gpt").eval()
    theirs = cls._from_config(config, attn_implementation="eager").eval()
    theirs.load_state_dict(ours.state_dict())
    ids, mask = padded_batch(96, [12, 8], 12, "right", seed=8)
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask).logits
        want = theirs(input_ids=ids, attention_mask=mask).logits
        assert (got - want)[mask.bool()].abs().max().item() <= TOL
        assert (ours(input_ids=ids[:1]).logits - theirs(input_ids=ids[:1]).logits).abs().max().item() <= TOL


def eager_sink_reference(q, k, v, mask, sinks, scale):
    """float64: the sink as one more logit per row (transformers' eager attention of gpt-oss / inkling2)."""
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ k.transpose(-1, -2) * scale
    s = s.masked_fill(~mask, float("-inf"))
    rows = sinks.double().reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1) if sinks.dim() == 1 else sinks.double()
    p = torch.softmax(torch.cat([s, rows], dim=-1), dim=-1)[..., :-1]
    return (p @ v).transpose(1, 2)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_sinks_per_head_and_per_row(per_row, grad):
    """Sinks one per head (gpt-oss) or one per query row, (B, H, Nq, 1) (inkling2): our kernel rescaled without
    gradients, eager's math with them; both against float64."""
    from cs149gpt.integration import _transformers_attention

    g = torch.Generator().manual_seed(9)
    B, H, Hkv, N, d = 2, 4, 2, 7, 16
    q, k, v = (torch.randn(B, h, N, d, generator=g) for h in (H, Hkv, Hkv))
    sinks = torch.randn(B, H, N, 1, generator=g) * 2 if per_row else torch.randn(H, generator=g) * 2
    mask = torch.ones(B, 1, N, N, dtype=torch.bool).tril()
    mask[1, :, :, 5:] = False  # padding: sequence 1 has 5 keys
    mask[0, :, 3, :] = False  # a row that sees no key: lse = -inf, all its weight on the sink, out 0 (as eager)
    module = torch.nn.Module()
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    out, _ = _transformers_attention(module, *leaves, mask, scaling=0.25, s_aux=sinks)
    want = eager_sink_reference(q, k, v, mask, sinks, 0.25)
    assert (out.double() - want).abs().max().item() <= TOL
    if grad:
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        eager_sink_reference(*ref_leaves, mask, sinks, 0.25).sum().backward()
        out.sum().backward()
        for a, b in zip(leaves, ref_leaves):
            assert (a.grad.double() - b.grad).abs().max().item() <= 1e-4
    for bad in (torch.zeros(3), torch.zeros(B, N, H)):  # (B, Nq, H) with Nq != H; a trailing broadcast would not do
        with pytest.raises(ValueError, match=r"attention sinks \(s_aux / sinks\) must be one per head"):
            _transformers_attention(module, q, k, v, mask, scaling=0.25, s_aux=bad)


def test_which_model_types_get_sdpa_masks():
    """sdpa's masks for the types transformers runs on "sdpa", eager's for the others; a sub-model's config
    (blip_text_model) goes by its parent's classes."""
    from cs149gpt.integration import _takes_sdpa_masks

    assert _takes_sdpa_masks("llama") and _takes_sdpa_masks("gpt2") and _takes_sdpa_masks("bert")
    assert not _takes_sdpa_masks("bloom") and not _takes_sdpa_masks("mpt")
    assert not _takes_sdpa_masks("blip_text_model")
    assert _takes_sdpa_masks("a_type_transformers_does_not_map")


@pytest.mark.parametrize("grad", [False, True])
def test_non_finite_sinks_follow_the_rule(grad):
    """A sink is one more logit: +inf or NaN makes its rows NaN, −inf weighs 0 (the output is the kernel's alone), as
    in eager's softmax; on the kernel path (no gradients) and eager's math (gradients)."""
    from cs149gpt.integration import _transformers_attention

    g = torch.Generator().manual_seed(10)
    q, k, v = torch.randn(1, 3, 5, 8, generator=g), torch.randn(1, 1, 5, 8, generator=g), torch.randn(1, 1, 5, 8, generator=g)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    sinks = torch.tensor([float("inf"), float("nan"), float("-inf")])
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    out, _ = _transformers_attention(torch.nn.Module(), *leaves, mask, scaling=0.3, s_aux=sinks)
    want = eager_sink_reference(q, k, v, mask, sinks, 0.3)
    assert out[:, :, 0].isnan().all() and out[:, :, 1].isnan().all() and want[:, :, :2].isnan().all()
    assert (out[:, :, 2].double() - want[:, :, 2]).abs().max().item() <= TOL

