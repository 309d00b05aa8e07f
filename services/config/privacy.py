"""`[privacy]`: the client-side defences on smashed data (docs/privacy.md "Defences").

Validated here at load time; the values travel to clients among the algorithm's parameters
(`entries`), where `services.algorithms.defences` checks them again as it builds them (a
client does not trust a malformed config map).
"""

from __future__ import annotations

from pydantic import Field

from services.config.settings import _Section

# `services.algorithms.defences.KEY_PREFIX`, which imports torch: the config must not.
KEY_PREFIX = "privacy."


class PrivacySection(_Section):
    """Off by default: no noise, no clipping, no NoPeek penalty."""

    # sigma of the Gaussian noise N(0, sigma^2 I) added to z (after the clip), in z's units.
    noise_scale: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    # C: each sample's z is scaled to an L2 norm of at most C before the noise; unset: none.
    clip_norm: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # alpha: the client's loss gains alpha * dCor(x, z') (NoPeek, Vepakomma et al. 2020).
    nopeek_weight: float = Field(default=0.0, ge=0, allow_inf_nan=False)

    @property
    def active(self) -> bool:
        return bool(self.noise_scale or self.clip_norm is not None or self.nopeek_weight)

    def entries(self, seed: int) -> dict[str, float | int]:
        """The settings as algorithm parameters (`privacy.<key>`), with the job's `seed` for
        the noise; none when every defence is off, so an undefended job's config is as it was."""
        if not self.active:
            return {}
        values = {k: v for k, v in self.model_dump().items() if v is not None}
        return {f"{KEY_PREFIX}{k}": v for k, v in {**values, "seed": seed}.items()}
