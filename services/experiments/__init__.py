"""Reproducible experiments: `splitmq experiment NAME` runs a grid of jobs and writes its
section of `docs/results.md` (tables, PNG plots under `docs/results/`, the command, the
machine, the wall time of every run and the paper's claim beside our numbers).

Modules: `spec` (what an experiment declares), `runner` (runs each job in this process: the
embedded service for `kind="service"`, `centralized` for the in-process baseline; every run
writes an ordinary report directory under `runs/experiments/<name>/<label>/` and its metrics
are read back from there), `results` (selection by tags), `tables`, `figures`, `document`
(the markdown section), `registry` (name → experiment), one module per experiment.

Adding an experiment
--------------------
1. A base config, `examples/experiments/<name>.toml`: an ordinary job file (`splitmq run`
   can run it alone), already scaled to the time budget (about 15 minutes for the whole grid
   on 2 CPU cores) and with the full dataset's name (`data.dataset`); never a data path:
   `--data-dir` or `$SPLITMQ_DATA_DIR` supply it.
2. A module `services/experiments/<name>.py` with `NAME` and `build() -> Experiment`:
   - `runs`: a list of `Run(label, tags, overrides, kind)`. `overrides` is a nested dict
     merged over the base config (e.g. `{"algorithm": {"name": "splitgp"},
     "data": {"ratio": 0.8}}`); `tags` name the run's coordinates (`{"algorithm": "SplitGP",
     "p": "0.2"}`). Leave a tag out when the run does not depend on it: a run without a `cut`
     tag fills every cut's cell and plot (baselines run once). `kind="centralized"` trains
     the model in-process on the union of the clients' data with the same step budget.
   - `quick_runs` and `quick`: a smoke-size grid and the overrides (few rounds and steps,
     small `eval_samples`) that `--quick` uses; the integration test runs it end to end.
   - `tables`: `Table(title, rows=(tags...), column=tag, metric=..., diffs=((a, b), ...))`:
     one row per combination of the row tags, one column per value of `column`, plus
     `a − b` columns in points. Metrics: `final_global`, `best_global`, `final_personal`,
     `best_personal` (from the run's `VersionRecord`s).
   - `plots`: `CurvePlot(file, title, lines=tag, panels=tag, where={...}, metric=field)` for
     a `VersionRecord` field against the round (e.g. `personal_accuracy`), or
     `FinalPlot(file, title, x=tag, lines=tag, panels=tag)` for a run summary against a tag.
   - `claim`, `scaling`, `summary`, `notes` (markdown), and `verdict(results) -> [sentence]`:
     plain sentences computed from the numbers saying where they agree with the paper and
     where not (`ResultSet.value(metric, **tags)` looks a number up).
   Metrics an algorithm reports beyond the standard ones (`VersionRecord.extra`) are in each
   run's `records`; a verdict or a custom table can read them from there.
   - `final_eval(settings, dataset, blobs) -> {name: value}` (optional): evaluates a service
     run's last version once the job has ended (`final`: the embedded store is kept for it),
     e.g. every client's model, not only the last cohort's (`client_eval`); kept in the run
     directory's `final.json` and read back as `RunResult.final`.
   - `extras(results, slot) -> [markdown]` (optional): the experiment's own tables and
     figures (drawn into `slot.path(name)`, linked with `slot.link(path)`; `figures.
     panel_figure` draws one row of panels), placed after the `tables`.
   - `stall_s` (optional): a run that publishes no version for this long is stopped and
     reported as such (`watchdog`); set it when a run can diverge, since a diverged sync job
     reopens its round for ever once every client refuses to send NaN.
3. Its name in `registry._NAMES` (the module is imported when the experiment is built).

Then `splitmq experiment <name> --quick --out /tmp/r.md` for a smoke run, and
`splitmq experiment <name>` for the real one (`--reuse` skips runs already finished with the
same settings, so an interrupted experiment resumes).
"""
