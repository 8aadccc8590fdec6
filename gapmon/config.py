"""The options of GAPMonitor, PerSampleGradNorms and GradientDumper, each a frozen dataclass validated
once, when it is made (as torchtitan's job config): the constructors' keyword arguments build them, and
`from_config` takes one directly; the trainer integrations map their own fields onto them. Which steps
the monitor measures and the dumper writes is one `Schedule`.

    cfg = gapmon.MonitorConfig(schedule=gapmon.Schedule(every=10, start=100),
                               per_sample=gapmon.PerSampleConfig(loss_reduction="sum"), numerics=("bf16",))
    mon = gapmon.GAPMonitor.from_config(model, cfg)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from .stats.block_formats import check_block_formats
from .stats.numerics import check_formats
from .utils import check_int

if TYPE_CHECKING:
    from .monitor.sinks import Sink


def _bool(value: Any, who: str, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{who}: {name} must be True or False, got {value!r}")
    return value


def _set(obj: Any, **values: Any) -> None:
    """Stores normalised values on a frozen dataclass, in its __post_init__."""
    for key, value in values.items():
        object.__setattr__(obj, key, value)


@dataclass(frozen=True)
class Schedule:
    """The steps that count: `start`, `start + every`, `start + 2·every`, ... up to `end` (inclusive;
    None: no end). Shared by the monitor (which steps it measures) and the dumper (which it writes)."""

    every: int = 1
    """Steps between two that count (a positive int)."""
    start: int = 0
    """The first step that counts."""
    end: int | None = None
    """The last step that may count (inclusive); None: no end."""

    def __post_init__(self) -> None:
        _set(self, every=check_int(self.every, "Schedule", "every (the interval)", 1),
             start=check_int(self.start, "Schedule", "start (the first step)", 0))
        if self.end is not None:
            _set(self, end=check_int(self.end, "Schedule", "end (the last step)", 0))
            if self.end < self.start:
                raise ValueError(f"Schedule: end ({self.end}) is before start ({self.start})")

    def includes(self, step: int) -> bool:
        """Whether `step` (a non-negative int) is one of the schedule's steps."""
        if step < self.start or (self.end is not None and step > self.end):
            return False
        return (step - self.start) % self.every == 0


