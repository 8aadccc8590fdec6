"""Per-sample norms of Hugging Face model families as their configs build them: GPT-2 (its Conv1D layers, which
merge the tokens into one dim for addmm, and its tied input/output embeddings) and a Llama with
tie_word_embeddings. Exact against a float64 loop over the samples, one backward each; only what gapmon documents
as not per-sample is left out (GPT-2's learned position embeddings: their ids are shared by every sample). Their
RMSNorm copies (Llama's, OLMo 2's float32 product, Gemma's 1 + weight, Qwen 3's per-head q/k norms) are covered.

Needs transformers (CI installs the version pyproject's `ci` extra pins)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import gapmon

VOCAB, SEQ = 37, 8


def _gpt2(transformers):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, attn_pdrop=0.0,
                                  resid_pdrop=0.0, embd_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _tied_llama(transformers):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                   tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg)


def _small(config_class, **extra):
    return config_class(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, max_position_embeddings=16, tie_word_embeddings=True, **extra)


def _olmo2(transformers):  # RMSNorm multiplied in float32, q/k norms over the whole projection
    return transformers.Olmo2ForCausalLM(_small(transformers.Olmo2Config))


def _qwen3(transformers):  # q/k RMSNorms over each head's dims
    return transformers.Qwen3ForCausalLM(_small(transformers.Qwen3Config, head_dim=8))


def _gemma(transformers):  # RMSNorm with 1 + weight, embeddings scaled by sqrt(hidden)
    return transformers.GemmaForCausalLM(_small(transformers.GemmaConfig, head_dim=8))


def _loss(model, ids):
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="sum")


@pytest.mark.slow
@pytest.mark.parametrize("family, left_out", [("gpt2", {"transformer.wpe.weight"}), ("llama-tied", set()), ("olmo2", set()),
                                              ("qwen3", set()), ("gemma", set())])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("bookkeeping", [False, True], ids=["hooks", "bookkeeping"])
def test_hugging_face_families_are_exact(family, left_out, batch, bookkeeping):
    transformers = pytest.importorskip("transformers", reason="needs transformers (CI installs it)")
    torch.manual_seed(0)
    model = {"gpt2": _gpt2, "llama-tied": _tied_llama, "olmo2": _olmo2, "qwen3": _qwen3, "gemma": _gemma}[family](transformers)
    model = model.double()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied, as configured
    ids = torch.randint(0, VOCAB, (batch, SEQ))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", bookkeeping=bookkeeping)
        _loss(model, ids).backward()
        got, cov = psn.local_norms(), psn.coverage()
        psn.close()
    assert set(cov["uncovered"]) == left_out, cov["uncovered_reasons"]
    assert not [w for w in caught if "not per-sample" in str(w.message) and "wpe" not in str(w.message)]
    want = []
    for i in range(batch):
        model.zero_grad()
        _loss(model, ids[i:i + 1]).backward()
        want.append(torch.sqrt(sum(p.grad.square().sum() for n, p in model.named_parameters() if n in cov["covered"])))
    # Gemma forms its norms' weight gradient in float32 in a float64 model (the reference's gradients too): 1e-7.
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-6 if family == "gemma" else 1e-9, atol=1e-12)
