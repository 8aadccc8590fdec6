"""gapmon driven by the real trainers as their users drive them: nothing of the trainer's own changes, the
step's samples are counted as they were, and per-sample norms are those of each sample's own loss
(checked against a float64 loop over the samples, one backward each) whatever the trainer's scaling.

Needs transformers (+ accelerate) and lightning; CI installs the versions pyproject's `ci` extra pins."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from helpers import memory_logger, regression_module

from gapmon.monitor.metric_names import GLOBAL_BATCH_SIZE, per_sample_norm_name

VOCAB, SEQ = 29, 7
# transformers computes the causal-LM loss in float32 (`logits.float()`, a float64 model's too), and a
# token's loss gradient is divided by the step's token count in the Trainer, by the sample's in the
# reference loop: the two round differently at float32's 1e-8. A scaling error is 1e-1 or more.
HF_RTOL = 1e-6


def _hf():
    transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (CI installs it)")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (CI installs it)")
    return transformers


def _llama(transformers, seed: int = 0):
    """A tiny LlamaForCausalLM (untied embeddings), float64."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).double(), cfg


def _gpt2(transformers, seed: int = 0):
    """A tiny GPT2LMHeadModel (Conv1D layers, its embedding tied to its head), float64, without dropout."""
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=16, attn_pdrop=0.0,
                                  resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg).double(), cfg


def _mixtral(transformers, seed: int = 0):
    """A tiny MixtralForCausalLM (a mixture of experts; their eager loop, which runs in float64), float64."""
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                     num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM._from_config(cfg, experts_implementation="eager").double(), cfg


def _lm_data(n: int, seed: int = 1) -> list[dict]:
    """Samples whose number of label tokens differs (-100 where they do not count), so that token-count
    normalisation and a per-sample mean differ."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        labels[: i % 4] = -100  # 0..3 leading tokens ignored
        data.append({"input_ids": ids, "labels": labels})
    return data


def _reference_norms(make_model, state: dict, samples: list[dict], covered: set[str], loss_of) -> list[float]:
    """||grad loss_i|| over the covered parameters, one float64 backward per sample, on a fresh copy."""
    model = make_model()
    model.load_state_dict(state)
    model.train()
    norms = []
    for sample in samples:
        model.zero_grad()
        loss_of(model, sample).backward()
        sq = sum(p.grad.double().square().sum() for n, p in model.named_parameters() if n in covered and p.grad is not None)
        norms.append(float(sq) ** 0.5)
    return norms


def _hf_args(transformers, tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[], save_strategy="no",
                use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, logging_steps=1, seed=0)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _trainer_logs(transformers, tmp_path, data, attach_kwargs=None, **kw):
    """The Trainer's log_history of a run, with gapmon attached (attach_kwargs) or not (None)."""
    from gapmon.integrations.huggingface import attach

    model, _ = _llama(transformers)
    trainer = transformers.Trainer(model=model, args=_hf_args(transformers, tmp_path, **kw), train_dataset=data)
    if attach_kwargs is not None:
        attach(trainer, **attach_kwargs)
    trainer.train()
    return trainer.state.log_history


def test_huggingface_trainer_keeps_its_own_logs_and_counts_the_short_last_batch(tmp_path):
    transformers = _hf()
    data = _lm_data(26)  # batch 4: the epoch's last batch holds 2 samples
    plain = _trainer_logs(transformers, tmp_path / "plain", data, None, num_train_epochs=1)
    with warnings.catch_warnings():
        # Every layer of this Llama has a rule (LlamaRMSNorm's too): nothing may be left out, with a warning or not.
        warnings.filterwarnings("error", message="PerSampleGradNorms", category=RuntimeWarning)
        watched = _trainer_logs(transformers, tmp_path / "gap", data, dict(interval=1), num_train_epochs=1)

    def own(history):  # the Trainer's own entries and keys, gapmon's left out
        return [{k: v for k, v in e.items() if not k.startswith("gap/")} for e in history
                if any(not k.startswith("gap/") and k not in ("epoch", "step") for k in e)]

    plain_own, watched_own = own(plain), own(watched)
    assert len(plain_own) == 7 + 1  # 7 steps logged, then the run summary
    assert [sorted(e) for e in watched_own] == [sorted(e) for e in plain_own]
    for a, b in zip(plain_own, watched_own):
        assert {"loss", "grad_norm", "learning_rate"} <= set(a) or "train_runtime" in a
        for key in ("loss", "grad_norm", "learning_rate", "step", "epoch"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-9, abs=1e-12), key
    batch_sizes = [e[GLOBAL_BATCH_SIZE] for e in watched if GLOBAL_BATCH_SIZE in e]
    assert batch_sizes == [4] * 6 + [2]


