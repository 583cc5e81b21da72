"""transformers' flash path on cs149gpt.flash_attn (cs149gpt.integration.register_transformers_flash): tiny Llama
and Gemma-2 models built from config, float32, in the modes transformers runs flash attention in — padded batches
(unpadded to varlen), generate, padding-free training (DataCollatorWithFlattening) — each compared with the same
model on attn_implementation="eager", and every attention call counted with torch.profiler: one cs149gpt op per
call of an attention module, no torch SDPA, no eager softmax. Also what transformers refuses (continuous batching,
flash-named registrations), asserted as its errors say."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, GemmaTokenizerFast  # noqa: E402,F401

import cs149gpt  # noqa: E402
from cs149gpt import flash_attn  # noqa: E402
from cs149gpt.integration import register_transformers_flash  # noqa: E402

NAME = register_transformers_flash()
VOCAB = 97


def _config(kind):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    # Gemma-2: softcapped logits, and every other layer on a 5-token sliding window.
    return transformers.Gemma2Config(**common, attn_logit_softcapping=3.0, final_logit_softcapping=None,
                                     sliding_window=5, query_pre_attn_scalar=16)


def _models(kind):
    """(ours, eager): the same weights on attn_implementation=NAME and "eager", float32, eval mode."""
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(_config(kind), attn_implementation=NAME).eval()
    eager = AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager").eval()
    eager.load_state_dict(ours.state_dict())
    return ours, eager


KINDS = ["llama", "gemma2"]


def _attention_modules(model):
    return [layer.self_attn for layer in model.model.layers]


def _run_counted(model, fn):
    """fn()'s result, and checks that each call of an attention module ran exactly one cs149gpt op (at the top: ops
    a cs149gpt op calls inside are not counted again; backward ops apart) and that no torch SDPA or softmax ran."""
    calls = []
    hooks = [m.register_forward_hook(lambda *a: calls.append(1)) for m in _attention_modules(model)]
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            result = fn()
    finally:
        for h in hooks:
            h.remove()
    events = prof.events()

    def ours(e):
        return e.name.startswith("cs149gpt::") and "backward" not in e.name

    def nested(e):
        p = e.cpu_parent
        while p is not None:
            if ours(p):
                return True
            p = p.cpu_parent
        return False

    top = [e.name for e in events if ours(e) and not nested(e)]
    torch_attention = [e.name for e in events if "scaled_dot_product" in e.name or e.name in
                       ("aten::softmax", "aten::_softmax", "aten::_safe_softmax")]
    assert calls, "no attention module ran"
    assert len(top) == len(calls), f"{len(calls)} attention calls, {len(top)} cs149gpt ops: {sorted(set(top))}"
    assert not torch_attention, f"torch's attention ran: {sorted(set(torch_attention))}"
    return result


def _left_padded(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for b, length in enumerate(lengths):
        ids[b, n - length:] = torch.randint(3, VOCAB, (length,), generator=g)
        mask[b, n - length:] = 1
    return ids, mask


@pytest.mark.parametrize("kind", KINDS)
def test_padded_batch_runs_varlen_with_eager_logits(kind):
    ours, eager = _models(kind)
    ids, mask = _left_padded([9, 3, 12, 1])
    with torch.no_grad():
        got = _run_counted(ours, lambda: ours(input_ids=ids, attention_mask=mask).logits)
        want = eager(input_ids=ids, attention_mask=mask).logits
    kept = mask.bool()
    torch.testing.assert_close(got[kept], want[kept], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_prefill_and_decode_match_eager(kind):
    ours, eager = _models(kind)
    ids, mask = _left_padded([4, 7, 2])
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True,
              return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    got = _run_counted(ours, lambda: ours.generate(ids, **kw))
    want = eager.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_without_padding_runs_flash_attn_func(kind):
    """No padding: prefill and each decode step are flash_attn_func calls (bottom-right causal over the cache)."""
    ours, eager = _models(kind)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=7, do_sample=False, output_logits=True, return_dict_in_generate=True,
              pad_token_id=0, eos_token_id=None)
    got = _run_counted(ours, lambda: ours.generate(ids, **kw))
    want = eager.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4, rtol=1e-4)


def _flattened(flash_kwargs, lengths=(5, 11, 1, 8), seed=3):
    g = torch.Generator().manual_seed(seed)
    features = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in lengths]
    return DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs, return_tensors="pt")(features)


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("kind", KINDS)
def test_padding_free_training_matches_eager_loss_and_gradients(kind, flash_kwargs):
    """One packed row of four sequences: ours finds them from position_ids, or takes cu_seq_lens_q/k as given;
    eager masks the same row block-diagonally (transformers' packed-sequence mask). Loss, logits and every
    parameter's gradient agree; each sequence's logits are also those of the sequence run alone."""
    ours, eager = _models(kind)
    ours.train(), eager.train()
    batch = _flattened(flash_kwargs)
    if flash_kwargs:
        assert "cu_seq_lens_q" in batch
    # Without a cache, as in training: with one transformers builds eager's mask without looking for packed rows.
    batch["use_cache"] = False
    eager_batch = {k: batch[k] for k in ("input_ids", "labels", "position_ids", "use_cache")}

    def step(model, b):
        model.zero_grad()
        out = model(**b)
        out.loss.backward()
        return out.loss.detach(), out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, logits, grads = _run_counted(ours, lambda: step(ours, dict(batch)))
    want_loss, want_logits, want_grads = step(eager, eager_batch)
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    for n in grads:
        torch.testing.assert_close(grads[n], want_grads[n], atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
    with torch.no_grad():
        for s, e in zip(starts[:-1], starts[1:]):
            alone = eager(input_ids=batch["input_ids"][:, s:e]).logits
            torch.testing.assert_close(logits[:, s:e], alone, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24),
                    reason="the continuous-batching check and its wording are transformers 5.24's")
def test_continuous_batching_refuses_a_name_without_flash():
    """transformers' ContinuousBatchingManager.switch_to_cb_friendly_attn takes only "paged|eager", "sdpa" and names
    containing "flash"; register_transformers_flash's name cannot contain "flash" (next test)."""
    ours, _ = _models("llama")
    config = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=2, pad_token_id=0)
    with pytest.raises(ValueError, match=f"Implementation {NAME} is not supported for continuous batching"):
        ours.generate_batch([[5, 6, 7]], generation_config=config)


