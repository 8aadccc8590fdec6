"""One config source: MonitorConfig, PerSampleConfig, DumpConfig and the Schedule they share are validated
once, and every field is reachable from every entry point (the constructors' keywords, from_config, and the
Hugging Face, Lightning and OLMo-core integrations)."""
import dataclasses
import sys
import types
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import gapmon
from gapmon import DumpConfig, MonitorConfig, PerSampleConfig, Schedule
from gapmon.config import field_names

GROUP = object()  # stands for a process group: the configs keep whatever they are given


class _MemorySink(gapmon.Sink):
    def write(self, step, metrics, info=None):
        pass


SINK = _MemorySink()

# One non-default value per field (with what it needs), nested fields as "outer.inner": the tests below
# fail when a field is added without a way to reach it.
MONITOR_VALUES = {
    "schedule.every": dict(schedule=Schedule(every=3)),
    "schedule.start": dict(schedule=Schedule(start=2)),
    "schedule.end": dict(schedule=Schedule(end=50)),
    "params": dict(params=False),
    "grads": dict(grads=False),
    "activations": dict(activations=False),
    "activation_grads": dict(activation_grads=False),
    "per_sample.loss_reduction": dict(per_sample=PerSampleConfig(loss_reduction="sum")),
    "per_sample.strict": dict(per_sample=PerSampleConfig(strict=True)),
    "per_sample.bookkeeping": dict(per_sample=PerSampleConfig(bookkeeping=True)),
    "per_sample.batch_dim": dict(per_sample=PerSampleConfig(batch_dim=1)),
    "per_sample.batch_inputs": dict(per_sample=PerSampleConfig(batch_inputs=("input",))),
    "per_sample.process_group": dict(per_sample=PerSampleConfig(process_group=GROUP)),
    "per_sample.gram": dict(per_sample=PerSampleConfig(gram=True)),
    "sinks": dict(sinks=(SINK,)),
    "process_group": dict(process_group=GROUP),
    "correction": dict(correction=0),
    "block_formats": dict(block_formats=("mxfp8_e4m3", "nvfp4")),
    "numerics": dict(numerics=("bf16", "fp8_e4m3")),
    "numerics_alert": dict(numerics=("bf16",), numerics_alert=0.25),
    "gns_ema": dict(gns_ema=0.5),
}
DUMP_VALUES = {
    "schedule.every": dict(schedule=Schedule(every=3)),
    "schedule.start": dict(schedule=Schedule(start=2)),
    "schedule.end": dict(schedule=Schedule(end=50)),
    "mode": dict(mode="full"),
    "save_first_n": dict(mode="sampled", save_first_n=4),
    "async_write": dict(async_write=False),
    "timeout": dict(timeout=5.0),
}


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def test_every_field_has_a_value_to_try():
    assert sorted(MONITOR_VALUES) == sorted(field_names(MonitorConfig))
    assert sorted(DUMP_VALUES) == sorted(field_names(DumpConfig))
    assert {f.name for f in dataclasses.fields(PerSampleConfig)} == {
        k.split(".")[1] for k in MONITOR_VALUES if k.startswith("per_sample.")}


def _monitor_keywords(c: MonitorConfig) -> dict:
    """GAPMonitor's keyword arguments for config c."""
    return dict(interval=c.schedule, params=c.params, grads=c.grads, activations=c.activations,
                activation_grads=c.activation_grads, per_sample_grad_norms=c.per_sample or False,
                sinks=list(c.sinks), process_group=c.process_group, correction=c.correction,
                numerics=c.numerics, numerics_alert=c.numerics_alert, gns_ema=c.gns_ema,
                block_formats=c.block_formats)


def _olmo_callback_class(monkeypatch):
    """OLMo-core's callback class, with a stand-in for olmo_core where it is not installed."""
    if "olmo_core" not in sys.modules:
        try:
            import olmo_core  # noqa: F401
        except ImportError:
            names = ["olmo_core", "olmo_core.train", "olmo_core.train.callbacks", "olmo_core.train.callbacks.callback"]
            for name in names:
                monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
            sys.modules[names[-1]].Callback = type("Callback", (), {})
    monkeypatch.delitem(sys.modules, "gapmon.integrations.olmo", raising=False)
    from gapmon.integrations.olmo import GAPMonitorCallback

    return GAPMonitorCallback


