"""PNG figures of a privacy sweep: the trade-off (accuracy against label leak and against
reconstruction quality, one line per cut, mode and defence as its strength grows), the label
attacks' AUC per round, and example reconstructions."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from services.privacy.sweep import Case, CaseResult
from services.report.plots import line_style, panel_figure, round_axis

DEFENCES = ("noise", "nopeek", "gradient_noise")


def defence_of(case: Case) -> tuple[str, float]:
    """The one defence a case varies and its strength (("none", 0.0) when undefended)."""
    active = [(name, float(getattr(case, name))) for name in DEFENCES if getattr(case, name)]
    return active[0] if len(active) == 1 else ("none", 0.0) if not active else ("mixed", 0.0)


def _series(results: Sequence[CaseResult]) -> dict[str, list[CaseResult]]:
    """Per (cut, mode, defence): its cases by strength, starting at the undefended case."""
    lines: dict[str, list[CaseResult]] = {}
    for kind in DEFENCES:
        for result in results:
            name, _ = defence_of(result.case)
            if name not in (kind, "none"):
                continue
            mode = "U-shaped" if result.case.ushaped else "plain"
            lines.setdefault(f"{result.case.cut} {mode}, {kind}", []).append(result)
    return {
        key: sorted(cases, key=lambda r: defence_of(r.case)[1])
        for key, cases in lines.items()
        if any(defence_of(r.case)[0] != "none" for r in cases)
    }


def _final_auc(result: CaseResult, attack: str) -> float:
    return result.label_auc[-1][attack] if result.label_auc else float("nan")


def tradeoff_figure(results: Sequence[CaseResult], path: Path, title: str) -> Path | None:
    """Accuracy (x) against the cosine attack's last-round AUC, and against reconstruction
    PSNR; each line is one defence growing from the undefended point, labelled by strength."""
    lines = _series(results)

    def draw(axes: Any, panel: str) -> bool:
        drawn = False
        for i, (key, cases) in enumerate(lines.items()):
            if panel == "label" and not cases[0].case.ushaped:
                continue  # in plain split the server holds the labels: nothing to attack
            xs = [100.0 * r.accuracy[-1] for r in cases]
            if panel == "label":
                ys = [_final_auc(r, "cosine") for r in cases]
            else:
                ys = [r.reconstruction.psnr_db if r.reconstruction else float("nan") for r in cases]
            axes.plot(xs, ys, label=key, markersize=4, **line_style(i))
            for x, y, r in zip(xs, ys, cases, strict=True):
                axes.annotate(f"{defence_of(r.case)[1]:g}", (x, y), fontsize=6)
            drawn = True
        axes.set_xlabel("test accuracy (%)")
        axes.set_ylabel("cosine attack AUC" if panel == "label" else "reconstruction PSNR (dB)")
        return drawn

    return panel_figure(
        path,
        title,
        ["label", "reconstruction"],
        draw,
        titles=["label leak (U-shaped)", "input reconstruction"],
    )


def auc_rounds_figure(results: Sequence[CaseResult], path: Path, title: str) -> Path | None:
    """Each U-shaped case's norm and cosine attack AUC per round."""
    shown = [r for r in results if r.label_auc]

    def draw(axes: Any, attack: str) -> bool:
        for i, result in enumerate(shown):
            rounds = range(1, len(result.label_auc) + 1)
            ys = [auc[attack] for auc in result.label_auc]
            axes.plot(rounds, ys, label=result.case.label, markersize=3, **line_style(i))
        round_axis(axes)
        axes.set_ylim(0.0, 1.05)
        axes.set_ylabel("AUC")
        return bool(shown)

    return panel_figure(
        path, title, ["norm", "cosine"], draw, titles=["norm attack", "cosine attack"]
    )


def image_grid(images: Tensor, path: Path, title: str) -> Path:
    """Originals (top row) over their reconstructions (bottom row), from [2k, C, H, W] on [0, 1]."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shown = images.shape[0] // 2
    figure = Figure(figsize=(1.1 * shown, 2.6), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, shown, squeeze=False)
    for k, image in enumerate(images):
        ax = axes[k // shown][k % shown]
        pixels = image.permute(1, 2, 0).numpy()
        if pixels.shape[2] == 1:
            ax.imshow(pixels[:, :, 0], cmap="gray", vmin=0.0, vmax=1.0)
        else:
            ax.imshow(pixels)
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0][0].set_ylabel("private")
    axes[1][0].set_ylabel("decoded")
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path
