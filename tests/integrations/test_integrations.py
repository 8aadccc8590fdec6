"""gapmon inside transformers.Trainer, Lightning and OLMo-core, with the real packages on CPU.

Each test checks that metrics reach the framework's own logging, at the right steps, and that the
gradient statistics are those of the accumulated gradients the optimizer sees (recorded
independently by a second callback at the same point)."""
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from helpers import memory_logger, regression_module

import gapmon
from gapmon.integrations import require


def test_import_gapmon_loads_no_framework():
    code = ("import sys, gapmon; bad = [m for m in ('transformers', 'lightning', 'olmo_core') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_framework_names_the_package():
    with pytest.raises(ImportError, match="pip install no-such-framework"):
        require("no_such_framework", "example", "no-such-framework")


# ------------------------------------------------------------------ Hugging Face
def test_huggingface_trainer_with_gradient_accumulation(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    from gapmon.integrations.huggingface import attach

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=31, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    data = [{"input_ids": torch.randint(0, 31, (8,)), "labels": torch.randint(0, 31, (8,))} for _ in range(16)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        logging_steps=1000, report_to=[], save_strategy="no", use_cpu=True, max_grad_norm=0.0,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    seen = {}

    class Recorder(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):  # runs after gapmon's
            seen[state.global_step + 1] = model.transformer.h[0].mlp.c_fc.weight.grad.norm().item()

    attach(trainer, interval=1)
    trainer.add_callback(Recorder())
    trainer.train()
    logged = {entry["step"]: entry for entry in trainer.state.log_history if "gap/global_batch_size" in entry}
    assert sorted(logged) == [1, 2, 3]
    for step, entry in logged.items():
        assert entry["gap/global_batch_size"] == 4  # 2 samples x 2 accumulated micro-batches
        assert entry["gap/grads/transformer.h.0.mlp.c_fc.weight/norm"] == pytest.approx(seen[step], rel=1e-5)
        assert "gap/activations/transformer.h.1.attn/max" in entry


# ------------------------------------------------------------------ Lightning
def test_lightning_trainer_logs_to_its_loggers(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from gapmon.integrations.lightning import GAPMonitorCallback

    Module = regression_module(pl)
    grads = {}

    class Recorder(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads[trainer.global_step] = pl_module.net[0].weight.grad.norm().item()

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(24, 6), torch.randn(24, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=3)
    gap = GAPMonitorCallback(interval=1)
    records: list = []
    logger = memory_logger(pl, records, dict)()
    trainer = pl.Trainer(max_steps=3, accumulate_grad_batches=2, accelerator="cpu", logger=logger,
                         callbacks=[gap, Recorder()], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), log_every_n_steps=1)
    trainer.fit(Module(), loader)
    gap_records = {step: m for step, m in records if "gap/global_batch_size" in m}
    assert sorted(gap_records) == [0, 1, 2]
    for step, metrics in gap_records.items():
        assert metrics["gap/global_batch_size"] == 6  # 3 samples x 2 accumulated batches
        assert metrics["gap/grads/net.0.weight/norm"] == pytest.approx(grads[step], rel=1e-5)
        assert "gap/activations/net.1/max" in metrics


def test_lightning_evaluation_pass_inside_training_step_is_not_the_steps(tmp_path):
    """training_step calls self.net(...) (not the LightningModule's own forward) and also runs it without gradients
    (an evaluation, a target): gapmon's metrics, activations and per-sample norms included, are those of the run
    without that pass."""
    pl = pytest.importorskip("lightning.pytorch")
    from gapmon.integrations.lightning import GAPMonitorCallback

    def fit(extra_pass: bool) -> dict:
        def training_step(module, batch):
            x, y = batch
            if extra_pass:
                with torch.no_grad():
                    module.net(torch.randn(5, 6) * 10)
            return ((module.net(x) - y) ** 2).mean()

        Module = regression_module(pl, training_step)
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(12, 6), torch.randn(12, 1))
        records: list = []
        trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=memory_logger(pl, records, dict)(),
                             callbacks=[GAPMonitorCallback(interval=1, per_sample_grad_norms=True)],
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=str(tmp_path), log_every_n_steps=1)
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=3))
        return {step: {k: v for k, v in m.items() if k.startswith("gap/")} for step, m in records
                if "gap/global_batch_size" in m}

    want, got = fit(False), fit(True)
    assert sorted(want) == [0, 1] and "gap/activations/net.1/max" in want[0]
    assert sorted(got) == sorted(want)
    for step in want:
        assert sorted(got[step]) == sorted(want[step])
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9, nan_ok=True), (step, key)


