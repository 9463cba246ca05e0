"""cuflash as a Hugging Face transformers attention implementation, against "sdpa".

A tiny Llama-style model (2 layers, 4 query heads, 2 kv heads: grouped-query)
is built from a config with random weights (nothing downloaded); one copy runs
``attn_implementation=cuflash.transformers.ATTN_IMPLEMENTATION``, the other
transformers' own ``"sdpa"``, with the same weights.  Padded tokens' outputs
are not compared (each implementation fills them with something else).
"""
import copy

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
pytest.importorskip("transformers", reason="transformers is not installed")

import cuflash.transformers as ctf  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

VOCAB = 97


def models(dtype=torch.float64, **config):
    """(cuflash model, sdpa model) with the same random weights."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, **config)
    torch.manual_seed(0)
    ref = LlamaForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="sdpa",
                                        dtype=dtype)
    ours = LlamaForCausalLM._from_config(copy.deepcopy(cfg),
                                         attn_implementation=ctf.ATTN_IMPLEMENTATION, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == ctf.ATTN_IMPLEMENTATION
    assert ref.config._attn_implementation == "sdpa"
    return ours, ref


@pytest.fixture
def calls(monkeypatch):
    """The (q_len, kv_len, mask given) of every call of cuflash's attention function."""
    seen = []
    forward = ctf.attention_forward

    def spy(module, query, key, value, attention_mask, **kw):
        seen.append((query.shape[2], key.shape[2], attention_mask is not None))
        return forward(module, query, key, value, attention_mask, **kw)
    monkeypatch.setattr(ctf, "attention_forward", spy)
    ctf.register()
    yield seen
    monkeypatch.undo()
    ctf.register()


def padded_batch(rng):
    ids = torch.tensor(rng.integers(0, VOCAB, (3, 13)))
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[1, 8:] = 0      # right padding
    mask[2, :4] = 0      # left padding
    return ids, mask


def test_padded_batch_forward_and_backward_match_sdpa(rng, calls):
    ours, ref = models(torch.float64)
    ids, mask = padded_batch(rng)
    valid = mask.bool()
    out = ours(input_ids=ids, attention_mask=mask).logits
    want = ref(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(out[valid], want[valid], rtol=1e-10, atol=1e-10)
    assert calls and all(mask_given for _, _, mask_given in calls)
    # without the mask the left-padded row would read its padding: the mask is applied
    unmasked = ours(input_ids=ids).logits
    assert (unmasked[2][valid[2]] - want[2][valid[2]]).abs().max() > 1e-3
    w = torch.linspace(-1, 1, VOCAB, dtype=torch.float64)
    for model, logits in ((ours, out), (ref, want)):
        (logits[valid] * w).sum().backward()
    for (name, p), (_, p_ref) in zip(ours.named_parameters(), ref.named_parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-8, atol=1e-10, msg=name)


def test_float32_training_step_matches_sdpa(rng):
    ours, ref = models(torch.float32, attention_dropout=0.0)
    ids, mask = padded_batch(rng)
    labels = ids.masked_fill(mask == 0, -100)
    losses = []
    for model in (ours, ref):
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run = []
        for _ in range(2):
            opt.zero_grad()
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    assert losses[0][1] < losses[0][0]
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=1e-5,
                               atol=0)


def test_packed_sequences_run_without_padding(rng, calls):
    """Three sequences packed in one row (position_ids restart; or cu_seq_lens as
    DataCollatorWithFlattening gives them): each attends to itself only."""
    ours, ref = models(torch.float64)
    lens = [5, 3, 7]
    ids = torch.tensor(rng.integers(0, VOCAB, (1, sum(lens))))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    alone = torch.cat([ref(input_ids=part).logits for part in ids.split(lens, 1)], 1)
    packed = ours(input_ids=ids, position_ids=pos).logits
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10)
    cu = torch.tensor([0, 5, 8, 15], dtype=torch.int32)
    flat = ours(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                max_length_q=7, max_length_k=7).logits
    torch.testing.assert_close(flat, alone, rtol=1e-10, atol=1e-10)
    assert all(not mask_given for _, _, mask_given in calls)


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_with_kv_cache_matches_sdpa(rng, calls, cache, padded):
    """Greedy generation: the same tokens and scores.  A static cache has more slots than
    tokens; unpadded, transformers drops the all-ones mask and cuflash's mask function
    limits the keys to the written slots."""
    ours, ref = models(torch.float64)
    ids = torch.tensor(rng.integers(0, VOCAB, (2, 6)))
    mask = torch.ones(2, 6, dtype=torch.long)
    if padded:
        mask[0, :2] = 0      # left padding, as for generation
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, output_scores=True,
              return_dict_in_generate=True, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    got = ours.generate(ids, **kw)
    want = ref.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    # the prompt once, then one query per step against the growing cache
    assert calls[0][0] == 6 and any(q_len == 1 and kv_len > 6 for q_len, kv_len, _ in calls)


def test_unpadded_model_compiles_whole(rng):
    """Without padding the attention is flash_attn_func: the model traces with no graph break."""
    torch._dynamo.reset()
    ours, _ = models(torch.float32)
    ids = torch.tensor(rng.integers(0, VOCAB, (2, 9)))
    fn = torch.compile(lambda ids: ours(input_ids=ids, use_cache=False).logits, fullgraph=True,
                       backend="aot_eager")
    torch.testing.assert_close(fn(ids), ours(input_ids=ids, use_cache=False).logits,
                               rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()


def test_refusals_are_clear():
    ours, _ = models(torch.float32)
    q = torch.zeros(1, 4, 3, 16)
    k = torch.zeros(1, 2, 3, 16)
    attn = ours.model.layers[0].self_attn
    with pytest.raises(ValueError, match="attention sinks"):
        ctf.attention_forward(attn, q, k, k, None, s_aux=torch.zeros(4))
    with pytest.raises(ValueError, match="2-D padding mask"):
        ctf.attention_forward(attn, q, k, k, torch.zeros(1, 1, 3, 3))
    with pytest.warns(UserWarning, match="no attention weights"):
        ctf.attention_forward(attn, q, k, k, None, output_attentions=True)
