"""A privacy sweep on disk: `privacy.json` (every case's numbers, the binary check, the
command and the machine's load) and its PNGs beside it."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from services.privacy.figures import auc_rounds_figure, image_grid, tradeoff_figure
from services.privacy.sweep import CaseResult

JSON_NAME = "privacy.json"
TABLE_NAME = "privacy_table.md"


def write_report(
    out: Path,
    results: Sequence[CaseResult],
    binary: CaseResult | None,
    context: Mapping[str, Any],
) -> list[Path]:
    """Write the JSON, the trade-off and AUC-per-round figures and one reconstruction grid per
    case into `out`; the paths written, the JSON first."""
    out.mkdir(parents=True, exist_ok=True)
    document = {
        **context,
        "binary": None if binary is None else binary.to_json(),
        "cases": [r.to_json() for r in results],
    }
    path = out / JSON_NAME
    path.write_text(json.dumps(document, indent=1, allow_nan=True) + "\n")
    table = out / TABLE_NAME
    table.write_text(markdown_table(document))
    written = [path, table]
    title = str(context.get("title", "privacy"))
    for figure in (
        tradeoff_figure(results, out / "privacy_tradeoff.png", title),
        auc_rounds_figure(
            [*results, *([binary] if binary else [])], out / "privacy_auc.png", title
        ),
    ):
        if figure is not None:
            written.append(figure)
    labelled = [(r.case.label, r) for r in results]
    if binary is not None:
        labelled.append((f"binary-{binary.case.label}", binary))
    for label, result in labelled:
        recon = result.reconstruction
        if recon is not None:
            name = f"privacy_recon_{label}.png"
            caption = (
                f"{label}: MSE {recon.mse:.4f}, PSNR {recon.psnr_db:.1f} dB, SSIM {recon.ssim:.2f}"
            )
            written.append(image_grid(recon.images, out / name, caption))
    return written


def markdown_table(document: Mapping[str, Any]) -> str:
    """A `privacy.json` document as one row per case (the binary check last): final accuracy,
    the last round's attack AUCs, reconstruction and dCor."""
    rows = [
        "| case | accuracy | norm AUC | cosine AUC | recon. MSE | PSNR dB | SSIM | dCor(x, z') |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cases = [(c["label"], c) for c in document["cases"]]
    if document.get("binary"):
        cases.append((f"binary-{document['binary']['label']}", document["binary"]))
    for label, case in cases:
        auc = case["label_auc"][-1] if case["label_auc"] else {}
        recon = case["reconstruction"] or {}
        cells = [
            label,
            f"{100 * case['accuracy'][-1]:.1f}%",
            _cell(auc.get("norm"), ".3f"),
            _cell(auc.get("cosine"), ".3f"),
            _cell(recon.get("mse"), ".4f"),
            _cell(recon.get("psnr_db"), ".1f"),
            _cell(recon.get("ssim"), ".2f"),
            _cell(case["dcor"], ".3f"),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)
