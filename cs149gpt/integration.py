"""Plugging our kernel into code written for torch's SDPA: torch.nn.functional, and Hugging Face transformers.

    import cs149gpt
    with cs149gpt.sdpa_installed():          # F.scaled_dot_product_attention is ours inside, torch's after
        model(**batch)
    cs149gpt.install_sdpa() / cs149gpt.restore_sdpa()   # the same, without the scope

    cs149gpt.register_transformers()         # once; then
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="cs149gpt")

Either way a call our kernel cannot compute exactly as torch would (a learned mask, float64, float32 on CUDA, ...)
goes to torch's own SDPA: `cs149gpt.uses_our_kernel(...)` says which. The installed function keeps the rest of torch's
contract (cs149gpt.scaled_dot_product_attention's docstring): CausalBias masks run our kernel's causal alignments;
torch.nn.attention.sdpa_kernel is honoured, ours being the FLASH_ATTENTION backend (a selection without it gets
torch's function); torch.autocast casts the inputs as for torch's SDPA, and ours runs on them; torch.jit.script
of modules that call it (nn.MultiheadAttention, nn.TransformerEncoder...) runs ours through the operator
torch.ops.cs149gpt.scaled_dot_product_attention.

transformers' flash path (FlashAttention's function API: unpadded varlen batches, packed training, generate) on
cs149gpt.flash_attn, one line (register_transformers_flash's docstring says what runs and what transformers refuses):

    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=cs149gpt.integration.register_transformers_flash())

Training with the sequence sharded over the ranks of a torch.distributed group (context parallelism): every
attention call is cs149gpt.distributed.ring_attention on the rank's slice, the rotary embeddings take the slice's
global positions (register_transformers_ring's docstring has the recipe):

    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=register_transformers_ring(group))

transformers is optional: imported only by the register_* functions.
"""
import contextlib
import functools

import torch
import torch.nn.functional as F

from cs149gpt import ops

TRANSFORMERS_NAME = "cs149gpt"


def install_sdpa() -> None:
    """Makes torch.nn.functional.scaled_dot_product_attention ours (cs149gpt.scaled_dot_product_attention) for
    every caller that looks it up there at call time (transformers' "sdpa" attention, nanoGPT, ...). Code that
    imported the function itself before (`from torch.nn.functional import scaled_dot_product_attention`) keeps
    torch's. Our function falls back to torch's own, captured at import, so this never recurses. TorchScript
    compiles torch's functions (F.multi_head_attention_forward, ...) once a process, with the SDPA found then:
    modules first scripted before install_sdpa() run torch's SDPA in that process, those first scripted after it
    ours (torch.ops.cs149gpt.scaled_dot_product_attention), restore_sdpa() notwithstanding."""
    F.scaled_dot_product_attention = ops.scaled_dot_product_attention


def restore_sdpa() -> None:
    """Puts torch's own scaled_dot_product_attention back into torch.nn.functional."""
    F.scaled_dot_product_attention = ops._torch_sdpa


@contextlib.contextmanager
def sdpa_installed():
    """Ours as torch.nn.functional.scaled_dot_product_attention inside the `with`; whatever was there before
    (torch's, or another patch) is put back on the way out, exceptions included."""
    previous = F.scaled_dot_product_attention
    install_sdpa()
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous


def _transformers_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                            position_bias=None, **kwargs):
    """transformers' attention-function signature (transformers.integrations.sdpa_attention.sdpa_attention_forward,
    which it follows) on our SDPA: query (B, H, Nq, d), key/value (B, Hkv, Nk, d), attention_mask from the "sdpa"
    mask function (a bool (B or 1, 1, Nq, Nk), or None when is_causal says it all; eager's float mask for the
    models transformers does not run on "sdpa", _transformers_mask). GQA runs without repeating
    the kv heads, masked or not; a learned sink per head (s_aux / sinks) as _attention_with_sinks says. Returns
    (out (B, Nq, H, d), None). Under torch.autocast, as torch's SDPA: the inputs in autocast's dtype (rotary
    embeddings leave q and k in float32 beside a v in bfloat16), our kernel on them, out in that dtype."""
    softcap = kwargs.get("softcap")
    if kwargs.get("output_attentions", False):
        raise ValueError("attn_implementation='cs149gpt' computes no attention weights; use 'eager' for "
                         "output_attentions=True")
    q_length = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As transformers' sdpa: the causal flag only without a mask, and never for one query row (it sees all keys).
    is_causal = q_length > 1 and attention_mask is None and is_causal
    if position_bias is not None:  # T5-style learned biases: one additive mask with the causal/padding mask in it
        from transformers.integrations.sdpa_attention import create_position_bias_mask

        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask == 0  # our compiled-mode 0/−inf mask as the bool one: the same path either way

        attention_mask = create_position_bias_mask(position_bias, attention_mask, is_causal, query, key)
        is_causal = False
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if softcap is not None:  # (Gemma 2) the flash kernel's softcap; torch's SDPA has none
        if sinks is not None:
            raise ValueError("attn_implementation='cs149gpt' takes `softcap` or attention sinks, not both; use 'eager'")
        out = ops.attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                            is_causal=bool(is_causal), softcap=float(softcap))
        return out.transpose(1, 2).contiguous(), None
    if sinks is not None:
        out = _attention_with_sinks(query, key, value, attention_mask, sinks, dropout, scaling, bool(is_causal))
        return out.transpose(1, 2).contiguous(), None
    out = ops.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                           scale=scaling, is_causal=bool(is_causal),
                                           enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _attention_with_sinks(query, key, value, attention_mask, sinks, dropout, scaling, is_causal):
    """Attention with a learned sink per head (gpt-oss and others pass it as s_aux or sinks): one more logit in
    each row's softmax, whose weight is dropped. With l = Σ_j exp(s_j) over the keys a row sees and lse = log l,

        out = Σ_j exp(s_j) v_j / (l + exp(sink)) = O · l / (l + exp(sink)) = O · sigmoid(lse − sink),

    O and lse being our kernel's: exact, and only a rescaling of its output. Our lse takes no gradient (the backward
    would need its term in dS), so a call that needs gradients or dropout, or one our kernel does not take, runs as
    transformers' eager attention does (the logits and the sink through one softmax, O(N²) memory)."""
    enable_gqa = key.shape[1] != query.shape[1]
    rows = _sink_rows(sinks, query.shape[:-1])  # (B, H, Nq): each row's sink logit
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, sinks))
    if (not needs_grad and dropout == 0.0
            and ops.uses_our_kernel(query, key, value, attention_mask, 0.0, is_causal, scaling, enable_gqa)):
        out, lse = ops.attention(query, key, value, scale=scaling, is_causal=is_causal, attn_mask=attention_mask,
                                 return_lse=True)
        sink = rows.to(lse.dtype)
        # The sink is one more logit, so the project's rule holds for it: +inf makes the row NaN (as in eager's softmax;
        # sigmoid(lse − inf) would be 0), NaN stays NaN, −inf weighs 0.
        weight = torch.sigmoid(lse - sink).masked_fill(sink == float("inf"), float("nan"))
        return (out.float() * weight.unsqueeze(-1)).to(out.dtype)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    logits = torch.matmul(query, key.transpose(-1, -2)) * scale
    if is_causal:
        n_q, n_k = logits.shape[-2:]
        shown = torch.ones(n_q, n_k, dtype=torch.bool, device=logits.device).tril()
        logits = logits.masked_fill(~shown, float("-inf"))
    if attention_mask is not None:
        logits = (logits.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool
                  else logits + attention_mask)
    logits = torch.cat([logits, rows.unsqueeze(-1).to(logits.dtype)], dim=-1)
    weights = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    weights = F.dropout(weights, p=dropout, training=dropout > 0.0)
    return torch.matmul(weights.to(value.dtype), value)