ENTRIES = ("keywords", "from_config", "huggingface", "lightning", "olmo")


def _needs_framework(entry: str) -> None:
    """Skips (with the reason) when the framework of integration `entry` is not installed; CI installs them."""
    if entry == "huggingface":
        pytest.importorskip("transformers", reason="the Hugging Face integration needs transformers (CI installs it)")
    elif entry == "lightning":
        pytest.importorskip("lightning.pytorch", reason="the Lightning integration needs lightning (CI installs it)")


def _monitors(entry: str, config: MonitorConfig, monkeypatch, tmp_path):
    """The GAPMonitors entry point `entry` builds from `config` (each way it takes the options)."""
    _needs_framework(entry)
    model = _model()
    if entry == "keywords":
        yield gapmon.GAPMonitor(model, **_monitor_keywords(config))
    elif entry == "from_config":
        yield gapmon.GAPMonitor.from_config(model, config)
    elif entry == "olmo":
        olmo = _olmo_callback_class(monkeypatch)(gapmon_config=config)
        olmo.trainer = SimpleNamespace(train_module=SimpleNamespace(model=model), save_folder=str(tmp_path), work_dir=tmp_path)
        olmo.pre_train()
        yield olmo._monitor
    else:
        for options in (dict(monitor_config=config), _monitor_keywords(config)):
            if entry == "huggingface":
                from gapmon.integrations.huggingface import GAPMonitorTrainerCallback

                hf = GAPMonitorTrainerCallback(SimpleNamespace(model=model), **options)
                hf.on_train_begin(None, None, None, model=model)
                yield hf.monitor
            else:
                from gapmon.integrations.lightning import GAPMonitorCallback as LightningCallback

                lightning = LightningCallback(**options)
                lightning.on_fit_start(None, model)
                yield lightning.monitor


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("field", sorted(MONITOR_VALUES))
def test_every_monitor_option_reaches_the_monitor_from_every_entry_point(field, entry, monkeypatch, tmp_path):
    config = MonitorConfig(**MONITOR_VALUES[field])
    assert config != MonitorConfig()
    seen = 0
    for mon in _monitors(entry, config, monkeypatch, tmp_path):
        try:
            assert mon.config == config
            if config.per_sample is not None:
                expected = config.per_sample
                if expected.process_group is None:  # the monitor's group by default
                    expected = dataclasses.replace(expected, process_group=config.process_group)
                assert mon.per_sample.config == expected
        finally:
            mon.close()
        seen += 1
    assert seen == (2 if entry in ("huggingface", "lightning") else 1)


def test_the_olmo_interval_is_the_monitor_schedule(monkeypatch, tmp_path):
    callback_class = _olmo_callback_class(monkeypatch)
    assert callback_class(interval=4).monitor_config().schedule == Schedule(every=4)
    with pytest.raises(ValueError, match="not both"):
        callback_class(interval=4, gapmon_config=MonitorConfig(schedule=Schedule(every=2)))
    with pytest.raises(ValueError, match="numerics_alert"):  # gapmon's own validation, at construction
        callback_class(gapmon_config=MonitorConfig(numerics=("bf16",), numerics_alert=2.0))


def _dumper_keywords(c: DumpConfig) -> dict:
    return dict(start_step=c.schedule.start, step_interval=c.schedule.every, end_step=c.schedule.end, mode=c.mode,
                save_first_n=c.save_first_n, async_write=c.async_write, timeout=c.timeout)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("field", sorted(DUMP_VALUES))
