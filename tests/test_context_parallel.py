"""Training with the sequence sharded over 2 gloo processes (context parallelism): the shipped GPT
(GPT.set_context_parallel, and train.py's --context_parallel) and a tiny Hugging Face Llama
(cs149gpt.integration.register_transformers_ring). One training step's loss, unsharded logits and all-reduced
gradients against the same model's step in one process on the whole sequence (PyTorch's attention: "sdpa" /
"eager"; and float64 for the GPT), and bits identical from run to run. One spawn runs every check (the processes'
start-up dominates on a small machine).
"""
import io
import multiprocessing
import queue as queue_module
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

from cs149gpt.model import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

JOIN_SECONDS = 150  # a hang fails the test instead of the suite
WORLD = 2
B, N = 2, 32  # batch and whole-sequence length (8 tokens a chunk of the zigzag over 2 ranks)
GPT_CONFIG = dict(block_size=N, vocab_size=23, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
VOCAB = 97


def gpt_model(dtype=torch.float32):
    torch.manual_seed(0)  # the same weights in every process
    return GPT(GPTConfig(**GPT_CONFIG)).to(dtype)


TEXT = "".join(f"The {who} speaks line {n} of the play.\n" for n, who in enumerate(("king", "fool", "ghost") * 8))
TRAIN = dict(block_size=N, n_layer=1, n_head=2, n_embd=32, batch_size=4, max_iters=4, eval_interval=0, eval_iters=2,
             warmup_iters=2)


def gpt_batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, GPT_CONFIG["vocab_size"], (B, N + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]  # idx, targets (B, N)


def llama_model(attn_implementation):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=128)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).train()


def llama_batch():
    return torch.randint(0, VOCAB, (B, N), generator=torch.Generator().manual_seed(2))


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------------------------------------- the processes
def all_reduce_grads(model, divide):
    for p in model.parameters():
        if p.grad is not None:
            torch.distributed.all_reduce(p.grad)
            p.grad /= divide