def _sink_rows(sinks, rows_shape):
    """The sink logit of every query row, (B, H, Nq): sinks are one per head (H,) (gpt-oss) or per row
    (B, H, Nq) or (B, H, Nq, 1) (computed from the hidden states, as inkling2's); a dim of 1 broadcasts. Any other
    layout is refused rather than broadcast by trailing dims (a (B, Nq, H) tensor with Nq = H would pass)."""
    s = sinks
    if s.dim() == 1 and s.numel() in (1, rows_shape[1]):
        s = s.reshape(1, -1, 1)
    elif s.dim() == 4 and s.shape[-1] == 1:
        s = s[..., 0]
    if s.dim() != 3 or any(n not in (1, want) for n, want in zip(s.shape, rows_shape)):
        raise ValueError(f"attention sinks (s_aux / sinks) must be one per head (H,) or one per query row "
                         f"(B, H, Nq) or (B, H, Nq, 1); got shape {tuple(sinks.shape)} for (B, H, Nq) = "
                         f"{tuple(rows_shape)}")
    return s.expand(rows_shape)


@functools.lru_cache(maxsize=None)
def _takes_sdpa_masks(model_type: str) -> bool:
    """Whether transformers runs models of this type on its "sdpa" attention (the model class's _supports_sdpa):
    only those are written for sdpa's masks. The others build their masks through the same interface, with
    config._attn_implementation's mask function, and use them as eager's additive float mask — a bool one added to
    the scores masks nothing, and None drops the causal mask (bloom, mpt, ... a model-zoo comparison found them)."""
    import transformers
    from transformers.models.auto import modeling_auto

    mappings = [getattr(modeling_auto, n) for n in dir(modeling_auto) if n.endswith("_MAPPING_NAMES")]
    # A sub-model's config (blip_text_model, groupvit_vision_model, ...) goes by its parent's classes.
    for kind in (model_type, *(model_type[:-len(end)] for end in ("_text_model", "_vision_model", "_text", "_vision")
                               if model_type.endswith(end))):
        names = set()
        for mapping in mappings:
            if isinstance(mapping, dict) and kind in mapping:
                names.update([mapping[kind]] if isinstance(mapping[kind], str) else mapping[kind])
        classes = [c for c in (getattr(transformers, n, None) for n in sorted(names)) if hasattr(c, "_supports_sdpa")]
        if classes:
            return all(c._supports_sdpa for c in classes)
    return True  # a type transformers does not map: as before, sdpa's masks


