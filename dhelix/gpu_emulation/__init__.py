"""An emulated GPU for CPU ranks: every compute kernel takes the time a GPU profile gives it,
spent sleeping (no core held), while collectives move their real bytes.

- `kernel_model`: per kernel class a roofline fitted to a `dhelix-profile` file (pure).
- `aten_costs`: which model term an aten operator is charged to, from its arguments (pure).
- `mode`: the `TorchDispatchMode` that runs a program with fake outputs and modelled time.

See docs/gpu_emulation.md.
"""