@pytest.mark.slow
def test_huggingface_trainer_with_torch_compile_logs_what_it_logs_eagerly(tmp_path):
    """TrainingArguments(torch_compile=True) (the aot_eager backend here): gapmon's metrics, per-sample norms
    included, are the eager run's (the label shift's F.pad reached the batch tracking as aten's constant_pad_nd
    and every layer was refused: norms 0)."""
    transformers = _hf()
    from gapmon.integrations.huggingface import attach

    def run(where, **kw):
        torch._dynamo.reset()
        model, _ = _llama(transformers)
        trainer = transformers.Trainer(model=model, args=_hf_args(transformers, where, max_steps=2,
                                                                  per_device_train_batch_size=2, **kw),
                                       train_dataset=_lm_data(8))
        attach(trainer, interval=1, per_sample_grad_norms=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="PerSampleGradNorms", category=RuntimeWarning)
            trainer.train()
        return [{k: v for k, v in e.items() if k.startswith("gap/")} for e in trainer.state.log_history
                if any(k.startswith("gap/") for k in e)]

    eager = run(tmp_path / "eager")
    compiled = run(tmp_path / "compiled", torch_compile=True, torch_compile_backend="aot_eager")
    assert len(eager) == 2 and eager[0]["gap/per_sample_grad_norm/max"] > 0
    for want, got in zip(eager, compiled):
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("accumulation", [1, 2])
def test_huggingface_label_smoothing_gives_each_samples_own_smoothed_loss(tmp_path, accumulation):
    """label_smoothing_factor: the Trainer takes the labels out of the model's inputs and its LabelSmoother divides the
    step's smoothed token losses by num_items_in_batch; the norms are those of each sample's own smoothed loss (the
    mean over its tokens), whatever the tokens per sample (they were scaled by the micro-batch's share: 0.4-0.6x)."""
    transformers = _hf()
    from transformers.trainer_pt_utils import LabelSmoother

    from gapmon.integrations.huggingface import attach

    model, _ = _llama(transformers)
    seen, checks = [], []

    class Recording(transformers.Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            seen.extend({k: v[i].clone() for k, v in inputs.items()} for i in range(inputs["input_ids"].shape[0]))
            return super().compute_loss(model, inputs, *args, **kwargs)

    args = _hf_args(transformers, tmp_path, max_steps=2, per_device_train_batch_size=2, max_grad_norm=0.0,
                    gradient_accumulation_steps=accumulation, label_smoothing_factor=0.1)
    trainer = Recording(model=model, args=args, train_dataset=_lm_data(8))
    callback = attach(trainer, interval=1, per_sample_grad_norms=True)
    smoother = LabelSmoother(epsilon=0.1)

    class Check(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):  # after gapmon's
            state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}
            covered = set(callback.monitor.per_sample.coverage()["covered"])

            def loss_of(m, sample):
                return smoother(m(input_ids=sample["input_ids"][None]), sample["labels"][None], shift_labels=True)

            checks.append((callback.monitor.per_sample.local_norms().tolist(),
                           _reference_norms(lambda: _llama(transformers)[0], state_dict, list(seen), covered, loss_of)))
            seen.clear()

    trainer.add_callback(Check())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="PerSampleGradNorms", category=RuntimeWarning)
        trainer.train()
    assert len(checks) == 2
    for got, want in checks:
        assert len(got) == 2 * accumulation
        assert got == pytest.approx(want, rel=HF_RTOL)


def _packed_trainer(transformers, tmp_path, **attach_kwargs):
    from gapmon.integrations.huggingface import attach

    model, _ = _llama(transformers)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, VOCAB, (3 + i % 4,), generator=g).tolist()} for i in range(8)]
    trainer = transformers.Trainer(model=model, args=_hf_args(transformers, tmp_path, max_steps=2), train_dataset=data,
                                   data_collator=transformers.DataCollatorWithFlattening())
    attach(trainer, interval=1, **attach_kwargs)
    return trainer