def test_every_dump_option_reaches_the_dumper_from_every_entry_point(field, entry, monkeypatch, tmp_path):
    _needs_framework(entry)
    config = DumpConfig(**DUMP_VALUES[field])
    model = _model()
    dumpers, monitors = [], []
    if entry == "keywords":
        dumpers.append(gapmon.GradientDumper(model, tmp_path / "kw", **_dumper_keywords(config)))
    elif entry == "from_config":
        dumpers.append(gapmon.GradientDumper.from_config(model, tmp_path / "cfg", config))
    elif entry == "olmo":
        s = config.schedule
        olmo = _olmo_callback_class(monkeypatch)(
            monitor=False, dump_gradients=True, dump_gradients_start_step=s.start, dump_gradients_step_interval=s.every,
            dump_gradients_end_step=s.end, dump_gradients_save_first_n=config.save_first_n, dump_gradients_mode=config.mode,
            dump_gradients_async_write=config.async_write, dump_gradients_timeout=config.timeout)
        olmo.trainer = SimpleNamespace(train_module=SimpleNamespace(model=model), save_folder=str(tmp_path / "olmo"),
                                       work_dir=tmp_path)
        olmo.pre_train()
        dumpers.append(olmo._dumper)
    else:
        for i, options in enumerate((dict(dump_config=config), dict(dump_kwargs=_dumper_keywords(config)))):
            if entry == "huggingface":
                from gapmon.integrations.huggingface import GAPMonitorTrainerCallback

                callback = GAPMonitorTrainerCallback(SimpleNamespace(model=model), dump_dir=tmp_path / f"hf{i}", **options)
                callback.on_train_begin(None, None, None, model=model)
            else:
                from gapmon.integrations.lightning import GAPMonitorCallback as LightningCallback

                callback = LightningCallback(dump_dir=tmp_path / f"pl{i}", **options)
                callback.on_fit_start(None, model)
            dumpers.append(callback.dumper)
            monitors.append(callback.monitor)
    try:
        assert len(dumpers) == (2 if entry in ("huggingface", "lightning") else 1)
        for dumper in dumpers:
            assert dumper.config == config
    finally:
        for closable in (*dumpers, *monitors):
            closable.close()


def test_options_are_given_one_way():
    _needs_framework("lightning")
    from gapmon.integrations.lightning import GAPMonitorCallback as LightningCallback

    callback = LightningCallback(monitor_config=MonitorConfig(), interval=2)
    with pytest.raises(TypeError, match="not both"):
        callback.on_fit_start(None, _model())
    callback = LightningCallback(dump_config=DumpConfig())
    with pytest.raises(TypeError, match="without dump_dir"):
        callback.on_fit_start(None, _model())
    with pytest.raises(TypeError, match="MonitorConfig"):
        gapmon.GAPMonitor.from_config(_model(), DumpConfig())


@pytest.mark.parametrize("make, error", [
    (lambda: Schedule(every=0), "every"),
    (lambda: Schedule(every=2.0), "every"),
    (lambda: Schedule(start=-1), "start"),
    (lambda: Schedule(start=5, end=2), "before start"),
    (lambda: MonitorConfig(correction=-1), "correction"),
    (lambda: MonitorConfig(params=1), "params"),
    (lambda: MonitorConfig(schedule=0), "interval"),
    (lambda: MonitorConfig(per_sample=True), "PerSampleConfig"),
    (lambda: MonitorConfig(sinks="metrics.jsonl"), "sinks"),
    (lambda: MonitorConfig(numerics=("bf17",)), "unknown format"),
    (lambda: PerSampleConfig(loss_reduction="max"), "loss_reduction"),
    (lambda: PerSampleConfig(batch_inputs="x"), "batch_inputs"),
    (lambda: PerSampleConfig(batch_inputs=("x", ("h0", -1))), "batch_inputs"),
    (lambda: PerSampleConfig(batch_inputs=("x", ("h0",))), "batch_inputs"),
    (lambda: PerSampleConfig(batch_inputs={"x": 1.0}), "batch_inputs"),
    (lambda: PerSampleConfig(batch_inputs=("x", ("x", 1))), "'x' more than once"),
    (lambda: PerSampleConfig(batch_dim=-1), "batch_dim"),
    (lambda: DumpConfig(mode="everything"), "mode"),
    (lambda: DumpConfig(mode="sampled"), "save_first_n"),
    (lambda: DumpConfig(timeout=0), "timeout"),
    (lambda: DumpConfig(schedule=3), "Schedule"),
])
def test_configs_are_validated_when_made(make, error):
    with pytest.raises((TypeError, ValueError), match=error):
        make()


