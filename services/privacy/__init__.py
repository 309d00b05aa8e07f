"""Privacy as something measured: the attacks an honest-but-curious server can run on what a
split-learning client sends it, over in-process training loops of the job's model (no broker).

- `loop`: the job's model trained in plain split mode or U-shaped (client body, server middle,
  client tail), with the client-side defences applied where the service applies them;
- `labels`: label inference from the gradient the client's tail returns (Li et al.'s norm and
  cosine attacks) and the AUC that scores it;
- `inversion`: a decoder trained from smashed data back to images on public data;
- `sweep`: one run of all three per setting (and dCor between inputs and smashed data, with
  the service's own `distance_correlation`), with the setting's defences from
  `services.algorithms.defences`, and a grid of settings; `report` and `figures`: JSON,
  table, plots.
"""