def _transformers_mask(*args, **kwargs):
    """transformers' "sdpa" mask function (a bool mask, None where is_causal suffices), except under torch.compile,
    where the bool mask is handed over as an additive one of 0 and −inf in float32: inductor's CPU code writes a
    (B, 1, Nq, Nk) bool tensor several times slower than a floating one (a 4 × 512 × 512 mask: 2.9 vs 0.65 ms on
    a 2-core AMD EPYC; 10 ms a layer inside a compiled Llama, more than our attention), and our kernel takes either as
    the same key ranges (csrc/mask_ranges.cpp), hiding exactly the same keys. Models that transformers does
    not run on "sdpa" get its "eager" mask function's float masks, which they are written for (our attention
    function takes those too)."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    config = kwargs.get("config")
    model_type = getattr(config, "model_type", None)
    if isinstance(model_type, str) and not _takes_sdpa_masks(model_type):
        return eager_mask(*args, **kwargs)
    mask = sdpa_mask(*args, **kwargs)
    if mask is not None and mask.dtype == torch.bool and torch.compiler.is_compiling():
        mask = torch.where(mask, 0.0, float("-inf")).to(torch.float32)
    return mask


def register_transformers(name: str = TRANSFORMERS_NAME) -> str:
    """Registers our kernel with Hugging Face transformers (>= 5) as attn_implementation=`name` ("cs149gpt") and
    returns the name; then AutoModel*.from_config / from_pretrained(..., attn_implementation="cs149gpt").

    It puts our attention function in AttentionInterface (GQA without repeating the kv heads, masked or not) and
    transformers' "sdpa" mask function in AttentionMaskInterface (boolean masks, None where is_causal suffices;
    under torch.compile the same mask as 0/−inf float32, which inductor's CPU code writes several times faster than
    a bool one and our kernel reads as the same key ranges). Llama (GQA), GPT-2 and BERT built that way run every
    attention call on our kernel, with torch's outputs: padded batches, padded and static-cache generate, training
    with dropout, torch.compile (tests/test_real_models.py).

    - Attention sinks (gpt-oss's s_aux: a learned logit per head in every softmax; or one per query row,
      (B, H, Nq) or (B, H, Nq, 1)) only rescale our output, out = O · sigmoid(lse − sink), exactly, so padded
      batches and generate run on our kernel with eager attention's results. A call that needs gradients (our lse
      takes none) or dropout computes as eager attention does. A sink follows the non-finite rule as one more
      logit (+inf or NaN: the row is NaN; −inf: no sink).
    - Models that transformers does not run on "sdpa" (_supports_sdpa = False: bloom, mpt, xglm, longformer,
      deepseek_v4, gpt-oss, ...) get its "eager" mask function's additive float masks, which they are written
      for; our attention function takes those too (as additive masks, without a bool mask's tile skipping).
    - Models that pick an attention class by name (falcon, gpt_neo, git) raise transformers' KeyError:
      'cs149gpt'; for those use attn_implementation="sdpa" inside `with cs149gpt.sdpa_installed():`.
    - output_attentions=True, and softcap together with attention sinks, are a ValueError (use "eager").

    Needs transformers, imported only here: ImportError naming it otherwise. Calling it again is harmless.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError("cs149gpt.register_transformers() needs Hugging Face transformers (pip install "
                          "transformers)") from e
    AttentionInterface.register(name, _transformers_attention)
    AttentionMaskInterface.register(name, _transformers_mask)
    return name


FLASH_TRANSFORMERS_NAME = "cs149gpt_fa"


def _flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                             sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' flash attention function (transformers.integrations.flash_attention.flash_attention_forward and
    its _flash_attention_forward, whose dispatch it follows) on cs149gpt.flash_attn: query (B, H, Nq, d), key/value
    (B, Hkv, Nk, d), read in FlashAttention's (B, N, H, d) layout as transposed views. One call of ours per call:

    - attention_mask (B, Nk), the 2D padding mask of transformers' flash mask function: the tokens it keeps are
      gathered into one packed batch, flash_attn_varlen_func runs on it, and the output is scattered back (padding
      rows get 0, as in transformers' unpadding);
    - cu_seq_lens_q/k and max_length_q/k (DataCollatorWithFlattening(return_flash_attn_kwargs=True)): varlen on
      the flattened batch as given;
    - position_ids of packed sequences in one row (DataCollatorWithFlattening without those kwargs): varlen, each
      sequence starting where its position is 0;
    - otherwise flash_attn_func (bottom-right causal: a decode step's query row sees the whole cache).

    sliding_window w gives window_size (w - 1, w - 1) when the keys outrun it (transformers' mapping), softcap goes
    to the kernel, dropout is FlashAttention's dropout_p. Returns (out (B, Nq, H, d), None)."""
    from cs149gpt import flash_attn

    if kwargs.get("output_attentions", False):
        raise ValueError(f"attn_implementation={FLASH_TRANSFORMERS_NAME!r} computes no attention weights; use "
                         "'eager' for output_attentions=True")
    if s_aux is not None:
        raise NotImplementedError("s_aux: attention sinks are not in FlashAttention-2's API; use "
                                  "attn_implementation='cs149gpt' (register_transformers)")
    batch, n_q = query.shape[0], query.shape[2]
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, N, H, d) views
    n_k = k.shape[1]
    fa_kwargs = dict(dropout_p=dropout, softmax_scale=scaling,
                     causal=bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)),
                     softcap=0.0 if softcap is None else float(softcap))
    if sliding_window is not None and n_k > sliding_window:
        fa_kwargs["window_size"] = (sliding_window - 1, sliding_window - 1)

    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(f"attn_implementation={FLASH_TRANSFORMERS_NAME!r} takes transformers' flash masks, 2D "
                             f"(batch, kv_len) padding masks; got shape {tuple(attention_mask.shape)}")
        keep_k = attention_mask[:, -n_k:].bool()
        keep_q = torch.ones(batch, 1, dtype=torch.bool, device=q.device) if n_q == 1 else keep_k[:, -n_q:]
        (rows_q, cu_q, max_q), (rows_k, cu_k, max_k) = _unpadding(keep_q), _unpadding(keep_k)
        out = flash_attn.flash_attn_varlen_func(
            q.reshape(batch * n_q, *q.shape[2:])[rows_q], k.reshape(batch * n_k, *k.shape[2:])[rows_k],
            v.reshape(batch * n_k, *v.shape[2:])[rows_k], cu_q, cu_k, max_q, max_k, **fa_kwargs)
        padded = out.new_zeros(batch * n_q, *out.shape[1:]).index_copy(0, rows_q, out)
        return padded.view(batch, n_q, *out.shape[1:]), None

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is None or cu_k is None or max_q is None or max_k is None:
        cu_q = cu_k = _packed_cu_seqlens(kwargs.get("position_ids"), batch)
        if cu_q is not None:
            max_q = max_k = int((cu_q[1:] - cu_q[:-1]).max())
    if cu_q is not None:
        out = flash_attn.flash_attn_varlen_func(
            q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
            cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k), **fa_kwargs)
        return out.view(batch, n_q, *out.shape[1:]), None

    return flash_attn.flash_attn_func(q, k, v, **fa_kwargs), None