def test_huggingface_trainer_with_packed_sequences_counts_sequences_and_refuses_per_sample_norms(tmp_path):
    """DataCollatorWithFlattening packs a batch of 4 sequences into one row (position_ids restarting): the global
    batch size counts the sequences, and per-sample norms, which would take the row for one sample, are refused
    before the first step with a message that says what to do."""
    transformers = _hf()
    trainer = _packed_trainer(transformers, tmp_path / "plain")
    trainer.train()
    logged = [e for e in trainer.state.log_history if GLOBAL_BATCH_SIZE in e]
    assert [e[GLOBAL_BATCH_SIZE] for e in logged] == [4, 4]
    trainer = _packed_trainer(transformers, tmp_path / "per-sample", per_sample_grad_norms=True)
    with pytest.raises(RuntimeError, match="packs 4 sequences into 1 row.*Pad the batch"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_packed_batches_are_told_from_padded_ones():
    from gapmon.integrations import packed_samples

    ones = torch.ones(2, 6, dtype=torch.long)
    assert packed_samples({"position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]])}) == 3
    assert packed_samples({"position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]]), "attention_mask": ones[:1]}) == 3
    assert packed_samples({"position_ids": torch.arange(6).expand(2, 6)}) is None  # one sequence a row
    left_padded = torch.tensor([[1, 1, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5]])  # HF's positions for left padding
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    assert packed_samples({"position_ids": left_padded, "attention_mask": mask}) is None
    assert packed_samples({"cu_seq_lens_q": torch.tensor([0, 3, 5, 6])}) == 3
    assert packed_samples({}) is None


def test_huggingface_trainer_with_a_reference_pass_of_the_same_model_logs_the_same(tmp_path):
    """A compute_loss that also runs the trained model without gradients (a reference pass, as TRL's DPO takes
    with a PEFT adapter disabled; an evaluation inside the step): gapmon's metrics (activations, the sample count,
    per-sample norms) are those of the run without that pass."""
    transformers = _hf()
    from gapmon.integrations.huggingface import attach

    class WithReference(transformers.Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            with torch.no_grad():
                model(input_ids=inputs["input_ids"][:, :5] % 7)  # another batch: its statistics would differ
            return super().compute_loss(model, inputs, *args, **kwargs)

    def run(trainer_class, where):
        model, _ = _llama(transformers)
        trainer = trainer_class(model=model, args=_hf_args(transformers, where, max_steps=2,
                                                           gradient_accumulation_steps=2, per_device_train_batch_size=2),
                                train_dataset=_lm_data(8))
        attach(trainer, interval=1, per_sample_grad_norms=True)
        trainer.train()
        return [{k: v for k, v in e.items() if k.startswith("gap/")} for e in trainer.state.log_history
                if any(k.startswith("gap/") for k in e)]

    plain, with_reference = run(transformers.Trainer, tmp_path / "plain"), run(WithReference, tmp_path / "reference")
    assert len(plain) == 2 and any(k.startswith("gap/activations/") for k in plain[0])
    assert [e[GLOBAL_BATCH_SIZE] for e in with_reference] == [4, 4]
    for want, got in zip(plain, with_reference):
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("family", ["llama", "gpt2-tied", "mixtral"])
def test_huggingface_per_sample_norms_are_of_each_samples_own_loss(tmp_path, accumulation, family):
    """The Trainer sums every token's loss over the step and divides by their count: the norms still
    are ||grad of the mean cross entropy of the sample's own tokens||, with or without accumulation (GPT-2: its
    Conv1D layers, its tied embedding and head and its position embeddings covered; Mixtral: its experts and
    routers)."""
    transformers = _hf()
    from gapmon.integrations.huggingface import attach

    data = _lm_data(12)
    make = {"llama": _llama, "gpt2-tied": _gpt2, "mixtral": _mixtral}[family]
    model, _ = make(transformers)
    args = _hf_args(transformers, tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=accumulation,
                    max_steps=2, max_grad_norm=0.0, learning_rate=1e-2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        callback = attach(trainer, interval=1, per_sample_grad_norms=True)
    checks = hf_own_loss_checks(transformers, trainer, model, callback, make)
    trainer.train()
    uncovered = set(callback.monitor.per_sample.coverage()["uncovered"])
    assert uncovered == set()  # GPT-2's position embeddings too: followed to where they join the batch
    assert len(checks) == 2
    for got, want in checks:
        assert len(got) == 2 * accumulation
        assert got == pytest.approx(want, rel=HF_RTOL)


def _padded_lm_data(n: int, seed: int = 2) -> list[dict]:
    """Samples of 3 to SEQ tokens, as a tokenizer gives them (no padding yet: the collator pads)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, VOCAB, (3 + i % (SEQ - 2),), generator=g).tolist()} for i in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_huggingface_per_sample_norms_with_a_padding_collator(tmp_path, attention):
    """The usual Trainer set-up: samples of different lengths padded by DataCollatorForLanguageModeling, whose batch
    holds an attention_mask. transformers builds its 4-D masks from it by `padding_mask[batch_idx, kv_idx]` (indexing
    by arange(B) and the key positions), which gapmon follows, so every layer stays covered (16 of Llama's 21
    parameters were left out when the mask was a batched input) and the norms are each sample's own loss's."""
    transformers = _hf()
    from gapmon.integrations.huggingface import attach

    class Tokenizer:  # what the collator reads of a tokenizer: its pad id and side
        pad_token_id, padding_side, model_input_names = 0, "right", ["input_ids", "attention_mask"]

        def pad(self, features, return_tensors=None, **kwargs):
            width = max(len(f["input_ids"]) for f in features)
            ids = torch.tensor([f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features])
            mask = torch.tensor([[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features])
            return transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask})

    model, _ = _llama(transformers)
    model.set_attn_implementation(attention)
    make = lambda tr, seed=0: (lambda m: (m[0].set_attn_implementation(attention), m)[1])(_llama(tr, seed))  # noqa: E731
    collator = transformers.DataCollatorForLanguageModeling(Tokenizer(), mlm=False)
    args = _hf_args(transformers, tmp_path, per_device_train_batch_size=3, max_steps=2, max_grad_norm=0.0,
                    learning_rate=1e-2, remove_unused_columns=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_padded_lm_data(6), data_collator=collator)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="PerSampleGradNorms", category=RuntimeWarning)
        callback = attach(trainer, interval=1, per_sample_grad_norms=True)
        checks = hf_own_loss_checks(transformers, trainer, model, callback, make)
        trainer.train()
    assert set(callback.monitor.per_sample.coverage()["uncovered"]) == set()
    assert len(checks) == 2
    for got, want in checks:
        assert got == pytest.approx(want, rel=HF_RTOL)


@pytest.mark.parametrize("family, reentrant, bookkeeping", [("llama", True, False), ("llama", False, True),
                                                          ("gpt2-tied", True, True), ("gpt2-tied", False, False)])
def test_huggingface_per_sample_norms_under_the_trainers_activation_checkpointing(tmp_path, family, reentrant,
                                                                                 bookkeeping):
    """The Trainer's own activation checkpointing (reentrant: the blocks run without grad and again in backward;
    non-reentrant: recomputed in backward) under accumulation: every parameter covered, each sample's own loss."""
    transformers = _hf()
    from gapmon.integrations.huggingface import attach

    data = _lm_data(12)
    make = {"llama": _llama, "gpt2-tied": _gpt2}[family]
    model, _ = make(transformers)
    fields = transformers.TrainingArguments.__dataclass_fields__
    prefix = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    args = _hf_args(transformers, tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
                    max_grad_norm=0.0, learning_rate=1e-2,
                    **{prefix: True, f"{prefix}_kwargs": {"use_reentrant": reentrant}})
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        callback = attach(trainer, interval=1, per_sample_grad_norms=True, bookkeeping=bookkeeping)
    checks = hf_own_loss_checks(transformers, trainer, model, callback, make)
    trainer.train()
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    coverage = callback.monitor.per_sample.coverage()
    assert not coverage["uncovered"] and not coverage["skipped_layers"], coverage["uncovered_reasons"]
    assert len(checks) == 2
    for got, want in checks:
        assert len(got) == 4
        assert got == pytest.approx(want, rel=HF_RTOL)


@pytest.mark.slow
def test_huggingface_per_sample_norms_with_bookkeeping_under_accumulation(tmp_path):
    """Book-keeping under the real Trainer with gradient accumulation: the weight gradients gapmon forms reach the
    parameters' hooks as the tensors it returned, micro-batch after micro-batch (no false refusal), and the norms are
    still each sample's own loss's."""
    transformers = _hf()
    from gapmon.integrations.huggingface import attach

    def narrow_llama(transformers, seed: int = 0):  # width 4 < SEQ: its Linear layers take the direct form, book-kept
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=4, intermediate_size=6, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                       tie_word_embeddings=False)
        torch.manual_seed(seed)
        return transformers.LlamaForCausalLM(cfg).double(), cfg

    data = _lm_data(12)
    model, _ = narrow_llama(transformers)
    args = _hf_args(transformers, tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    max_steps=2, max_grad_norm=0.0, learning_rate=1e-2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        callback = attach(trainer, interval=1, per_sample_grad_norms=True, bookkeeping=True)
    checks = hf_own_loss_checks(transformers, trainer, model, callback, narrow_llama)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.train()
    assert any(e.key == "BookkeepingLinear" for e in prof.key_averages())
    assert len(checks) == 2
    for got, want in checks:
        assert len(got) == 4
        assert got == pytest.approx(want, rel=HF_RTOL)


def _bart(transformers, seed: int = 0):
    """A tiny BartForConditionalGeneration (embeddings scaled by sqrt(d_model)), float64, without dropout."""
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=12, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=20,
                                  decoder_ffn_dim=20, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0, scale_embedding=True, pad_token_id=1, decoder_start_token_id=2)
    torch.manual_seed(seed)
    return transformers.BartForConditionalGeneration(cfg).double(), cfg


@pytest.mark.slow
def test_huggingface_per_sample_norms_follow_an_encoder_decoder_into_its_decoder(tmp_path):
    """The Trainer feeds input_ids and labels, which BART shifts into its decoder's ids: every tensor of the collated
    batch is taken as per-sample, so the decoder is covered without batch_inputs (it was left out, warned, for
    decoder ids that came from no batched input), and the norms are each sample's own loss's under accumulation."""
    transformers = _hf()
    from gapmon.integrations.huggingface import attach

    g = torch.Generator().manual_seed(3)
    data = []
    for i in range(8):
        labels = torch.randint(3, VOCAB, (SEQ - 2,), generator=g)
        labels[: i % 3] = -100
        data.append({"input_ids": torch.randint(3, VOCAB, (SEQ,), generator=g), "labels": labels})
    model, _ = _bart(transformers)
    args = _hf_args(transformers, tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    max_steps=2, max_grad_norm=0.0, learning_rate=1e-2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        callback = attach(trainer, interval=1, per_sample_grad_norms=True)
        checks = hf_own_loss_checks(transformers, trainer, model, callback, _bart)
        trainer.train()
    assert not [str(w.message) for w in caught if "not per-sample" in str(w.message)]
    uncovered = set(callback.monitor.per_sample.coverage()["uncovered"])
    assert not uncovered  # the learned position tables too, by id (row_lookup)
    assert len(checks) == 2
    for got, want in checks:
        assert len(got) == 4
        assert got == pytest.approx(want, rel=HF_RTOL)


def hf_own_loss_checks(transformers, trainer, model, callback, make=None) -> list:
    """Adds to `trainer` a callback that, at each optimizer step (after gapmon's), appends (gapmon's norms,
    the float64-loop norms of the samples the model saw in the step) to the list it returns."""
    seen: list[dict] = []  # each step's samples, as the model saw them
    checks: list = []

    def capture(module, args, kwargs):
        if callback.monitor is not None and callback.monitor.monitoring:
            for i in range(kwargs["input_ids"].shape[0]):
                seen.append({k: kwargs[k][i].clone() for k in ("input_ids", "labels", "attention_mask") if k in kwargs})

    model.register_forward_pre_hook(capture, with_kwargs=True)

    class Check(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            covered = set(callback.monitor.per_sample.coverage()["covered"])
            got = callback.monitor.per_sample.local_norms().tolist()
            state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}

            def loss_of(m, s):  # its own mean over tokens
                return m(**{k: v[None] for k, v in s.items()}).loss

            checks.append((got, _reference_norms(lambda: (make or _llama)(transformers)[0], state_dict, list(seen), covered,
                                                 loss_of)))
            seen.clear()

    trainer.add_callback(Check())
    return checks


def _lightning_module(pl, transformers):
    class LlamaModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _llama(transformers)[0]

        def training_step(self, batch, batch_idx):  # calls self.model, not self: the usual Lightning style
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    return LlamaModule


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
def test_lightning_per_sample_norms_with_a_hugging_face_model(tmp_path, accumulation):
    """A real Lightning Trainer, an HF Llama with untied embeddings, training_step calling self.model:
    no false refusal, and the norms are of each sample's own loss (the mean over its tokens, which the
    model returns per micro-batch and Lightning divides by accumulate_grad_batches)."""
    pl = pytest.importorskip("lightning.pytorch", reason="needs lightning (CI installs it)")
    transformers = _hf()
    from gapmon.integrations.lightning import GAPMonitorCallback

    # Equal label counts per sample: the model's micro-batch mean over tokens is then the mean of the
    # samples' own losses, which is what the callback takes training_step to return.
    data = [{"input_ids": d["input_ids"], "labels": d["input_ids"].clone()} for d in _lm_data(12)]
    checks = []
    gap = GAPMonitorCallback(interval=3, per_sample_grad_norms=True)

    class Check(pl.Callback):
        def __init__(self):
            self.samples = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step % 3 == 0:
                self.samples += [{k: v[i].clone() for k, v in batch.items()} for i in range(batch["input_ids"].shape[0])]

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # after gapmon's
            if trainer.global_step % 3 == 0:
                norms = gap.monitor.per_sample
                covered = {n.removeprefix("model.") for n in norms.coverage()["covered"]}
                state = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}

                def loss_of(m, s):
                    return m(input_ids=s["input_ids"][None], labels=s["labels"][None]).loss

                want = _reference_norms(lambda: _llama(transformers)[0], state, self.samples, covered, loss_of)
                checks.append((norms.local_norms().tolist(), want, gap.last_metrics))
            self.samples = []

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.simplefilter("ignore", UserWarning)
        trainer = pl.Trainer(max_steps=4, accumulate_grad_batches=accumulation, accelerator="cpu", logger=False,
                             callbacks=[gap, Check()], enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=str(tmp_path))
        trainer.fit(_lightning_module(pl, transformers)(), torch.utils.data.DataLoader(data, batch_size=2))
    assert len(checks) == 2  # steps 0 and 3
    for got, want, metrics in checks:
        assert len(got) == 2 * accumulation
        assert got == pytest.approx(want, rel=HF_RTOL)
        assert metrics[per_sample_norm_name("max")] == pytest.approx(max(want), rel=HF_RTOL)
        assert metrics[GLOBAL_BATCH_SIZE] == 2 * accumulation


def test_plain_api_loss_weights_give_each_samples_own_loss():
    """The plain API: with the loss scaled by 1/micro-batches (accumulation), set_loss_weights says so and
    the norms stay those of each sample's own loss; without it, loss_reduction='mean' is taken per micro-batch."""
    import gapmon

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)

    def own_norm(i):
        model.zero_grad()
        nn.functional.mse_loss(model(x[i:i + 1]), y[i:i + 1]).backward()
        return float(sum(p.grad.square().sum() for p in model.parameters())) ** 0.5

    want = [own_norm(i) for i in range(6)]
    model.zero_grad()
    norms = gapmon.PerSampleGradNorms(model)
    for mb in range(2):  # two micro-batches, the loss divided by 2 as accumulation loops do
        xs, ys = x[3 * mb: 3 * mb + 3], y[3 * mb: 3 * mb + 3]
        loss = nn.functional.mse_loss(model(xs), ys, reduction="none").mean(1).mean() / 2
        norms.set_loss_weights(1.0 / (3 * 2))
        loss.backward()
    assert norms.local_norms().tolist() == pytest.approx(want, rel=1e-10)
    # per-sample weights: sample i's loss weighted by w[i]
    norms.reset()
    w = torch.tensor([0.5, 2.0, 0.0], dtype=torch.float64)
    model.zero_grad()
    losses = nn.functional.mse_loss(model(x[:3]), y[:3], reduction="none").mean(1)
    norms.set_loss_weights(w)
    (losses * w).sum().backward()
    assert norms.local_norms().tolist() == pytest.approx([want[0], want[1], 0.0], rel=1e-10)
    with pytest.raises(ValueError, match="3 samples"):
        model(x[:3])
        norms.set_loss_weights(torch.ones(4))
    norms.close()


OLMO_SEQ, OLMO_VOCAB = 8, 64


def _olmo_model():
    from olmo_core.nn.transformer import TransformerConfig

    return TransformerConfig.olmo2_1M(vocab_size=OLMO_VOCAB, n_layers=2).build(init_device="cpu")


def _olmo_train_module(tmp_path, lr: float):
    """(model, train module, the trainer stand-in it reports to, the dict its record_metric fills): an OLMo2 1M
    model in OLMo-core's TransformerTrainModule (micro-batches of 2 sequences of OLMO_SEQ tokens), as its
    Trainer sets it up."""
    from types import SimpleNamespace

    from olmo_core.optim import AdamWConfig
    from olmo_core.train.train_module import TransformerTrainModule

    torch.manual_seed(0)
    model = _olmo_model()
    module = TransformerTrainModule(model, optim=AdamWConfig(lr=lr), rank_microbatch_size=2 * OLMO_SEQ,
                                    max_sequence_length=OLMO_SEQ, device=torch.device("cpu"))
    recorded: dict[str, float] = {}
    trainer = SimpleNamespace(global_step=1, global_batch_size=4 * OLMO_SEQ, dp_process_group=None, train_module=module,
                              save_folder=str(tmp_path), work_dir=tmp_path,
                              record_metric=lambda name, value, *a, **k: recorded.__setitem__(name, value),
                              record_ce_loss=lambda value, *a, **k: None)
    module._trainer = trainer
    return model, module, trainer, recorded


@pytest.mark.slow
def test_olmo_core_per_sample_norms_with_micro_batches(tmp_path):
    """OLMo-core's TransformerTrainModule splits the rank's batch into micro-batches, sums each token's
    loss and divides by the rank's label tokens of the whole step: the callback's norms are still those of
    each sample's own loss (mean over its label tokens), against a loop over the samples. The callback is
    driven as olmo_core's Trainer drives it (pre_step, train_batch, pre_optim_step)."""
    pytest.importorskip("olmo_core", reason="needs ai2-olmo-core (CI installs it)")
    import gapmon
    from gapmon.integrations.olmo import GAPMonitorCallback

    seq, vocab = OLMO_SEQ, OLMO_VOCAB
    model, module, trainer, recorded = _olmo_train_module(tmp_path, lr=1e-3)
    callback = GAPMonitorCallback(gapmon_config=gapmon.MonitorConfig(per_sample=gapmon.PerSampleConfig()))
    callback.trainer = trainer
    with warnings.catch_warnings():
        # Every layer of this OLMo-core model has a rule (its RMSNorm's too): nothing may be left out.
        warnings.filterwarnings("error", message="PerSampleGradNorms", category=RuntimeWarning)
        callback.pre_train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (4, seq), generator=g)
    label_mask = torch.ones(4, seq, dtype=torch.bool)
    for i in range(4):
        label_mask[i, : 2 * i] = False  # 7, 5, 3 and 1 label tokens: the token normalisation matters
    callback.pre_step({"input_ids": ids, "label_mask": label_mask})
    module.train_batch({"input_ids": ids.clone(), "label_mask": label_mask.clone()})
    callback.pre_optim_step()
    norms = callback._monitor.per_sample
    got = norms.local_norms().tolist()
    covered = set(norms.coverage()["covered"])

    from olmo_core.data.utils import get_labels

    labels = get_labels({"input_ids": ids, "label_mask": label_mask})
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def loss_of(m, s):
        return m(s["input_ids"][None], labels=s["labels"][None]).loss  # the mean over its label tokens

    want = _reference_norms(_olmo_model, state,
                            [{"input_ids": ids[i], "labels": labels[i]} for i in range(4)], covered, loss_of)
    assert got == pytest.approx(want, rel=1e-4)
    assert recorded[GLOBAL_BATCH_SIZE] == 4
    callback.close()


HF_DDP = """'''HF Trainer under DDP (2 CPU processes, gloo): per-sample norms of each sample's own loss on every rank.'''
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch, transformers
sys.path[:0] = [sys.argv[2], os.path.join(sys.argv[2], "integrations")]  # helpers.py, this test file
import test_trainers_real_path as t
from gapmon.integrations.huggingface import attach

data = t._lm_data(16)
model, _ = t._llama(transformers)
args = t._hf_args(transformers, sys.argv[1], per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
                  max_grad_norm=0.0, learning_rate=1e-2, ddp_backend="gloo", logging_steps=100)
trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
cb = attach(trainer, interval=1, per_sample_grad_norms=True)
checks = t.hf_own_loss_checks(transformers, trainer, model, cb)
trainer.train()
errors = [max(abs(g / w - 1) for g, w in zip(got, want)) for got, want in checks]
# One file per rank: two ranks printing at once can interleave their lines on the shared stdout.
with open(os.path.join(sys.argv[1], "result" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(errors, f)
sys.stdout.flush()
torch.distributed.barrier()
torch.distributed.destroy_process_group()  # a gloo group left to interpreter exit can abort it (std::terminate)
os._exit(0)
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_huggingface_trainer_under_ddp_gives_each_samples_own_norm(tmp_path):
    """2 CPU processes (gloo), accumulation 2: the Trainer divides the token sum by the token count over
    every rank and multiplies back by the world size; each rank's norms are still of its samples' own loss."""
    _hf()
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "ddp.py"
    script.write_text(HF_DDP)
    tests_dir = str(Path(__file__).resolve().parents[1])  # helpers.py
    from helpers import free_port

    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
              "--master_port", str(free_port())]
    proc = subprocess.run([*launch, str(script), str(tmp_path / "out"), tests_dir], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    results = sorted((tmp_path / "out").glob("result*.json"))
    assert proc.returncode == 0 and len(results) == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    for path in results:
        errors = json.loads(path.read_text())
        assert len(errors) == 2 and max(errors) < HF_RTOL, (path.name, errors)


def test_lightning_keeps_everything_it_logs_without_gapmon(tmp_path):
    """What a LightningModule logs (self.log) reaches the Trainer's loggers with gapmon attached exactly as
    without it; gapmon only adds its own gap/ metrics."""
    pl = pytest.importorskip("lightning.pytorch", reason="needs lightning (CI installs it)")
    from gapmon.integrations.lightning import GAPMonitorCallback

    def training_step(module, batch):
        x, y = batch
        loss = ((module.net(x) - y) ** 2).mean()
        module.log("train_loss", loss)
        module.log("lr", module.optimizers().param_groups[0]["lr"])
        return loss

    Module = regression_module(pl, training_step)

    def run(callbacks):
        records = []

        Logger = memory_logger(pl, records, lambda metrics: {k: v for k, v in metrics.items() if not k.startswith("gap/")})

        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(24, 6), torch.randn(24, 1))
        trainer = pl.Trainer(max_steps=4, accumulate_grad_batches=2, accelerator="cpu", logger=Logger(),
                             callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=str(tmp_path), log_every_n_steps=1)
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=3))
        return [r for r in records if r[1]]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = run([])
        watched = run([GAPMonitorCallback(interval=1, per_sample_grad_norms=True)])
    assert plain and [s for s, _ in watched] == [s for s, _ in plain]
    for (_, a), (_, b) in zip(plain, watched):
        assert sorted(a) == sorted(b)
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-6), key


def _update_norms(model, before: dict[str, torch.Tensor]) -> dict[str, float]:
    """|w_after - w_before| per parameter, in float64, from copies the test took itself."""
    return {n: (p.detach().double() - before[n]).norm().item() for n, p in model.named_parameters() if n in before}


def _assert_updates(got: dict[str, float], want: dict[str, float], prefix: str = "") -> None:
    assert want
    for name, value in want.items():
        key = f"gap/update/{prefix}{name}/norm"
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-10), key


def test_huggingface_trainer_logs_the_optimizer_updates_with_its_own_logs(tmp_path):
    """optimizer_stats=True: the Trainer's log of each monitored step also holds gap/update/... equal to the
    weights' change around its optimizer step (float64 copies taken by a callback of the test), and the
    Trainer's own entries are unchanged."""
    transformers = _hf()
    from gapmon.integrations.huggingface import attach

    data = _lm_data(12)
    model, _ = _llama(transformers)
    trainer = transformers.Trainer(model=model, args=_hf_args(transformers, tmp_path, max_steps=3, learning_rate=1e-2),
                                   train_dataset=data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        attach(trainer, interval=2, optimizer_stats=True, activations=False, activation_grads=False)
    seen: dict[int, dict[str, float]] = {}

    class Copies(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.before = {n: p.detach().double().clone() for n, p in model.named_parameters()}

        def on_optimizer_step(self, args, state, control, **kwargs):
            seen[state.global_step + 1] = _update_norms(model, self.before)

    trainer.add_callback(Copies())
    trainer.train()
    logged = {e["step"]: e for e in trainer.state.log_history if any(k.startswith("gap/update/") for k in e)}
    assert sorted(logged) == [1, 3]  # steps 0 and 2 of the monitor, logged after global_step += 1
    for step, entry in logged.items():
        assert "loss" in entry or "grad_norm" in entry or any(k.startswith("gap/grads/") for k in entry)
        _assert_updates(entry, seen[step])


def test_lightning_logs_the_optimizer_updates(tmp_path):
    pl = pytest.importorskip("lightning.pytorch", reason="needs lightning (CI installs it)")
    from gapmon.integrations.lightning import GAPMonitorCallback

    records: list[tuple[int, dict]] = []
    seen: dict[int, dict[str, float]] = {}

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.net(x) - y) ** 2).mean()

        def on_before_optimizer_step(self, optimizer):
            self.before = {n: p.detach().double().clone() for n, p in self.named_parameters()}
            self.step_of_copy = self.trainer.global_step

        def on_train_batch_end(self, outputs, batch, batch_idx):
            seen[self.step_of_copy] = _update_norms(self, self.before)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.1)

    Logger = memory_logger(pl, records, dict)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(12, 6), torch.randn(12, 1))
    callback = GAPMonitorCallback(interval=2, optimizer_stats=True)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=Logger(), callbacks=[callback],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), log_every_n_steps=1)
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=3))
    updates = {s: m for s, m in records if any(k.startswith("gap/update/") for k in m)}
    assert sorted(updates) == [0, 2]
    for step, metrics in updates.items():
        _assert_updates(metrics, seen[step])