def gpt_step(positions="default"):
    """One sharded step of the GPT: the mean loss, the whole logits and the gradients, as a user averages them.
    positions: "default" (forward's: the shard's), "explicit" (shard_positions given), "local" (0..N/W-1 on every
    rank, the mistake the default avoids)."""
    from cs149gpt.distributed import shard_positions, shard_sequence, unshard_sequence

    model = gpt_model().set_context_parallel(layout="zigzag")
    idx, targets = gpt_batch()
    x, y = (shard_sequence(t, 1, layout="zigzag") for t in (idx, targets))  # (B, N / W)
    given = dict(default=None, explicit=shard_positions(N, layout="zigzag"), local=torch.arange(N // WORLD))
    logits, loss = model(x, y, positions=given[positions])
    loss.backward()
    all_reduce_grads(model, WORLD)  # each rank's loss is the mean over as many tokens: the mean of the ranks'
    torch.distributed.all_reduce(loss := loss.detach().clone())
    return dict(loss=loss / WORLD, logits=unshard_sequence(logits, 1, layout="zigzag"), grads=grads(model))


def train_run(**kwargs):
    """train.py's training loop: the losses of each step, the validation loss and the trained weights."""
    from cs149gpt import train as train_script

    result = train_script.train(train_script.TrainConfig(**TRAIN, **kwargs), text=TEXT, progress=False)
    return dict(losses=torch.tensor(result.losses), val_loss=torch.tensor(result.val_loss),
                weights=result.model.state_dict())


def llama_step(name, via_torch_cp=False):
    """One sharded step of the Llama on register_transformers_ring's attention (the recipe of its docstring). With
    via_torch_cp, torch's context_parallel shards the buffers (its head-tail layout) instead of shard_sequence."""
    from cs149gpt.distributed import shard_positions, shard_sequence, unshard_sequence

    model = llama_model(name)
    ids = llama_batch()
    shifted = F.pad(ids[:, 1:], (0, 1), value=-100)  # next-token labels of the whole sequence
    count = (shifted != -100).sum()
    if via_torch_cp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        positions = torch.arange(N)[None].clone()
        with context_parallel(init_device_mesh("cpu", (WORLD,)), buffers=[ids, positions, shifted],
                              buffer_seq_dims=[1, 1, 1], no_restore_buffers={ids, positions, shifted}):
            out = model(input_ids=ids, position_ids=positions, labels=shifted, shift_labels=shifted,
                        num_items_in_batch=count, use_cache=False)
    else:
        ids_local, labels = (shard_sequence(t, 1, layout="zigzag") for t in (ids, shifted))
        out = model(input_ids=ids_local, position_ids=shard_positions(N, layout="zigzag")[None], labels=labels,
                    shift_labels=labels, num_items_in_batch=count, use_cache=False)
    out.loss.backward()
    all_reduce_grads(model, 1)  # each rank's loss is its sum over the whole sequence's count: they add up
    torch.distributed.all_reduce(loss := out.loss.detach().clone())
    return dict(loss=loss, logits=unshard_sequence(out.logits.detach(), 1, layout="zigzag"), grads=grads(model))


def llama_errors(name):
    """What a sharded Llama refuses: the default (unsharded) position ids, and a padding mask."""
    from cs149gpt.distributed import shard_sequence

    model = llama_model(name)
    ids = shard_sequence(llama_batch(), 1, layout="zigzag")
    found = {}
    for case, kwargs in (("no_position_ids", {}),
                         ("padding", dict(attention_mask=torch.ones_like(ids).index_fill_(1, torch.tensor([0]), 0),
                                          position_ids=torch.arange(ids.shape[1])[None]))):
        try:
            model(input_ids=ids, use_cache=False, **kwargs)
            found[case] = "no error"
        except Exception as e:  # noqa: BLE001 (the message is checked by the test)
            found[case] = f"{type(e).__name__}: {e}"
    return found


def worker(rank, store_path, results):
    try:
        torch.set_num_threads(1)
        torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(store_path, WORLD),
                                             rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
        from cs149gpt.integration import register_transformers_ring

        name = register_transformers_ring()
        got = {"gpt": gpt_step(), "gpt_again": gpt_step("explicit"), "gpt_local_positions": gpt_step("local"),
               "llama": llama_step(name), "llama_again": llama_step(name),
               "llama_torch_cp": llama_step(name, via_torch_cp=True),
               "llama_errors": llama_errors(name), "train": train_run(context_parallel=True)}
        if rank == 0:
            buffer = io.BytesIO()
            torch.save(got, buffer)
            results.put(("result", rank, buffer.getvalue()))
        torch.distributed.destroy_process_group()
        results.put(("done", rank, None))
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which fails the test)
        import traceback

        results.put(("crash", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = str(tmp_path_factory.mktemp("cp") / "store")
    procs = [ctx.Process(target=worker, args=(r, store, results), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    got, done = None, 0
    try:
        while done < WORLD:
            try:
                kind, rank, payload = results.get(timeout=JOIN_SECONDS)
            except queue_module.Empty:
                pytest.fail(f"the {WORLD} processes did not finish within {JOIN_SECONDS} s")
            if kind == "crash":
                pytest.fail(f"rank {rank} crashed: {payload}")
            if kind == "result":
                got = torch.load(io.BytesIO(payload))
            done += kind == "done"
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return got


# ------------------------------------------------------------------------------------------------- references
def gpt_reference(dtype):
    """The same step in one process on the whole sequence, PyTorch's SDPA."""
    model = gpt_model(dtype)
    idx, targets = gpt_batch()
    logits, loss = model(idx, targets)
    loss.backward()
    return dict(loss=loss.detach(), logits=logits.detach(), grads=grads(model))


def llama_reference():
    model = llama_model("eager")
    ids = llama_batch()
    out = model(input_ids=ids, labels=ids, use_cache=False)  # transformers shifts the labels itself
    out.loss.backward()
    return dict(loss=out.loss.detach(), logits=out.logits.detach(), grads=grads(model))


def assert_close(got, want, rtol, what):
    """max |got − want| <= rtol · max |want| for the loss, the logits and each parameter's gradient."""
    assert got["grads"].keys() == want["grads"].keys(), what
    pairs = [("loss", got["loss"], want["loss"]), ("logits", got["logits"], want["logits"])]
    pairs += [(f"grad of {n}", got["grads"][n], want["grads"][n]) for n in want["grads"]]
    for name, a, b in pairs:
        a, b = a.double(), b.double()
        err, scale = (a - b).abs().max().item(), b.abs().max().item()
        assert err <= rtol * scale, f"{what}: {name} differs by {err:.3g} (max |ref| {scale:.3g})"


def same_bits(a, b):
    return (torch.equal(a["loss"], b["loss"]) and torch.equal(a["logits"], b["logits"])
            and all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"]))


# ------------------------------------------------------------------------------------------------- the tests
def test_gpt_sharded_step_equals_one_process(sharded):
    got = sharded["gpt"]
    assert got["logits"].shape == (B, N, GPT_CONFIG["vocab_size"])
    assert len(got["grads"]) == sum(1 for _ in gpt_model().parameters())  # every parameter has its gradient
    assert_close(got, gpt_reference(torch.float32), 1e-5, "GPT vs one process, float32 SDPA")
    assert_close(got, gpt_reference(torch.float64), 1e-5, "GPT vs one process, float64")


def test_gpt_local_positions_are_caught(sharded):
    """positions 0..N/W-1 on each rank (the shard's local ones) give other rotary angles: the comparison above sees
    that (so it tests the positions, not only the attention)."""
    with pytest.raises(AssertionError, match="differs by"):
        assert_close(sharded["gpt_local_positions"], gpt_reference(torch.float32), 1e-5, "local positions")


def test_gpt_sharded_step_bits_repeat(sharded):
    """Run to run, and forward's default positions against shard_positions given."""
    assert same_bits(sharded["gpt"], sharded["gpt_again"])


def test_train_script_context_parallel_follows_one_process(sharded):
    """train.py --context_parallel (each window sharded over the 2 processes) against the same run in one process:
    every step's loss, the validation loss and the weights after 4 AdamW steps."""
    got, want = sharded["train"], train_run()
    assert len(got["losses"]) == TRAIN["max_iters"]
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(got["val_loss"], want["val_loss"], rtol=1e-5, atol=0)
    for name, w in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=1e-5 * w.abs().max().item(), msg=name)


def test_llama_sharded_step_equals_eager(sharded):
    got = sharded["llama"]
    assert got["logits"].shape == (B, N, VOCAB)
    assert len(got["grads"]) == sum(1 for p in llama_model("eager").parameters() if p.requires_grad)
    assert_close(got, llama_reference(), 1e-5, "Llama vs one process, eager")


def test_llama_sharded_step_bits_repeat(sharded):
    assert same_bits(sharded["llama"], sharded["llama_again"])


def test_llama_buffers_sharded_by_torch_context_parallel(sharded):
    """torch's context_parallel(buffers=...) shards in its head-tail layout, which is our "zigzag": the same step,
    bit for bit, with its shards instead of shard_sequence's."""
    assert same_bits(sharded["llama"], sharded["llama_torch_cp"])


def test_llama_refuses_unsharded_positions_and_padding(sharded):
    errors = sharded["llama_errors"]
    assert errors["no_position_ids"].startswith("ValueError") and "shard_positions" in errors["no_position_ids"]
    assert errors["padding"].startswith("ValueError") and "padding mask" in errors["padding"]
