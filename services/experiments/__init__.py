"""Reproducible experiments: `splitmq experiment NAME` runs a grid of jobs and writes its
section of `docs/results.md` (tables, PNG plots under `docs/results/`, the command, the
machine, the wall time of every run and the paper's claim beside our numbers).

Modules: `spec` (what an experiment declares), `runner` (runs each job in this process: the
embedded service for `kind="service"`, `centralized` for the in-process baseline; every run
writes an ordinary report directory under `runs/experiments/<name>/<label>/` and its metrics
are read back from there), `watchdog` (a run's stop event), `results` (selection by tags, the
summaries of a curve), `tables`, `figures`, `document` (the markdown section), `registry`
(the names), `client_eval` (every client's model), one module per experiment.

Adding an experiment
--------------------
1. A base config, `examples/experiments/<name>.toml`: an ordinary job file (`splitmq run`
   can run it alone), already scaled to the time budget (about 15 minutes for the whole grid
   on 2 CPU cores) and with the full dataset's name (`data.dataset`); never a data path:
   `--data-dir` or `$SPLITMQ_DATA_DIR` supply it. Beside it, its words,
   `examples/experiments/<name>.md`: a `# title`, then `## Summary` (what is compared and
   how), `## Paper's claim`, `## Scaling` (how the paper's setup was shrunk) and `## Notes`,
   markdown written into the section as they are.
2. A module `services/experiments/<name>.py` with `NAME` and `build() -> Experiment`
   (`from_examples(NAME, ...)` reads the base config and the words):
   - `runs`: a list of `Run(label, tags, overrides, kind)`. `overrides` is a nested dict
     merged over the base config (e.g. `algorithm("splitgp") | {"data": {"ratio": 0.8}}`);
     `tags` name the run's coordinates (`{"algorithm": "SplitGP", "p": "0.2"}`). Leave a tag
     out when the run does not depend on it: a run without a `cut` tag fills every cut's cell
     and plot (baselines run once). `kind="centralized"` trains the model in-process on the
     union of the clients' data with the same step budget.
   - `quick_runs` and `quick`: a smoke-size grid and the overrides that `--quick` uses
     (`smoke()`: few rounds and steps, small `eval_samples`); the integration test runs it.
   - `tables` (`spec.Table`: one row per combination of row tags, one column per value of a
     tag, differences in points) and `plots` (`spec.CurvePlot`: a `VersionRecord` field
     against the round; `spec.FinalPlot`: a run summary against a tag).
   - `verdict(results) -> [sentence]`: plain sentences computed from the numbers saying
     where they agree with the paper and where not (`ResultSet.value(metric, **tags)` and
     `ResultSet.named(**tags)` look runs up; `RunResult.curve(name)` reads a record field or
     an algorithm's `extra` per round).
   - `final_eval(settings, dataset, blobs) -> {name: value}` (optional): evaluates a service
     run's last version once the job has ended (`final`: the embedded store is kept for it),
     e.g. every client's model, not only the last cohort's (`client_eval`); kept in the run
     directory's `final.json` and read back as `RunResult.final`.
   - `extras(results, slot) -> [markdown]` (optional): the experiment's own tables and
     figures (`slot.figure(name, title, panels, draw)` draws one row of panels and returns
     its link), placed after the `tables`.
   - `stall_s` (optional): a run that publishes no version for this long is stopped and
     reported as such (`watchdog`); set it when a run can diverge, since a diverged sync job
     reopens its round for ever once every client refuses to send NaN.
3. Its name in `registry.NAMES` (the module is imported when the experiment is built).

Then `splitmq experiment <name> --quick --out /tmp/r.md` for a smoke run, and
`splitmq experiment <name>` for the real one (`--reuse` skips runs already finished with the
same settings, so an interrupted experiment resumes).
"""
