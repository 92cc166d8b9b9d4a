"""The context a model is served at: its trained context, or another the operator asks for.

Lowering is always possible: the model simply sees no more than that. Raising is possible only
where the model's RoPE was built to stretch: a ``rope_scaling`` entry in its config that
mlx-lm's ``initialize_rope`` (``mlx_lm/models/rope_utils.py``) applies at every length, with
a ``factor`` over ``original_max_position_embeddings`` positions (Hugging Face's convention;
a config without that key was trained at ``max_position_embeddings``):

- ``linear`` (position interpolation), ``dynamic`` (NTK, the base grows past the trained
  length), ``llama3``, ``yarn`` (and DeepSeek's and TeleChat's variants): up to
  ``factor x original``; a config whose ``max_position_embeddings`` is already larger
  (Llama 3.1: 131072 over 8192 x 8) reaches that;
- ``longrope``: its ``max_position_embeddings`` is already the stretched length;
- plain RoPE (no scaling, ``default``, ``mrope``, ``proportional``): the trained context.

Positions past what the rotary frequencies were scaled for are out of distribution: a model
asked to attend there produces text that degrades without any error, which is why raising
is refused rather than warned about.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

STRETCHING = ("linear", "dynamic", "llama3", "yarn", "deepseek_yarn", "telechat3-yarn", "longrope")


class ContextLengthSettingError(ValueError):
    """A requested context the model cannot be served at (a configuration error)."""


@dataclass(frozen=True)
class ContextLimits:
    """What a model's config allows: its trained context and the longest its RoPE reaches."""

    trained: int  # max_position_embeddings (or what stands for it)
    longest: int  # the longest context its RoPE scaling was built for (trained when none)
    scaling: str | None  # the RoPE scaling that stretches it, described; None: plain RoPE

    def served(self, requested: int | None, *, model: str) -> int:
        """The context to serve: ``requested`` when the model allows it, else the trained one.

        Raises :class:`ContextLengthSettingError` naming the model's context and why."""
        if requested is None:
            return self.trained
        if requested < 1:
            raise ContextLengthSettingError(f"--context-length must be at least 1, not {requested}")
        if requested <= self.longest:
            return requested
        if self.scaling is None:
            raise ContextLengthSettingError(
                f"--context-length {requested} exceeds {model}'s context of {self.trained} tokens, "
                "and its RoPE has no scaling (no rope_scaling of a stretching type in its config) "
                f"that would reach further: positions past {self.trained} were never trained and "
                f"would silently degrade its output. At most {self.trained}."
            )
        raise ContextLengthSettingError(
            f"--context-length {requested} exceeds what {model}'s RoPE reaches: its context is "
            f"{self.trained} tokens and its {self.scaling} extends it to {self.longest}. "
            f"At most {self.longest}."
        )


def context_limits(config: Mapping[str, Any], trained: int) -> ContextLimits:
    """The limits of a model whose config is ``config`` and whose trained context (as the
    loader reads it: the config's or the tokenizer's) is ``trained``."""
    scaling = config.get("rope_scaling")
    if not isinstance(scaling, Mapping):
        return ContextLimits(trained, trained, None)
    kind = str(scaling.get("type") or scaling.get("rope_type") or "default")
    if kind not in STRETCHING:
        return ContextLimits(trained, trained, None)
    if kind == "longrope":  # max_position_embeddings is already the stretched length
        return ContextLimits(trained, trained, "longrope scaling")
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 1:
        return ContextLimits(trained, trained, None)
    original = scaling.get("original_max_position_embeddings")
    base = int(original) if isinstance(original, (int, float)) and original > 0 else trained
    longest = max(trained, int(factor * base))
    return ContextLimits(trained, longest,
                         f"{kind} RoPE scaling (factor {factor:g} over {base} original positions)")