# ------------------------------------------------------------------ OLMo-core
def test_olmo_core_callback_driven_as_the_trainer_drives_it(tmp_path):
    pytest.importorskip("olmo_core")
    from olmo_core.train.callbacks.callback import Callback

    from gapmon.integrations.olmo import GAPMonitorCallback

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 20))
    recorded: dict[int, dict[str, float]] = {}
    trainer = SimpleNamespace(train_module=SimpleNamespace(model=model), global_step=0, save_folder=str(tmp_path),
                              work_dir=tmp_path / "work")
    trainer.record_metric = lambda name, value, **kw: recorded.setdefault(trainer.global_step, {}).__setitem__(name, value)
    callback = GAPMonitorCallback(interval=2, dump_gradients=True, dump_gradients_save_first_n=4)
    assert isinstance(callback, Callback)
    callback.trainer = trainer
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    callback.pre_train()
    grad_norms = {}
    for step in (1, 2, 3, 4):  # the Trainer increments global_step, then pre_step, train_batch, pre_optim_step
        trainer.global_step = step
        ids = torch.randint(0, 20, (4, 5))
        callback.pre_step({"input_ids": ids})
        for micro in ids.split(2):  # two micro-batches
            nn.functional.cross_entropy(model(micro).flatten(0, 1), micro.flatten()).backward()
        grad_norms[step] = model[1].weight.grad.norm().item()
        callback.pre_optim_step()
        opt.step()
        opt.zero_grad()
        callback.post_step()
    callback.close()
    assert sorted(recorded) == [2, 4]  # interval=2
    for step in (2, 4):
        metrics = recorded[step]
        assert metrics["gap/grads/1.weight/norm"] == pytest.approx(grad_norms[step], rel=1e-5)
        assert {"gap/params/1.weight/max", "gap/params/1.weight/mean", "gap/params/1.weight/var",
                "gap/activations/1/max", "gap/activation_grads/1/var"} <= set(metrics)
    assert gapmon.dump.reconstruct.list_steps(tmp_path / "gradients") == ([1, 2, 3, 4], [])
    sampled = gapmon.reconstruct_gradients(tmp_path / "gradients", 4)
    assert sampled["1.weight"].shape == (4, 4)


def test_lightning_per_sample_norms_with_inputs_batched_on_different_dims(tmp_path):
    """A collate that gives sequence-first tokens [T, batch, d] beside a per-sample condition [batch, c]:
    batch_inputs={"x": 1, "cond": 0} says where each holds its samples; the norms are each sample's own
    (float64 loop over the parameters as the optimizer step sees them), nothing refused."""
    pl = pytest.importorskip("lightning.pytorch")
    from gapmon.integrations.lightning import GAPMonitorCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.enc, self.cond, self.head = nn.Linear(4, 8), nn.Linear(3, 8), nn.Linear(8, 2)

        def forward(self, x, cond):
            return self.head(torch.tanh(self.enc(x) + self.cond(cond)[None]).mean(0))

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self(batch["x"], batch["cond"]), batch["y"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def collate(samples):
        return {"x": torch.stack([s[0] for s in samples], 1), "cond": torch.stack([s[1] for s in samples]),
                "y": torch.stack([s[2] for s in samples])}

    torch.manual_seed(0)
    data = [(torch.randn(5, 4, dtype=torch.float64), torch.randn(3, dtype=torch.float64), torch.randint(0, 2, ()))
            for _ in range(8)]
    config = gapmon.PerSampleConfig(batch_dim=1, batch_inputs={"x": 1, "cond": 0}, strict=True)
    gap = GAPMonitorCallback(interval=1, per_sample_grad_norms=config)
    checks = []

    class Check(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.batch = batch

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # after gapmon's
            want = []
            for i in range(self.batch["y"].shape[0]):
                grads = torch.autograd.grad(nn.functional.cross_entropy(
                    pl_module(self.batch["x"][:, i:i + 1], self.batch["cond"][i:i + 1]), self.batch["y"][i:i + 1]),
                    list(pl_module.parameters()))
                want.append(torch.sqrt(sum(g.square().sum() for g in grads)).item())
            checks.append((gap.monitor.per_sample.local_norms().tolist(), want))

    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, callbacks=[gap, Check()],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(Module().double(), torch.utils.data.DataLoader(data, batch_size=4, collate_fn=collate))
    assert len(checks) == 2
    for got, want in checks:
        assert got == pytest.approx(want, rel=1e-10)


LIGHTNING_FSDP2 = '''
import json, sys, torch, torch.nn as nn, lightning.pytorch as pl
from torch.distributed.fsdp import fully_shard
from gapmon.integrations.lightning import GAPMonitorCallback

class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for m in (self.net[0], self.net[2]):
            fully_shard(m, mesh=mesh)
        fully_shard(self.net, mesh=mesh)
    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

out = {"logged": {}, "full_norm": {}}
class Logger(pl.loggers.Logger):
    name, version = "memory", 0
    @property
    def experiment(self): return None
    def log_hyperparams(self, *a, **k): pass
    def log_metrics(self, metrics, step=None):
        out["logged"][step] = metrics["gap/grads/net.0.weight/norm"]
class Recorder(pl.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        out["full_norm"][trainer.global_step] = pl_module.net[0].weight.grad.full_tensor().norm().item()
    def on_fit_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            json.dump(out, open(sys.argv[1], "w"))

torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(24, 6), torch.randn(24, 1))
trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=2, logger=Logger(),
                     strategy=pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                     callbacks=[GAPMonitorCallback(), Recorder()], enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=3))
import os
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()  # a gloo group left to interpreter exit can abort it (std::terminate)
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
'''


@pytest.mark.multiprocess
def test_lightning_fsdp2_reports_full_tensor_statistics(tmp_path):
    """Lightning's ModelParallelStrategy (FSDP2) over 2 CPU processes: gradient statistics are those
    of the full, unsharded gradients. (Lightning's FSDPStrategy needs a GPU.)"""
    pytest.importorskip("lightning.pytorch")
    import json

    script, result = tmp_path / "fit.py", tmp_path / "out.json"
    script.write_text(LIGHTNING_FSDP2)
    proc = subprocess.run([sys.executable, str(script), str(result)], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(result.read_text())
    assert sorted(out["logged"]) == ["0", "1"]
    for step, norm in out["logged"].items():
        assert norm == pytest.approx(out["full_norm"][step], rel=1e-5)
