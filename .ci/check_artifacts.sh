#!/usr/bin/env bash
# The package as users get it: build the sdist (what `pip install gapmon` fetches), build a wheel from it with pip
# (what `pip install gapmon-*.tar.gz` does before it installs), then install that wheel, non-editable, into a fresh
# venv; from a directory outside the checkout, import gapmon, run a monitored step with the compiled backend and a
# short `gapmon demo`. (Installing the sdist itself would compile the same wheel again: ~3 minutes here.)
# A module, header, data file or entry point missing from either artifact fails here.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export MAX_JOBS=${MAX_JOBS:-2}

python -m venv "$work/build-env"
"$work/build-env/bin/pip" install -q "torch==2.13.0" build setuptools wheel
(cd "$root" && "$work/build-env/bin/python" -m build --sdist --outdir "$work/dist" . >/dev/null)
sdist=$(ls "$work"/dist/gapmon-*.tar.gz)
tar tzf "$sdist" > "$work/sdist-files"
echo "sdist: $(basename "$sdist") ($(wc -l < "$work/sdist-files") files)"
# The sdist holds every source the build compiles (setup.py's globs) and every header they include.
for f in $(cd "$root" && git ls-files csrc CMakeLists.txt MANIFEST.in setup.py pyproject.toml gapmon_launcher.py); do
  grep -qx "gapmon-[0-9.]*/$f" "$work/sdist-files" || { echo "sdist lacks $f"; exit 1; }
done
"$work/build-env/bin/pip" wheel -q --no-build-isolation --no-deps -w "$work/wheel" "$sdist"
wheel=$(ls "$work"/wheel/gapmon-*.whl)
echo "wheel: $(basename "$wheel")"

smoke() {  # $1: venv, run from a directory outside the checkout
  (cd "$work" && "$1/bin/python" - <<'PY'
import pathlib, sys
import torch, gapmon
assert "site-packages" in gapmon.__file__, gapmon.__file__
assert gapmon.backend() == "cpu", gapmon.backend()  # the compiled extension, not the pure-PyTorch fallback
for sub in ("gapmon.per_sample", "gapmon.per_sample.rules", "gapmon.apps.cli", "gapmon.integrations"):
    __import__(sub)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
mon = gapmon.GAPMonitor(model, per_sample_grad_norms=True)
x = torch.randn(5, 4, dtype=torch.float64); model.double()
mon.begin_step(0, batch_size=5)
model(x).pow(2).sum().backward()
metrics = mon.end_step()
ref = model[0].weight.grad.double().norm().item()
assert abs(metrics["gap/grads/0.weight/norm"] - ref) <= 1e-9 * ref, (metrics["gap/grads/0.weight/norm"], ref)
print(f"monitored step ok: {len(metrics)} metrics, from {pathlib.Path(gapmon.__file__).parent}")
PY
  )
  (cd "$work" && "$1/bin/gapmon" demo --steps 3 --out "$work/demo-$(basename "$1")" --quiet)
  test -s "$work/demo-$(basename "$1")/summary.json"
}

venv="$work/venv-wheel"
python -m venv "$venv"
"$venv/bin/pip" install -q "torch==2.13.0"
"$venv/bin/pip" install -q "${wheel}[report]"  # a wheel: nothing to build
smoke "$venv"
echo "installed from $(basename "$wheel"), built from $(basename "$sdist"): ok"