def _unpadding(keep):
    """keep (B, N) bool: the flat row indices (B·N) of the kept tokens, cu_seqlens (B + 1,) int32, the longest."""
    lengths = keep.sum(-1, dtype=torch.int32)
    rows = keep.flatten().nonzero().flatten()
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return rows, cu_seqlens, int(lengths.max())


def _packed_cu_seqlens(position_ids, batch):
    """cu_seqlens (S + 1,) int32 of the sequences packed in one row of position_ids (1, N), each starting at a
    position 0; None unless the row holds more than one run 0, 1, 2, ... (transformers' _is_packed_sequence)."""
    if position_ids is None or batch != 1 or position_ids.shape[-1] == 1:
        return None
    pos = position_ids.reshape(-1)
    if torch.equal(pos, torch.arange(pos.numel(), device=pos.device) + pos.min()):
        return None
    starts = (pos == 0).nonzero().flatten().to(torch.int32)
    return torch.cat([starts, starts.new_tensor([pos.numel()])])


def register_transformers_flash(name: str = FLASH_TRANSFORMERS_NAME) -> str:
    """Registers cs149gpt.flash_attn as transformers' (>= 5) flash path under attn_implementation=`name`
    ("cs149gpt_fa") and returns the name, so one line builds a model on it:

        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=register_transformers_flash())

    It puts a flash attention function (_flash_attention_forward: transformers' flash wrapper's dispatch, over
    flash_attn_func and flash_attn_varlen_func) in AttentionInterface and transformers' own flash mask function
    (2D padding masks, None when causality says it all) in AttentionMaskInterface; public registrations only,
    nothing of transformers is patched. Every attention call then runs one cs149gpt op (tests/
    test_transformers_flash.py counts them with torch.profiler, against "eager" outputs and gradients):
    padded batches (unpadded to varlen), generate (prefill, then decode steps over the cache), padding-free
    training with DataCollatorWithFlattening (cu_seq_lens_* kwargs, or sequences found from position_ids),
    forward and backward; Llama (GQA) and Gemma-2 (softcap, sliding windows).

    What transformers 5 does not let through:
    - A name containing "flash" is transformers' own flash path, whose functions are resolved only from the
      flash-attn packages (CUDA-only), Ascend NPU, or a hub kernel "org/repo" fetched by the `kernels` package
      (modeling_flash_attention_utils._lazy_imports); any other flash name fails at model construction with
      "Could not find the currently requested flash attention implementation". Hence a name without "flash".
    - Continuous batching (generate_batch, paged cache) accepts only "paged|eager", "sdpa" and names containing
      "flash" (ContinuousBatchingManager.switch_to_cb_friendly_attn): ValueError "Implementation cs149gpt_fa is
      not supported for continuous batching". attn_implementation="sdpa" under `with sdpa_installed():` runs it on
      our SDPA instead.
    - ALiBi: no model routes alibi_slopes through the flash path (BLOOM and MPT add their ALiBi tensor in
      eager code that never calls the attention interface; Falcon with alibi=True refuses flash attention).
    - Attention sinks (s_aux) and output_attentions=True raise (FlashAttention-2's API has neither).

    Needs transformers, imported only here: ImportError naming it otherwise. Calling it again is harmless."""
    if "flash" in name:
        raise ValueError(f"name {name!r}: transformers resolves names containing 'flash' to its own flash-attn "
                         "packages or hub kernels, never to a registered function; choose another")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as e:
        raise ImportError("cs149gpt.integration.register_transformers_flash() needs Hugging Face transformers "
                          "(pip install transformers)") from e
    AttentionInterface.register(name, _flash_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


RING_TRANSFORMERS_NAME = "cs149gpt_ring"


def _ring_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                            *, ring_group=None, ring_mesh_dim=None, ring_layout="zigzag", **kwargs):
    """transformers' attention-function signature on cs149gpt.distributed.ring_attention: query (B, H, n, d),
    key/value (B, Hkv, n, d) are this rank's n tokens of a sequence sharded over ring_group in ring_layout; causal
    in global positions unless the module says is_causal=False. position_ids, when the model passes them (Llama
    does), must be the slice's global positions (shard_positions): anything else, such as the 0..n-1 transformers
    numbers a slice with when none are given, would give the rotary embeddings the wrong angles, so every rank
    raises ValueError (one all_gather of a flag per call decides). Returns (out (B, n, H, d), None)."""
    from cs149gpt.distributed import ring_attention, shard_positions

    unsupported = {"output_attentions": kwargs.get("output_attentions") or None, "sliding_window":
                   kwargs.get("sliding_window"), "softcap": kwargs.get("softcap"), "attention sinks (s_aux)":
                   kwargs.get("s_aux", kwargs.get("sinks")), "dropout": dropout or None,
                   "position_bias": kwargs.get("position_bias")}
    unsupported = [name for name, value in unsupported.items() if value is not None]
    if unsupported:  # the same on every rank (one model, one config)
        raise ValueError(f"attn_implementation={RING_TRANSFORMERS_NAME!r} (ring attention) does not take "
                         f"{', '.join(unsupported)}")
    if attention_mask is not None:  # _ring_mask returns None: only a model that builds its own mask gets here
        raise ValueError(f"attn_implementation={RING_TRANSFORMERS_NAME!r} takes no attention mask (the causal mask "
                         f"is the ring's, in global positions); got one of shape {tuple(attention_mask.shape)}")
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        n_local = query.shape[2]
        group, rank, world_size = _ring_group(ring_group, ring_mesh_dim)
        expected = shard_positions(n_local * world_size, group, layout=ring_layout, device=position_ids.device)
        right = position_ids.shape[-1] == n_local and bool((position_ids.reshape(-1, n_local) == expected).all())
        wrong = _ranks_failing(group, world_size, right, query.device)
        if wrong:
            raise ValueError(f"attn_implementation={RING_TRANSFORMERS_NAME!r}: position_ids must be each rank's "
                             f"global positions, shard_positions({n_local * world_size}, group, layout="
                             f"{ring_layout!r}); rank(s) {wrong} gave others (this rank, {rank}: "
                             f"{position_ids.reshape(-1)[:8].tolist()}...)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = ring_attention(query, key, value, group=ring_group, mesh_dim=ring_mesh_dim, is_causal=bool(causal),
                         scale=scaling, layout=ring_layout)
    return out.transpose(1, 2).contiguous(), None


