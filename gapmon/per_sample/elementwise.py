"""Slopes of elementwise functions, for a model's own parameter passed through one before its use (Swin V2's
`torch.clamp(self.logit_scale, max=math.log(100)).exp()`, a learned temperature's `exp()`, a gate's `sigmoid()`).

y = f(x) element by element: each sample's gradient of x is its gradient of y times f'(x) (the chain rule, exact),
with f'(x) formed once in the forward pass from x and y, as autograd's own backward formula forms it. Only functions
whose arguments beside x are numbers, and products and quotients with a tensor no sample's gradient flows into (DoRA's
`magnitude / weight_norm.detach()`); anything else has no slope here and stays a use the batch tracking reports."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


def _clamp_slope(x: torch.Tensor, low: Any, high: Any) -> torch.Tensor | None:
    """1 where low <= x <= high (bounds included, as torch's clamp backward), 0 elsewhere; None: a bound that is not a
    number."""
    if not all(b is None or type(b) in (int, float) for b in (low, high)):
        return None
    keep = torch.ones_like(x, dtype=torch.bool)
    if low is not None:
        keep &= x >= low
    if high is not None:
        keep &= x <= high
    return keep.to(x.dtype)


def _power_slope(x: torch.Tensor, exponent: Any = None) -> torch.Tensor | None:
    if type(exponent) not in (int, float):
        return None
    return torch.zeros_like(x) if exponent == 0 else exponent * x.pow(exponent - 1)


def _softplus_slope(x: torch.Tensor, beta: Any = 1.0, threshold: Any = 20.0) -> torch.Tensor | None:
    """sigmoid(beta x), or 1 where beta x > threshold (softplus is x there)."""
    if type(beta) not in (int, float) or type(threshold) not in (int, float):
        return None
    return torch.where(x * beta > threshold, torch.ones_like(x), torch.sigmoid(x * beta))


def _over_slope(x: torch.Tensor, other: Any) -> torch.Tensor | None:
    """d(other / x)/dx = -other / x², other a number."""
    return -other / (x * x) if type(other) in (int, float) else None


# f'(x) from x and y = f(x), for the functions of one tensor
_OF_ONE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "exp": lambda x, y: y,
    "expm1": lambda x, y: y + 1,
    "log": lambda x, y: x.reciprocal(),
    "log1p": lambda x, y: (x + 1).reciprocal(),
    "sigmoid": lambda x, y: y * (1 - y),
    "tanh": lambda x, y: 1 - y * y,
    "sqrt": lambda x, y: 0.5 / y,
    "rsqrt": lambda x, y: -0.5 * y * y * y,
    "square": lambda x, y: 2 * x,
    "reciprocal": lambda x, y: -y * y,
    "relu": lambda x, y: (x > 0).to(x.dtype),
    "abs": lambda x, y: x.sign(),
}

# f'(x) from x and f's other arguments (numbers, positional in this order or by these names)
_WITH_NUMBERS: dict[str, tuple[tuple[str, ...], Callable[..., torch.Tensor | None]]] = {
    "clamp": (("min", "max"), lambda x, min=None, max=None: _clamp_slope(x, min, max)),
    "clip": (("min", "max"), lambda x, min=None, max=None: _clamp_slope(x, min, max)),
    "clamp_min": (("min",), lambda x, min: _clamp_slope(x, min, None)),
    "clamp_max": (("max",), lambda x, max: _clamp_slope(x, None, max)),
    "pow": (("exponent",), _power_slope),
    "__pow__": (("exponent",), _power_slope),
    "softplus": (("beta", "threshold"), _softplus_slope),
    "__rdiv__": (("other",), lambda x, other: _over_slope(x, other)),
    "__rtruediv__": (("other",), lambda x, other: _over_slope(x, other)),
}


# x times or over a tensor c that no sample's gradient flows into (the caller knows: no status in the batch tracking)
PRODUCTS = {"mul", "__mul__", "__rmul__", "multiply"}
QUOTIENTS = {"div", "__truediv__", "true_divide", "divide"}


def _factor_slope(name: str, args: Sequence, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
    """dy/dx for y = x * c, c * x, x / c or c / x, c a floating tensor that broadcasts to x's shape (DoRA's magnitude
    over its detached weight norm): c, 1 / c or -y / x, of x's shape; None for anything else."""
    if len(args) != 2 or x is not args[0] and x is not args[1] or not (name in PRODUCTS or name in QUOTIENTS):
        return None
    c = args[1] if args[0] is x else args[0]
    if not isinstance(c, torch.Tensor) or not c.is_floating_point() or c is x:
        return None
    if name in QUOTIENTS and args[1] is x:  # c / x: -c / x² = -y / x
        return -(y.detach() / x.detach())
    c = c.detach()
    return torch.broadcast_to(c.reciprocal() if name in QUOTIENTS else c, x.shape)


# The functions of one tensor whose slope their output alone gives (relu's by its sign): run in place, their input is
# gone, yet their slope is known (`nn.ReLU(inplace=True)`, `x.sigmoid_()`)
_FROM_OUTPUT = {"relu", "sigmoid", "tanh", "exp", "expm1", "sqrt", "rsqrt", "reciprocal"}


def in_place_slope(name: str, kwargs: dict, y: torch.Tensor) -> torch.Tensor | None:
    """f'(x) of y = f(x) computed in place (`name` its in-place or out-of-place name: `relu_`, or `relu` with
    inplace=True), from y alone; None for a function whose slope needs its input."""
    base = name[:-1] if name.endswith("_") else name
    if base not in _FROM_OUTPUT or set(kwargs) - {"inplace"} or not y.is_floating_point():
        return None
    y = y.detach()
    return _OF_ONE[base](y, y)


def slope(name: str, args: Sequence, kwargs: dict, x: torch.Tensor, y: Any) -> torch.Tensor | None:
    """f'(x) for y = name(x, *args[1:], **kwargs), an elementwise function of x (args[0]; either argument of a
    product) of y's shape, detached; None where `name` is no function listed here or its other arguments are not
    numbers (or, for a product or quotient, a tensor the batch does not flow into)."""
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or not x.is_floating_point() or not args:
        return None
    if len(args) == 2 and not kwargs and isinstance(args[1] if args[0] is x else args[0], torch.Tensor):
        return _factor_slope(name, args, x, y)
    if args[0] is not x:
        return None
    x, y = x.detach(), y.detach()
    if name in _OF_ONE:
        return _OF_ONE[name](x, y) if len(args) == 1 and not kwargs else None
    if name not in _WITH_NUMBERS:
        return None
    names, fn = _WITH_NUMBERS[name]
    extra = args[1:]
    if len(extra) > len(names) or set(kwargs) - set(names[len(extra):]):
        return None
    try:
        return fn(x, **dict(zip(names, extra)), **kwargs)
    except TypeError:  # a required number missing
        return None


def extremum_slope(name: str, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor | None:
    """d maximum(x, other) / dx (or minimum's), of the broadcast shape, as torch's backward forms it: 1 where x is kept,
    0 where `other` is, 1/2 on a tie (1 where either is NaN). None for any other op."""
    if name not in ("maximum", "minimum"):
        return None
    x, other = x.detach(), other.detach()
    loses = x < other if name == "maximum" else x > other
    half = torch.full((), 0.5, dtype=torch.promote_types(x.dtype, other.dtype), device=x.device)
    return torch.where(x == other, half, torch.ones_like(half)).masked_fill(loses, 0)