def test_olmo_core_records_the_optimizer_updates(tmp_path):
    """The OLMo-core callback, driven as its Trainer drives it (pre_step, train_batch, pre_optim_step, the
    optimizer step, post_train_batch), records gap/update/... of the train module's optimizer."""
    pytest.importorskip("olmo_core", reason="needs ai2-olmo-core (CI installs it)")
    import gapmon
    from gapmon.integrations.olmo import GAPMonitorCallback

    seq, vocab = OLMO_SEQ, OLMO_VOCAB
    model, module, trainer, recorded = _olmo_train_module(tmp_path, lr=1e-2)
    callback = GAPMonitorCallback(gapmon_config=gapmon.MonitorConfig(activations=False, activation_grads=False),
                                  optimizer_stats=True)
    callback.trainer = trainer
    callback.pre_train()
    ids = torch.randint(0, vocab, (4, seq), generator=torch.Generator().manual_seed(1))
    callback.pre_step({"input_ids": ids})
    module.train_batch({"input_ids": ids.clone()})
    callback.pre_optim_step()
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    module.optim_step()
    callback.post_train_batch()
    _assert_updates(recorded, _update_norms(model, before))
    callback.close()


HF_DDP_NOISE = """'''HF Trainer under DDP (2 CPU processes, gloo) with data_parallel_noise=True: the noise scale from DDP's reduction.'''
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch, transformers
sys.path[:0] = [sys.argv[2], os.path.join(sys.argv[2], "integrations")]  # helpers.py, this test file
import test_trainers_real_path as t
from gapmon.integrations.huggingface import attach

model, _ = t._llama(transformers)
args = t._hf_args(transformers, sys.argv[1], per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
                  learning_rate=1e-2, ddp_backend="gloo")
trainer = transformers.Trainer(model=model, args=args, train_dataset=t._lm_data(16))
attach(trainer, interval=1, activations=False, activation_grads=False, data_parallel_noise=True)
trainer.train()
logged = [{k: v for k, v in e.items() if k.startswith(("gap/gns/", "gap/local_grad_norm/", "gap/global_batch_size"))}
          for e in trainer.state.log_history]
with open(os.path.join(sys.argv[1], "result" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump([e for e in logged if e], f)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
os._exit(0)
"""