def _schedule(value: int | Schedule, who: str) -> Schedule:
    """An interval (int) or a Schedule, as a Schedule."""
    if isinstance(value, Schedule):
        return value
    try:
        return Schedule(every=value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{who}: interval must be a positive int or a gapmon.Schedule, got {value!r}") from None


@dataclass(frozen=True)
class PerSampleConfig:
    """Options of PerSampleGradNorms (see its docstring for what each means)."""

    loss_reduction: str = "mean"
    """How the loss of a micro-batch is made of its samples' losses: "mean" (the norms are rescaled by the
    micro-batch size) or "sum". set_loss_weights() overrides it per micro-batch."""
    strict: bool = False
    """Raise instead of warning when a parameter is left out of the norms or a layer is not per-sample."""
    bookkeeping: bool = False
    """Form the weight gradients of direct-form Linear layers from their per-sample gradients (no extra GEMM)."""
    batch_dim: int = 0
    """The dim of the batched inputs that holds the samples."""
    batch_inputs: tuple[int | str | tuple[int | str, int], ...] | None = None
    """Positions or names of the forward's arguments that hold per-sample data, each on batch_dim or paired with
    the dim that holds its samples: ("input_ids", ("h0", 1)) for a recurrent layer's initial state; a dict
    {"input_ids": 0, "h0": 1} says the same. None: its first tensor input."""
    process_group: Any = None
    """The group global_norms gathers over (None: the world, or the monitor's group)."""
    gram: bool = False
    """Keep each covered layer's inputs and output gradients until the norms are read, for gram() and
    similarity() (per-sample gradient inner products; memory: what backward keeps for those layers)."""

    def constructor_arguments(self) -> dict[str, Any]:
        """The keywords of PerSampleGradNorms(model, ...) that make this config (what from_config passes)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __post_init__(self) -> None:
        who = "PerSampleGradNorms"
        if self.loss_reduction not in ("mean", "sum"):
            raise ValueError(f"{who}: loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}")
        _bool(self.strict, who, "strict")
        _bool(self.bookkeeping, who, "bookkeeping")
        _bool(self.gram, who, "gram")
        if self.gram and self.bookkeeping:
            raise ValueError(f"{who}: gram=True needs each layer's inputs and output gradients, which book-keeping "
                             "consumes in backward: turn one of them off")
        _set(self, batch_dim=check_int(self.batch_dim, who, "batch_dim", 0))
        if self.batch_inputs is not None:
            _set(self, batch_inputs=_batch_inputs(self.batch_inputs, who))

    def batch_input_dims(self) -> list[tuple[int | str, int]]:
        """Each named batch input with the dim that holds its samples (batch_dim unless given); [] when none is named."""
        return [entry if isinstance(entry, tuple) else (entry, self.batch_dim) for entry in self.batch_inputs or ()]


def _batch_inputs(given: Any, who: str) -> tuple:
    """batch_inputs checked: a tuple of argument names and positions, each alone or paired with its batch dim."""
    def index(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    entries = list(given.items()) if isinstance(given, dict) else given
    if isinstance(entries, (str, int)) or not all(
            isinstance(e, str) or index(e) or (isinstance(e, tuple) and len(e) == 2 and (isinstance(e[0], str)
                                               or index(e[0])) and index(e[1])) for e in entries):
        raise TypeError(f"{who}: batch_inputs must be a sequence of argument names and positions of the model's "
                        f"forward, each alone or paired with the dim that holds its samples, e.g. ('input_ids', "
                        f"('h0', 1)), or a dict {{name: dim}}; got {given!r}")
    if not entries:
        raise ValueError(f"{who}: batch_inputs names no input; leave it None for the first one")
    keys = [e[0] if isinstance(e, tuple) else e for e in entries]
    repeated = sorted({repr(k) for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"{who}: batch_inputs names {', '.join(repeated)} more than once")
    return tuple(entries)


@dataclass(frozen=True)
class MonitorConfig:
    """Options of GAPMonitor (see its docstring for what each means). `per_sample`: None for no
    per-sample gradient norms, else their options (its process_group defaults to the monitor's)."""

    schedule: Schedule = Schedule()
    """The monitored steps (an int is an interval: every that many steps from 0)."""
    params: bool = True
    """Statistics of the parameters (of the full tensors when sharded)."""
    grads: bool = True
    """Statistics of the gradients (of the full tensors when sharded)."""
    activations: bool = True
    """Per-instance statistics of every module's output, averaged over the global batch."""
    activation_grads: bool = True
    """Per-instance statistics of the gradient of every module's output."""
    per_sample: PerSampleConfig | None = None
    """Per-sample gradient norms and their options; None: none."""
    sinks: tuple[Sink, ...] = ()
    """Where each monitored step's metrics go (rank 0): gapmon sinks or callables fn(step, metrics)."""
    process_group: Any = None
    """The data-parallel group over which activations are averaged (None: the world)."""
    correction: int = 1
    """Bessel's correction of the variances (1, as torch.var)."""
    numerics: tuple[str, ...] = ()
    """Formats (gapmon.numerics.FORMATS) whose under/overflow shares, kurtosis and histograms to report."""
    numerics_alert: float | None = None
    """Warn when a tensor's unscaled under/overflow share in a format exceeds this fraction (needs numerics)."""
    block_formats: tuple[str, ...] = ()
    """Per-block formats (gapmon.stats.block_formats.BLOCK_FORMATS: "mxfp8_e4m3", "nvfp4", ...) whose casts to
    emulate on the parameters and gradients: underflow, saturation, SQNR, dynamic range (off: no cost)."""
    gns_ema: float = 0.95
    """Decay of the moving averages of |G|^2 and tr(Sigma) whose ratio is the gradient noise scale (per-sample norms)."""

    def constructor_arguments(self) -> dict[str, Any]:
        """The keywords of GAPMonitor(model, ...) that make this config (what from_config passes)."""
        return {"interval": self.schedule, "params": self.params, "grads": self.grads, "activations": self.activations,
                "activation_grads": self.activation_grads, "per_sample_grad_norms": self.per_sample or False,
                "sinks": self.sinks, "process_group": self.process_group, "correction": self.correction,
                "numerics": self.numerics, "numerics_alert": self.numerics_alert, "gns_ema": self.gns_ema,
                "block_formats": self.block_formats}

    def __post_init__(self) -> None:
        who = "GAPMonitor"
        _set(self, schedule=_schedule(self.schedule, who))
        for key in ("params", "grads", "activations", "activation_grads"):
            _bool(getattr(self, key), who, key)
        if self.per_sample is not None and not isinstance(self.per_sample, PerSampleConfig):
            raise TypeError(f"{who}: per_sample must be a gapmon.PerSampleConfig or None, got {self.per_sample!r}")
        if not (self.params or self.grads or self.activations or self.activation_grads or self.per_sample):
            raise ValueError(f"{who}: nothing to monitor; enable at least one of params, grads, activations, "
                             "activation_grads, per_sample_grad_norms")
        if isinstance(self.sinks, (str, bytes)) or not isinstance(self.sinks, Sequence):
            raise TypeError(f"{who}: sinks must be a list of sinks, got {self.sinks!r}")
        from .monitor.sinks import as_sink  # here, not at the top: the monitor package imports this module

        _set(self, sinks=tuple(as_sink(s) for s in self.sinks))
        try:
            correction = check_int(self.correction, who, "correction", 0)
        except (TypeError, ValueError):
            raise ValueError(f"{who}: correction must be a non-negative int (1: Bessel's correction), "
                             f"got {self.correction!r}") from None
        _set(self, correction=correction, numerics=check_formats(self.numerics),
             block_formats=check_block_formats(self.block_formats))
        alert = self.numerics_alert
        if alert is not None and (isinstance(alert, bool) or not isinstance(alert, (int, float)) or not 0 <= alert <= 1):
            raise ValueError(f"{who}: numerics_alert must be a share in [0, 1], got {alert!r}")
        if alert is not None and not self.numerics:
            raise ValueError(f"{who}: numerics_alert needs formats to watch: pass numerics=('bf16', ...) with it")
        ema = self.gns_ema
        if isinstance(ema, bool) or not isinstance(ema, (int, float)) or not 0 <= ema < 1:
            raise ValueError(f"{who}: gns_ema must be a decay in [0, 1), got {ema!r}")
        _set(self, gns_ema=float(ema))


MODES = ("shards", "full", "sampled")


@dataclass(frozen=True)
class DumpConfig:
    """Options of GradientDumper (see its docstring for what each means)."""

    schedule: Schedule = Schedule()
    """The dumped steps (GradientDumper's start_step, step_interval and end_step)."""
    mode: str = "shards"
    """"shards" (each rank its local shards), "full" (a distributed checkpoint) or "sampled" (rank 0, the
    first save_first_n elements along every dim)."""
    save_first_n: int | None = None
    """With mode="sampled": how many leading elements along every dim to keep."""
    async_write: bool = True
    """Write in a background thread from host copies (two staging sets at most)."""
    timeout: float = 600.0
    """Seconds rank 0 waits for the other ranks' files of a step before leaving it incomplete."""

    def constructor_arguments(self) -> dict[str, Any]:
        """The keywords of GradientDumper(model, save_dir, ...) that make this config (what from_config passes)."""
        return {"start_step": self.schedule.start, "step_interval": self.schedule.every, "end_step": self.schedule.end,
                "mode": self.mode, "save_first_n": self.save_first_n, "async_write": self.async_write,
                "timeout": self.timeout}

    def __post_init__(self) -> None:
        who = "GradientDumper"
        if not isinstance(self.schedule, Schedule):
            raise TypeError(f"{who}: schedule must be a gapmon.Schedule, got {self.schedule!r}")
        if self.mode not in MODES:
            raise ValueError(f"{who}: mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "sampled":
            if self.save_first_n is None:
                raise ValueError(f"{who}: mode='sampled' needs a positive int save_first_n, got None")
            try:
                _set(self, save_first_n=check_int(self.save_first_n, who, "save_first_n", 1))
            except TypeError as e:
                raise ValueError(str(e)) from None
        elif self.save_first_n is not None:
            raise ValueError(f"{who}: save_first_n only applies to mode='sampled'")
        _bool(self.async_write, who, "async_write")
        t = self.timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"{who}: timeout must be a positive number of seconds, got {t!r}")
        _set(self, timeout=float(t))


def dump_schedule(start_step: Any, step_interval: Any, end_step: Any) -> Schedule:
    """GradientDumper's start_step/step_interval/end_step as a Schedule, errors named as its arguments."""
    who = "GradientDumper"
    start = check_int(start_step, who, "start_step", 0)
    try:
        every = check_int(step_interval, who, "step_interval", 1)
    except ValueError:
        raise ValueError(f"{who}: step_interval must be positive, got {step_interval}") from None
    end = None if end_step is None else check_int(end_step, who, "end_step", 0)
    if end is not None and end < start:
        raise ValueError(f"{who}: end_step ({end}) is before start_step ({start})")
    return Schedule(every=every, start=start, end=end)


def per_sample_option(per_sample_grad_norms: bool | PerSampleConfig, bookkeeping: bool,
                      process_group: Any) -> PerSampleConfig | None:
    """GAPMonitor's per_sample_grad_norms (True, False or a PerSampleConfig) and bookkeeping keywords
    as its config's `per_sample`."""
    who = "GAPMonitor"
    _bool(bookkeeping, who, "bookkeeping")
    if isinstance(per_sample_grad_norms, PerSampleConfig):
        config = per_sample_grad_norms
        return dataclasses.replace(config, bookkeeping=True) if bookkeeping else config
    _bool(per_sample_grad_norms, who, "per_sample_grad_norms (or a gapmon.PerSampleConfig)")
    if bookkeeping and not per_sample_grad_norms:
        raise ValueError(f"{who}: bookkeeping=True is a way to compute per-sample gradient norms; "
                         "pass per_sample_grad_norms=True with it")
    return PerSampleConfig(bookkeeping=bookkeeping, process_group=process_group) if per_sample_grad_norms else None


def field_names(config_type: type) -> list[str]:
    """The fields of a config dataclass, nested configs as 'outer.inner' (what the tests enumerate)."""
    out = []
    nested = {"schedule": Schedule, "per_sample": PerSampleConfig}
    for f in dataclasses.fields(config_type):
        if f.name in nested:
            out += [f"{f.name}.{n}" for n in field_names(nested[f.name])]
        else:
            out.append(f.name)
    return out
