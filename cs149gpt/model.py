"""A character-level GPT whose attention runs through the cs149gpt kernels.

nanoGPT's architecture (token embeddings, pre-LayerNorm blocks of causal self-attention and an MLP, a weight-tied
head), with rotary position embeddings (RoPE) in place of its learned position table: attention then depends on
how far apart two tokens are, not on where they are, so a model trained on short windows reads long contexts
after a short fine-tune, where a learned table knows nothing of positions it never saw. And for this project:

- the attention of every layer is one call to the implementation the driver chose: "sdpa" (part0, PyTorch's
  scaled_dot_product_attention) or one of cs149gpt's "naive", "blocked", "fused", "flash" (parts 1..4), on the
  strided q/k/v views that splitting heads makes, with the causal mask;
- decoding keeps a KV cache: each layer's keys and values live in one preallocated (B, n_kv_head, block_size, hs)
  tensor, and a new token's query attends to a view of its first T rows, so a token costs O(T), not O(T²); with
  "flash", a step of a few tokens is one call of cs149gpt.attention_with_kvcache, which writes the new keys and
  values into the cache and attends to it in one go;
- grouped-query attention (GPTConfig.n_kv_head < n_head, as Llama): query heads share kv heads, which the kernels
  read without expanding them (the shipped model has n_kv_head = n_head);
- context parallelism (GPT.set_context_parallel): each process of a torch.distributed group holds a slice of every
  sequence (cs149gpt.distributed.shard_sequence), attention runs as cs149gpt.distributed.ring_attention over the
  group, and the rotary angles follow the tokens' global positions (shard_positions):

    model.set_context_parallel(group=group)                   # every rank; layout "zigzag" by default
    x, y = (shard_sequence(t, 1, group, layout="zigzag") for t in (idx, targets))   # (B, T / W) each
    logits, loss = model(x, y)                                 # this rank's tokens at their global positions
    loss.backward()                                            # then all-reduce the gradients over the group, / W

    model, vocab = load_pretrained("shakes128")
    model.set_attention("flash")
    for token in model.generate(torch.tensor([vocab.encode("ROMEO:")]), max_new_tokens=100): ...
"""
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention.bias import causal_lower_right

import cs149gpt
from cs149gpt.distributed import LAYOUTS, _resolve_group, ring_attention, shard_positions

# "sdpa" is the driver's part0; the rest are cs149gpt.IMPLS, parts 1..4.
ATTENTION_IMPLS = ("sdpa",) + tuple(cs149gpt.IMPLS)
# With "flash", steps of up to this many new tokens (decoding) go through cs149gpt.attention_with_kvcache; longer
# ones (a prefill) through the tiled kernel.
DECODE_ROWS = 16

MODELS_DIR = Path(__file__).resolve().parent / "models"


@dataclass
class GPTConfig:
    block_size: int = 256  # the longest context: rows of each layer's KV cache
    vocab_size: int = 80
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128  # head size n_embd / n_head = 32, the driver's default d
    n_kv_head: Optional[int] = None  # key/value heads (GQA, a divisor of n_head); None: n_head
    bias: bool = False  # in the Linear and LayerNorm layers; nanoGPT finds it no better without
    rope_base: float = 10000.0  # RoPE's wavelengths run from 2π to 2π·rope_base positions
    # No dropout: a model this small, trained for minutes, underfits; there is nothing to regularise.


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str) -> torch.Tensor:
    """softmax(q kᵀ / √hs + causal mask) v for q (B, nh, Tq, hs), k and v (B, n_kv, Tk, hs), Tq <= Tk.

    The mask is bottom-right aligned: the Tq queries are the last Tq of the Tk positions, so query i sees keys
    j <= i + Tk - Tq. That is what decoding with a cache needs (new tokens against every cached key); with an
    empty cache Tq == Tk and it is the usual top-left mask.
    """
    if impl != "sdpa":
        return cs149gpt.attention(q, k, v, impl=impl, is_causal="bottom_right")
    Tq, Tk = q.size(-2), k.size(-2)
    gqa = k.size(1) != q.size(1)
    if Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if Tq == 1:  # the newest token sees every key: no mask at all
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(Tq, Tk), enable_gqa=gqa)


