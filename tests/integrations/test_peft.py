"""PEFT's adapters on a transformers model, as their users attach them (`peft.get_peft_model`): per-sample norms of the
trainable adapter parameters, exact against a float64 loop over the samples, with the plain API and under the Hugging
Face Trainer; DoRA too, whose weight norm runs the adapters on an identity matrix."""
import pytest
import torch
from test_trainers_real_path import HF_RTOL, SEQ, VOCAB, _hf, _hf_args, _llama, _lm_data, hf_own_loss_checks

import gapmon


def _peft():
    return pytest.importorskip("peft", reason="the PEFT tests need peft (CI installs it)")


def _adapted(transformers, peft, seed: int = 0, **config):
    """A tiny float64 Llama with LoRA adapters (their B not zero, so every adapter parameter gets a gradient)."""
    model = peft.get_peft_model(_llama(transformers, seed)[0], peft.LoraConfig(lora_dropout=0.0, r=4, lora_alpha=8,
                                                                               **config))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def _assert_exact_over_the_adapters(model, bookkeeping: bool, named: str) -> None:
    """gapmon's norms (strict: nothing refused) cover every trainable parameter, some of them `named`, and equal the
    float64 loop's."""
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(2))
    psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", bookkeeping=bookkeeping, strict=True)
    _loss(model, ids).backward()
    got, cov = psn.local_norms(), psn.coverage()
    psn.close()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(cov["covered"]) == trainable and any(named in n for n in trainable)
    torch.testing.assert_close(got, _loop(model, ids, trainable), rtol=1e-10, atol=1e-12)


def _loss(model, ids):
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


def _loop(model, ids, covered):
    norms = []
    for i in range(ids.shape[0]):
        model.zero_grad()
        _loss(model, ids[i:i + 1]).backward()
        norms.append(sum(p.grad.square().sum() for n, p in model.named_parameters() if n in covered) ** 0.5)
    return torch.stack(norms)


@pytest.mark.parametrize("bookkeeping", [False, True], ids=["hooks", "bookkeeping"])
@pytest.mark.parametrize("config", [
    dict(target_modules=["q_proj", "v_proj"]),
    dict(target_modules="all-linear"),
    dict(target_modules=["q_proj", "k_proj", "o_proj", "gate_proj"], use_rslora=True, bias="lora_only"),
    dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
], ids=["q-v", "all-linear", "rslora-bias", "modules-to-save"])
def test_lora_adapters_are_exact(config, bookkeeping):
    transformers, peft = _hf(), _peft()
    model = _adapted(transformers, peft, **config)
    _assert_exact_over_the_adapters(model, bookkeeping, "lora_A")


@pytest.mark.parametrize("bookkeeping", [False, True], ids=["hooks", "bookkeeping"])
@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["embed_tokens", "q_proj"]], ids=["projections", "embedding"])
def test_dora_is_exact(bookkeeping, targets):
    """DoRA scales the adapted output by magnitude / ||W + BA|| (per output row), the norm formed by running lora_A and
    lora_B on an identity matrix every sample shares and detached: that call adds nothing to their gradients, so it is
    passed over, and the magnitude vector (divided by the detached norm, then multiplied with the batch) is followed
    as a free parameter. On an embedding, its A and B (ParameterDict entries) are also multiplied together into that
    norm, detached: a use no rule follows, which adds nothing since no gradient comes back through it. Every adapter
    parameter is covered and exact (strict: nothing refused)."""
    transformers, peft = _hf(), _peft()
    model = _adapted(transformers, peft, target_modules=targets, use_dora=True)
    with torch.no_grad():  # magnitudes away from the weight norms they start at, so that the scale is not 1
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1.0 + 0.5 * torch.rand(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype))
    _assert_exact_over_the_adapters(model, bookkeeping, "lora_magnitude_vector")


@pytest.mark.parametrize("bookkeeping", [False, True], ids=["hooks", "bookkeeping"])
def test_lora_on_the_embedding_is_exact(bookkeeping):
    """LoRA on the token embedding keeps its factors in ParameterDicts (no rule: free parameters, followed in the
    forward): A.T is a table looked up by id (its per-sample norms by id, never formed whole), B a product with the
    batch."""
    transformers, peft = _hf(), _peft()
    model = _adapted(transformers, peft, target_modules=["embed_tokens", "q_proj"])
    _assert_exact_over_the_adapters(model, bookkeeping, "lora_embedding_A")


def _fsdp2_worker(rank: int, world: int):
    import peft
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ids = torch.randint(0, VOCAB, (6, SEQ), generator=torch.Generator().manual_seed(5))
    mesh = init_device_mesh("cpu", (world,))
    local = torch.arange(6)[rank::world]
    for config in (dict(target_modules=["q_proj", "v_proj"], use_dora=True),
                   dict(target_modules=["embed_tokens", "q_proj"])):
        reference, model = _adapted(transformers, peft, **config), _adapted(transformers, peft, **config)
        for block in model.base_model.model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        psn = gapmon.PerSampleGradNorms(model, loss_reduction="sum", strict=True)
        _loss(model, ids[local]).backward()
        _, got = psn.global_norms(local)
        covered = set(psn.coverage()["covered"])
        psn.close()
        trainable = {n for n, p in reference.named_parameters() if p.requires_grad}
        assert covered == trainable
        torch.testing.assert_close(got, _loop(reference, ids, trainable), rtol=1e-9, atol=1e-12,
                                   msg=lambda m, c=config: f"{c}: {m}")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dora_and_lora_on_the_embedding_under_fsdp2_per_block():
    """FSDP2 over each decoder block and the root (2 gloo processes, different samples per rank): DoRA (its adapters
    run on an identity matrix inside a sharded block, its magnitude a free parameter unsharded by FSDP2's hooks) and
    LoRA on the embedding (a ParameterDict's table looked up by id) give the float64 loop's norms, nothing refused."""
    _hf(), _peft()
    from helpers import run_distributed

    run_distributed(_fsdp2_worker, 2)


@pytest.mark.slow
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_lora_under_the_huggingface_trainer_gives_each_samples_own_norm(tmp_path, dora):
    """The Trainer with a PEFT model (only the adapters train), accumulating 2 micro-batches: the norms are those of
    each sample's own mean token loss over the adapter parameters (DoRA's magnitude vectors among them)."""
    transformers, peft = _hf(), _peft()
    from gapmon.integrations.huggingface import attach

    def make(transformers, seed=0):
        return _adapted(transformers, peft, seed, target_modules=["q_proj", "v_proj", "down_proj"], use_dora=dora), None

    model, _ = make(transformers)
    args = _hf_args(transformers, tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
                    max_grad_norm=0.0, learning_rate=1e-2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_lm_data(12))
    callback = attach(trainer, interval=1, per_sample_grad_norms=True)
    checks = hf_own_loss_checks(transformers, trainer, model, callback, make)
    trainer.train()
    cov = callback.monitor.per_sample.coverage()
    assert not cov["uncovered"] and any("lora_B" in n for n in cov["covered"])
    assert not dora or any("lora_magnitude_vector" in n for n in cov["covered"])
    assert len(checks) == 2
    for got, want in checks:
        assert len(got) == 4
        assert got == pytest.approx(want, rel=HF_RTOL)