def _ring_group(group, mesh_dim):
    """(process group, this rank, W) as ring_attention resolves them."""
    from cs149gpt.distributed import _resolve_group

    return _resolve_group(group, mesh_dim)


def _ranks_failing(group, world_size, ok: bool, device) -> list:
    """The ranks of group whose check failed (one all_gather of a flag): every rank learns the same list, so
    every rank raises, and none waits in a ring the others never enter."""
    import torch.distributed as dist

    mine = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)
    flags = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(flags, mine, group=group)
    return [r for r, f in enumerate(flags) if int(f)]


def _ring_mask(*args, attention_mask=None, ring_group=None, ring_mesh_dim=None, **kwargs):
    """The mask function for the ring: None (the ring applies the causal mask in global positions), so
    transformers builds no mask of local length. A 2D padding mask that hides a token is refused on every rank
    (one all_gather of a flag): its local length cannot say which global keys it hides."""
    group, _, world_size = _ring_group(ring_group, ring_mesh_dim)
    ok = attention_mask is None or bool(attention_mask.all())
    device = attention_mask.device if attention_mask is not None else kwargs.get("device", "cpu")
    wrong = _ranks_failing(group, world_size, ok, device)
    if wrong:
        raise ValueError(f"attn_implementation={RING_TRANSFORMERS_NAME!r} takes no padding mask (rank(s) {wrong} "
                         "gave one that hides tokens): shard sequences without padding, one sequence per row")
    return None