def rotary_tables(block_size: int, head_size: int, base: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE's angles, (block_size, 1, 1, hs/2) each: position t turns pair i by t · base^(-2i/hs)."""
    inv_freq = base ** -(torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)  # (hs/2,)
    angles = torch.arange(block_size, dtype=torch.float32)[:, None] * inv_freq  # (T, hs/2)
    return angles.cos()[:, None, None, :], angles.sin()[:, None, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates each (x_i, x_{i + hs/2}) pair of x (B, T, ..., hs) by its position's angle (GPT-NeoX's layout)."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, T, ..., hs/2) each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, T, ..., hs)


class KVCache:
    """One layer's keys and values of the tokens seen so far, preallocated for the model's whole context."""

    def __init__(self, batch_size: int, n_head: int, max_len: int, head_size: int, dtype=torch.float32):
        self.k = torch.zeros(batch_size, n_head, max_len, head_size, dtype=dtype)  # (B, n_kv, max_T, hs)
        self.v = torch.zeros_like(self.k)
        self.length = 0  # tokens cached
        self.seqlens = torch.zeros(batch_size, dtype=torch.int32)  # (B,): the same length, as the kernel takes it

    @property
    def capacity(self) -> int:
        return self.k.size(2)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Stores the new tokens' k, v (B, nh, t, hs); returns all cached keys and values, (B, nh, T, hs) each.

        The returned tensors are views of the preallocated cache (row stride hs, head stride max_T·hs): the
        kernels read them in place, so a decoding step copies only the new token's keys and values.
        """
        start, end = self.length, self.length + k.size(2)
        if end > self.capacity:
            raise ValueError(f"KV cache full: {start} tokens cached, {k.size(2)} more do not fit in {self.capacity}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        self.seqlens.fill_(end)
        return self.k[:, :, :end], self.v[:, :, :end]

    def append_and_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Stores k, v (B, n_kv, t, hs) and returns causal attention of q (B, nh, t, hs) over every cached token, in
        one call of cs149gpt.attention_with_kvcache (the new rows are written into the cache in place)."""
        end = self.length + k.size(2)
        if end > self.capacity:
            raise ValueError(f"KV cache full: {self.length} tokens cached, {k.size(2)} more do not fit in "
                             f"{self.capacity}")
        y = cs149gpt.attention_with_kvcache(q, self.k, self.v, self.seqlens, k_new=k, v_new=v, is_causal=True)
        self.length = end
        self.seqlens.fill_(end)
        return y


class CausalSelfAttention(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head or config.n_head
        assert config.n_head % self.n_kv_head == 0
        self.n_embd = config.n_embd
        head_size = config.n_embd // config.n_head
        # q for all heads, then k and v for the kv heads (3 · n_embd wide without GQA)
        self.c_attn = nn.Linear(config.n_embd, (config.n_head + 2 * self.n_kv_head) * head_size, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.impl = "sdpa"  # which attention computes it: one of ATTENTION_IMPLS (GPT.set_attention)
        self.context_parallel = None  # ring_attention's group and layout when sharded (GPT.set_context_parallel)

    def forward(self, x: torch.Tensor, rotary: Tuple[torch.Tensor, torch.Tensor],
                kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        B, T, C = x.size()
        hs = C // self.n_head
        if self.n_kv_head == self.n_head:
            qkv = self.c_attn(x).view(B, T, 3, self.n_head, hs)  # (B, T, 3, nh, hs)
            qk = apply_rotary(qkv[:, :, :2], *rotary)  # (B, T, 2, nh, hs): q and k turned in one go
            q = qk[:, :, 0].transpose(1, 2)  # (B, nh, T, hs), a strided view
            k = qk[:, :, 1].transpose(1, 2)  # (B, nh, T, hs), a strided view
            v = qkv[:, :, 2].transpose(1, 2)  # (B, nh, T, hs), a strided view of c_attn's output
        else:  # GQA: n_kv_head heads of k and v
            q, k, v = self.c_attn(x).split([C, self.n_kv_head * hs, self.n_kv_head * hs], dim=-1)
            q = apply_rotary(q.view(B, T, 1, self.n_head, hs), *rotary).view(B, T, self.n_head, hs).transpose(1, 2)
            k = apply_rotary(k.view(B, T, 1, self.n_kv_head, hs), *rotary).view(B, T, self.n_kv_head, hs)
            k = k.transpose(1, 2)  # (B, n_kv, T, hs); q: (B, nh, T, hs)
            v = v.view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, n_kv, T, hs), strided
        # The kernels read all three in place, whatever their strides: no .contiguous() copies.
        # attention_with_kvcache has no backward: a step that needs gradients takes the differentiable path below.
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if self.context_parallel is not None:  # this rank's T tokens against the whole sequence's keys
            y = ring_attention(q, k, v, is_causal=True, **self.context_parallel)  # (B, nh, T, hs)
        elif kv_cache is not None and self.impl == "flash" and T <= DECODE_ROWS and not needs_grad:
            y = kv_cache.append_and_attend(q, k, v)  # (B, nh, T, hs): one call writes the cache and attends
        else:
            if kv_cache is not None:
                k, v = kv_cache.append(k, v)  # (B, n_kv, T_cached + T, hs), views of the cache
            y = causal_attention(q, k, v, self.impl)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C): heads side by side again
        return self.c_proj(y)


class MLP(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rotary: Tuple[torch.Tensor, torch.Tensor],
                kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rotary, kv_cache)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as GPT-2 and nanoGPT
        self.set_block_size(config.block_size)  # the rotary tables
        self.context_parallel, self.context_parallel_size = None, 1  # one process (set_context_parallel)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections into the residual stream: 1/sqrt(2·n_layer) of the usual std.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # wte and lm_head share one tensor, counted once

    def set_attention(self, impl: str) -> "GPT":
        """Makes every layer's attention `impl`: "sdpa" (PyTorch) or a cs149gpt kernel (ATTENTION_IMPLS)."""
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_IMPLS)}; got {impl!r}")
        for block in self.transformer.h:
            block.attn.impl = impl
        return self

    def set_context_parallel(self, enabled: bool = True, *, group=None, layout: str = "zigzag") -> "GPT":
        """Shards the sequence over the ranks of group (a ProcessGroup, None for the default one, or a 1-D
        DeviceMesh; torch.distributed initialised): every layer's attention becomes
        cs149gpt.distributed.ring_attention (causal, the flash kernel on each block) on this rank's tokens. Each
        rank then gives forward its slice of idx and targets (shard_sequence(t, 1, group, layout=layout)): T tokens
        of a sequence of W·T, turned by the rotary angles of their global positions (shard_positions). The loss is
        the mean over the rank's tokens, so the whole sequence's loss is the mean over the ranks, and so are the
        gradients (all-reduce them over group and divide by W). enabled=False: back to one process."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
        self.context_parallel = dict(group=group, layout=layout) if enabled else None
        self.context_parallel_size = _resolve_group(group, None)[2] if enabled else 1  # W
        for block in self.transformer.h:
            block.attn.context_parallel = self.context_parallel
        return self

    def new_kv_caches(self, batch_size: int) -> List[KVCache]:
        """Empty caches, one per layer, for up to block_size tokens."""
        c = self.config
        dtype = self.lm_head.weight.dtype
        return [KVCache(batch_size, c.n_kv_head or c.n_head, c.block_size, c.n_embd // c.n_head, dtype)
                for _ in range(c.n_layer)]

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                kv_caches: Optional[List[KVCache]] = None,
                positions: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Logits (B, T, vocab_size) of the token after each of idx (B, T), and their loss against targets.

        With kv_caches, idx continues the tokens already cached (their positions follow on), and its keys and
        values are cached in turn. positions (T,) int64: the tokens' positions in the sequence, for the rotary
        angles (default 0..T-1 after the cached ones; with context parallelism, this rank's shard_positions of a
        sequence of W·T tokens).
        """
        B, T = idx.size()
        start = kv_caches[0].length if kv_caches is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(f"{start} cached + {T} new tokens exceed the model's context of {self.config.block_size}")
        if self.context_parallel is not None:
            if kv_caches is not None:
                raise ValueError("a context-parallel model runs without KV caches (training, or a prefill)")
            n_total = self.context_parallel_size * T  # this rank's T tokens of the whole sequence's W·T
            if n_total > self.config.block_size:
                raise ValueError(f"{n_total} tokens ({self.context_parallel_size} ranks x {T}) exceed the model's "
                                 f"context of {self.config.block_size}")
            if positions is None:
                positions = shard_positions(n_total, device=idx.device, **self.context_parallel)
        if positions is None:
            rotary = self.rope_cos[start:start + T], self.rope_sin[start:start + T]  # (T, 1, 1, hs/2) each
        else:  # any positions (a shard's are not consecutive): gathered rows of the tables
            if positions.shape != (T,):
                raise ValueError(f"positions must have shape (T,) = ({T},); got {tuple(positions.shape)}")
            rotary = self.rope_cos[positions], self.rope_sin[positions]  # (T, 1, 1, hs/2) each
        x = self.transformer.wte(idx)  # (B, T, C)
        for i, block in enumerate(self.transformer.h):
            x = block(x, rotary, kv_caches[i] if kv_caches is not None else None)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def set_block_size(self, block_size: int) -> "GPT":
        """The longest context to run with (the KV caches' size). Rotary positions exist for any length, but the
        model writes well only as far as it was trained to read."""
        c = self.config
        c.block_size = block_size
        cos, sin = rotary_tables(block_size, c.n_embd // c.n_head, c.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)  # not saved: they follow from the config
        self.register_buffer("rope_sin", sin, persistent=False)
        return self

    @torch.inference_mode()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
                 generator: Optional[torch.Generator] = None) -> Iterator[torch.Tensor]:
        """Yields max_new_tokens sampled tokens, (B,) each, one at a time, continuing the prompt idx (B, T).

        The prompt is prefilled in one forward (Tq = T against an empty cache); each further token is one forward
        of that single token against the cache. When the cache is full (block_size tokens), it restarts from the
        last half of the context, prefilled once: nanoGPT crops its input to the last block_size tokens, and so
        recomputes them all for every token; here each token still costs O(block_size).
        """
        if idx.size(1) == 0:
            raise ValueError("generate needs a prompt of at least one token")
        block_size = self.config.block_size
        tokens = idx[:, -block_size:]  # (B, T): the context the cache holds
        kv_caches = self.new_kv_caches(idx.size(0))
        logits, _ = self(tokens, kv_caches=kv_caches)  # prefill
        for step in range(max_new_tokens):
            next_token = sample_next(logits[:, -1, :], temperature, top_k, generator)  # (B,)
            yield next_token
            if step == max_new_tokens - 1:
                break
            tokens = torch.cat((tokens, next_token[:, None]), dim=1)
            if kv_caches[0].length == block_size:
                tokens = tokens[:, -(block_size // 2):]
                kv_caches = self.new_kv_caches(idx.size(0))
                logits, _ = self(tokens, kv_caches=kv_caches)
            else:
                logits, _ = self(next_token[:, None], kv_caches=kv_caches)  # decode: Tq = 1


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of logits (B, V), from softmax(logits / temperature) over the top_k; argmax if temperature 0.

    Inverse-CDF sampling with exactly one uniform draw per row: the random stream does not depend on the
    probabilities, so two runs that differ only by float32 rounding of the logits (our kernels vs PyTorch's)
    pick a different token only when the draw falls between their two CDFs.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, [-1]]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    cdf = torch.softmax(logits, dim=-1).cumsum(dim=-1)  # (B, V)
    u = torch.rand(logits.size(0), 1, generator=generator, dtype=cdf.dtype)  # (B, 1)
    return torch.searchsorted(cdf, u).squeeze(1).clamp_(max=logits.size(-1) - 1)  # (B,)


class CharVocab:
    """The model's alphabet: token i is the i-th character of `chars`."""

    def __init__(self, chars: str):
        self.chars = chars
        self._index = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharVocab":
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> List[int]:
        unknown = sorted(set(text) - self._index.keys())
        if unknown:
            raise ValueError(f"characters not in the model's vocabulary: {''.join(unknown)!r}; "
                             f"it knows {self.chars!r}")
        return [self._index[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


# ---------------------------------------------------------------------------------------------------------
# Checkpoints, and the models shipped in cs149gpt/models/
# ---------------------------------------------------------------------------------------------------------
def save_checkpoint(path, model: GPT, vocab: CharVocab, **info) -> None:
    """config + weights + vocabulary in one file (plain types and tensors, loadable with weights_only=True)."""
    torch.save({"config": asdict(model.config), "model": model.state_dict(), "vocab": vocab.chars, "info": info}, path)


def load_checkpoint(path) -> Tuple[GPT, CharVocab, dict]:
    """The model (in eval mode) and vocabulary saved by save_checkpoint, and the training info stored with them."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    model = GPT(GPTConfig(**checkpoint["config"]))
    model.load_state_dict(checkpoint["model"])
    return model.eval(), CharVocab(checkpoint["vocab"]), checkpoint.get("info", {})


@dataclass(frozen=True)
class Pretrained:
    file: str  # in cs149gpt/models/
    block_size: int  # the context this name runs with: the checkpoint's own, or a shorter one
    description: str


# Upstream's names, by context length: one checkpoint, trained on 256- then 2048-character windows
# (cs149gpt/models/README.md), run with a KV cache of that many characters.
PRETRAINED = {
    f"shakes{n}": Pretrained("shakespeare_char.pt", n, f"the Shakespeare model with a context of {n} characters")
    for n in (128, 256, 1024, 2048)
}


def load_pretrained(name: str) -> Tuple[GPT, CharVocab]:
    """A shipped model by name (PRETRAINED), in eval mode, and its vocabulary."""
    if name not in PRETRAINED:
        raise KeyError(f"no model {name!r}; the shipped models are {', '.join(PRETRAINED)}")
    entry = PRETRAINED[name]
    model, vocab, _ = load_checkpoint(MODELS_DIR / entry.file)
    return model.set_block_size(entry.block_size), vocab