def test_flash_named_registration_is_refused_by_transformers():
    """A registered attention function under a name containing "flash" never runs: transformers resolves such names
    to its flash-attn packages or hub kernels at model construction (modeling_flash_attention_utils._lazy_imports).
    register_transformers_flash refuses such a name before transformers does."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    from cs149gpt.integration import _flash_attention_forward

    AttentionInterface.register("cs149gpt_flash_probe", _flash_attention_forward)
    AttentionMaskInterface.register("cs149gpt_flash_probe", flash_attention_mask)
    with pytest.raises(ValueError, match="Could not find the currently requested flash attention implementation"):
        AutoModelForCausalLM.from_config(_config("llama"), attn_implementation="cs149gpt_flash_probe")
    with pytest.raises(ValueError, match="flash"):
        register_transformers_flash("my_flash")


def test_no_transformers_model_passes_alibi_slopes_to_the_flash_path():
    """transformers' flash kwargs (the keyword set its flash wrapper can pass) have no alibi_slopes, so no ALiBi
    model reaches a flash kernel with slopes; BLOOM computes its ALiBi attention in its own code, never calling the
    attention interface: on our name it runs no cs149gpt op at all."""
    import inspect

    from transformers.modeling_flash_attention_utils import _process_flash_attention_kwargs

    assert "alibi_slopes" not in inspect.signature(_process_flash_attention_kwargs).parameters
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=NAME).eval()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
        model(torch.randint(3, VOCAB, (1, 6)))
    assert not [e.name for e in prof.events() if e.name.startswith("cs149gpt::")]


@pytest.mark.slow
def test_continuous_batching_on_our_sdpa():
    """Where the flash path is refused, generate_batch on "sdpa" inside sdpa_installed() runs every attention call on
    our SDPA (cs149gpt.uses_our_kernel says so of each call; its worker thread is outside the profiler's sight);
    the tokens are eager generate's."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config("llama"), attn_implementation="sdpa").eval()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    config = transformers.GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    ours = []

    def counted(*args, **kwargs):
        ours.append(cs149gpt.uses_our_kernel(*args, **kwargs))
        return cs149gpt.scaled_dot_product_attention(*args, **kwargs)

    with cs149gpt.sdpa_installed():
        F.scaled_dot_product_attention = counted
        got = model.generate_batch(prompts, generation_config=config)
    assert ours and all(ours), f"{ours.count(False)} of {len(ours)} calls went to torch's SDPA"
    for i, p in enumerate(prompts):
        want = eager.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist()
        assert got[f"req_{i}"].generated_tokens == want


def test_sdpa_route_runs_gemma2_softcap():
    """attn_implementation="cs149gpt" (register_transformers) too takes Gemma-2's softcapped logits on our kernel."""
    import cs149gpt

    name = cs149gpt.register_transformers()
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(_config("gemma2"), attn_implementation=name).eval()
    eager = AutoModelForCausalLM.from_config(_config("gemma2"), attn_implementation="eager").eval()
    eager.load_state_dict(ours.state_dict())
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
        logits = ours(input_ids=ids, attention_mask=mask).logits
    assert sum(e.name == "cs149gpt::flash_attention" for e in prof.events()) == 2  # one per layer
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits[mask.bool()], want[mask.bool()], atol=1e-4, rtol=1e-4)