def register_transformers_ring(group=None, *, layout: str = "zigzag", mesh_dim=None,
                               name: str = RING_TRANSFORMERS_NAME) -> str:
    """Registers ring attention over group (a ProcessGroup, None for the default one, or a DeviceMesh with mesh_dim)
    with transformers (>= 5) as attn_implementation=`name` ("cs149gpt_ring") and returns the name. Every attention
    call then runs cs149gpt.distributed.ring_attention on the rank's slice of the sequence (causal in global
    positions, GQA without expanding the kv heads, forward and backward). Each rank of the group runs:

        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=register_transformers_ring(group))
        ids = shard_sequence(input_ids, 1, group, layout="zigzag")            # (B, N / W)
        pos = shard_positions(N, group, layout="zigzag")[None]               # (1, N / W): global positions
        labels = shard_sequence(F.pad(input_ids[:, 1:], (0, 1), value=-100), 1, group, layout="zigzag")
        out = model(input_ids=ids, position_ids=pos, labels=labels, shift_labels=labels, use_cache=False,
                    num_items_in_batch=(input_ids[:, 1:] != -100).sum())
        out.loss.backward()          # then all-reduce (sum) the gradients over group

    What transformers needs for it, all through its public arguments:
    - position_ids: the rotary embeddings take them (LlamaRotaryEmbedding), so the slice's global positions give
      every token its angle. Left out, transformers would number the slice 0..n-1; the attention function checks
      the position_ids the model hands it and raises ValueError on every rank if a rank's are not its shard's.
    - shift_labels: the causal-LM loss shifts labels by one inside the slice, which crosses chunk edges; the
      next-token labels shifted on the whole sequence, then sharded, are what the loss must see (shift_labels).
      labels must still be given (any tensor: it only switches the loss on).
    - num_items_in_batch: the whole sequence's count of labels, so the rank's loss is its sum / that count; the
      ranks' losses then add up to the unsharded loss, and their gradients (all-reduced with SUM) to its gradient.
    - The mask: registered here is a mask function that returns None, so transformers builds no mask of local
      length (its own would be causal in local positions, and it reads zigzag position_ids as packed sequences);
      a padding mask is refused (ValueError on every rank). No padding, no packing: one sequence per row, all
      ranks the same length (the whole length divisible by 2·W for "zigzag").
    - use_cache=False (a KV cache of a slice means nothing to the next step); dropout, sliding windows, softcap,
      sinks and output_attentions raise ValueError.

    Registering again (another group, layout) replaces the previous registration of that name. Needs
    transformers, imported only here."""
    from cs149gpt.distributed import LAYOUTS

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}; got {layout!r}")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError("cs149gpt.integration.register_transformers_ring() needs Hugging Face transformers "
                          "(pip install transformers)") from e
    AttentionInterface.register(name, functools.partial(_ring_attention_forward, ring_group=group,
                                                        ring_mesh_dim=mesh_dim, ring_layout=layout))
    AttentionMaskInterface.register(name, functools.partial(_ring_mask, ring_group=group, ring_mesh_dim=mesh_dim))
    return name