def test_batch_inputs_pair_each_input_with_its_batch_dim():
    """A dict and pairs say the same; inputs named alone hold their samples on batch_dim; the config stays hashable."""
    pairs = PerSampleConfig(batch_dim=1, batch_inputs=("x", ("h0", 0), 2))
    assert pairs == PerSampleConfig(batch_dim=1, batch_inputs=["x", ("h0", 0), 2])
    assert pairs.batch_input_dims() == [("x", 1), ("h0", 0), (2, 1)]
    assert PerSampleConfig(batch_inputs={"x": 0, "h0": 1}) == PerSampleConfig(batch_inputs=(("x", 0), ("h0", 1)))
    assert PerSampleConfig().batch_input_dims() == []
    hash(pairs)


def test_configs_are_frozen_and_schedules_count_the_same_steps_everywhere(tmp_path):
    config = MonitorConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.correction = 0
    schedule = Schedule(every=3, start=2, end=11)
    assert [s for s in range(20) if schedule.includes(s)] == [2, 5, 8, 11]
    model = _model()
    with gapmon.GAPMonitor(model, interval=schedule, sinks=[]) as mon, \
            gapmon.GradientDumper(model, tmp_path, start_step=2, step_interval=3, end_step=11) as dumper:
        assert dumper.config.schedule == schedule
        measured = []
        for step in range(20):
            mon.begin_step(step, batch_size=2)
            model(torch.randn(2, 4)).sum().backward()
            if mon.end_step():
                measured.append(step)
        assert measured == [s for s in range(20) if dumper.should_dump(s)] == [2, 5, 8, 11]


def test_from_config_runs_a_subclass_constructor_and_keeps_the_config(tmp_path):
    """from_config goes through the constructor (a subclass's __init__ runs) and the object's config equals
    the one given, for every config type, nested per-sample options and a full Schedule included."""
    calls = []

    class MyMonitor(gapmon.GAPMonitor):
        def __init__(self, model, **kwargs):
            calls.append("monitor")
            super().__init__(model, **kwargs)

    class MyNorms(gapmon.PerSampleGradNorms):
        def __init__(self, model, **kwargs):
            calls.append("norms")
            super().__init__(model, **kwargs)

    class MyDumper(gapmon.GradientDumper):
        def __init__(self, model, save_dir, **kwargs):
            calls.append("dumper")
            super().__init__(model, save_dir, **kwargs)

    model = _model()
    per_sample = PerSampleConfig(loss_reduction="sum", bookkeeping=True, batch_inputs=(0,))
    monitor_config = MonitorConfig(schedule=Schedule(every=3, start=2, end=20), per_sample=per_sample,
                                   sinks=(lambda step, metrics: None,), correction=0, numerics=("bf16",),
                                   numerics_alert=0.5, activations=False)
    dump_config = DumpConfig(schedule=Schedule(every=2, start=1, end=9), mode="sampled", save_first_n=2,
                             async_write=False, timeout=5.0)
    with MyMonitor.from_config(model, monitor_config) as mon:
        assert isinstance(mon, MyMonitor) and mon.config == monitor_config
    norms = MyNorms.from_config(model, per_sample)
    assert isinstance(norms, MyNorms) and norms.config == per_sample
    norms.close()
    with MyDumper.from_config(model, tmp_path, dump_config) as dumper:
        assert isinstance(dumper, MyDumper) and dumper.config == dump_config
    assert calls == ["monitor", "norms", "dumper"]


@pytest.mark.parametrize("config_type", [Schedule, PerSampleConfig, MonitorConfig, DumpConfig])
def test_every_config_field_is_documented_where_it_is_declared(config_type):
    """Each field is followed by its docstring in the class body (as torchtitan documents its job config)."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(config_type))).body[0].body
    documented = {node.target.id for node, nxt in zip(body, body[1:])
                  if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                  and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)}
    fields = {f.name for f in dataclasses.fields(config_type)}
    assert fields - documented == set()
