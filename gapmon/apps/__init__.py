"""Applications built on the gapmon library: the command line, the demo trainer, its example
model and the run report. The library (everything outside this package) never imports it."""