def test_huggingface_trainer_under_ddp_reports_the_noise_scale_of_its_reduction(tmp_path):
    """data_parallel_noise=True under the Trainer's own DDP (torchrun, 2 gloo processes, accumulation 2): every
    step logs the two-batch noise scale and each rank's local gradient norm (the estimator itself is checked
    against per-sample gradients in tests/monitor/test_noise_scale.py)."""
    _hf()
    import json
    import math
    import subprocess
    import sys
    from pathlib import Path

    from helpers import free_port

    script = tmp_path / "ddp_noise.py"
    script.write_text(HF_DDP_NOISE)
    tests_dir = str(Path(__file__).resolve().parents[1])
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
              "--master_port", str(free_port())]
    proc = subprocess.run([*launch, str(script), str(tmp_path / "out"), tests_dir], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    results = sorted((tmp_path / "out").glob("result*.json"))
    assert proc.returncode == 0 and len(results) == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    for path in results:
        steps = json.loads(path.read_text())
        assert len(steps) == 2, steps
        for entry in steps:
            assert entry["gap/global_batch_size"] == 8  # 2 ranks x 2 micro-batches x 2 samples
            for field in ("grad_norm_sq", "noise_trace", "b_simple_step", "b_simple"):
                assert math.isfinite(entry[f"gap/gns/data_parallel/{field}"]), field
            low, high = entry["gap/local_grad_norm/min"], entry["gap/local_grad_norm/max"]
            assert 0 < low <= entry["gap/local_grad_norm/mean"] <= high and entry["gap/local_grad_norm/max_rank"] in (0, 1)


def test_data_parallel_noise_without_ddp_says_so():
    """A Lightning run on one process with data_parallel_noise=True warns that there is no reduction to read."""
    pl = pytest.importorskip("lightning.pytorch", reason="needs lightning (CI installs it)")
    from gapmon.integrations.lightning import GAPMonitorCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(8, 4))
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[GAPMonitorCallback(data_parallel_noise=True)])
    with pytest.warns(RuntimeWarning, match="neither a DistributedDataParallel nor an FSDP2 model"):
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=4))
