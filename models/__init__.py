"""Split-able networks: a model as named blocks with cut points and auxiliary heads.

Pure PyTorch: no I/O, no training loops. `registry.build_model` gives a `split.SplitNet`;
`parts.ServerModel` runs its server side at a cut; the `state` helpers slice its state dict by
the full model's names, which every part of the system uses to line weights up. The built-in
models and their layers are in `zoo`.
"""
