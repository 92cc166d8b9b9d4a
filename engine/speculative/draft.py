"""Drafts from a smaller model with the target's tokenizer (`--draft-model`).

Each drafting row keeps the draft model's own mlx-lm cache over the row's text. To draft,
the cache is brought to the text as it is now (trimmed back to what the two share: the
drafts the target rejected leave it; then the new tokens are fed), and the draft model
decodes `k` tokens greedily. Greedy drafts are a deterministic proposal, so the runner's
verification (the target samples each position and keeps the drafts up to the first it
disagrees with, `engine.speculative.verify`) stays exact for sampling as for greedy.

The draft's caches are plain mlx-lm caches, outside the paged store: they must be
trimmable (mlx-lm's KVCache: plain attention), which `DraftModel.check` asks at load. Their
bytes are on the device, where the guard's probe reads them; `cache_bytes` reports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

PREFILL_CHUNK = 512  # the draft's own prefill of a row's prompt, in pieces of this many tokens


class DraftModelError(ValueError):
    """The draft model cannot draft for this target (tokenizer or cache kind)."""


@dataclass
class _Row:
    cache: list[Any]
    tokens: list[int] = field(default_factory=list)  # the text the cache holds


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModel:
    def __init__(self, model: Any, model_id: str, *, weight_bytes: int = 0) -> None:
        self.model = model
        self.model_id = model_id
        self.weight_bytes = weight_bytes
        self._rows: dict[str, _Row] = {}
        self.fed_tokens = 0  # tokens the draft model ran, drafts and catch-up together

    @staticmethod
    def check(model: Any, draft_vocab: dict[str, int], target_vocab: dict[str, int]) -> None:
        """Refuse a draft whose tokens mean something else to the target, or whose caches
        cannot be trimmed back after a rejected draft."""
        differ = [t for t, i in draft_vocab.items() if target_vocab.get(t) != i]
        if differ:
            raise DraftModelError(
                f"the draft model's tokenizer differs from the target's in {len(differ)} of "
                f"{len(draft_vocab)} tokens (e.g. {differ[:3]!r}): drafts must be the target's token ids")
        from mlx_lm.models.cache import make_prompt_cache  # mlx-lm loads transformers: at use

        kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)})
        if kinds != ["KVCache"]:
            raise DraftModelError(f"the draft model's caches ({', '.join(kinds)}) cannot be trimmed "
                                  "back after a rejected draft: a draft model needs plain attention")

    def propose(self, request_id: str, text: list[int], k: int) -> tuple[int, ...]:
        """`k` greedy tokens to follow `text` (the row's prompt, outputs and next input)."""
        from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

        if k <= 0 or not text:
            return ()
        row = self._rows.get(request_id)
        if row is None:
            row = self._rows[request_id] = _Row(make_prompt_cache(self.model))
        keep = min(_shared_prefix(row.tokens, text), len(text) - 1)  # the last token is fed for its logits
        if keep < len(row.tokens):
            trim_prompt_cache(row.cache, len(row.tokens) - keep)
            del row.tokens[keep:]
        feed = text[keep:]
        for start in range(0, len(feed) - 1, PREFILL_CHUNK):  # all but the last: no logits needed
            piece = feed[start : min(start + PREFILL_CHUNK, len(feed) - 1)]
            self.model(mx.array(piece)[None], cache=row.cache)
            mx.eval([c.keys for c in row.cache], [c.values for c in row.cache])
        drafts: list[int] = []
        token = feed[-1]
        for _ in range(k):
            logits = self.model(mx.array([token])[None], cache=row.cache)[:, -1, :]
            token = int(mx.argmax(logits, axis=-1).item())
            drafts.append(token)
        self.fed_tokens += len(feed) + k - 1
        row.tokens.extend(feed)
        row.tokens.extend(drafts[:-1])  # the last draft was never fed
        return tuple(drafts)

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def cache_bytes(self) -> int:
        return sum(c.nbytes for row in self._rows.values() for c in row.cache)


def load_draft(source: str, target: Any, *, dtype: str | None = None) -> DraftModel:
    """Load `source` (a path, hub id or named model) as `target`'s draft (a LoadedModel),
    refused with the reason when it cannot draft for it."""
    from engine.loader import load_model

    draft = load_model(source, dtype=dtype, fuse_projections=False)
    DraftModel.check(draft.model, draft.tokenizer.get_vocab(), target.tokenizer.get_vocab())
    return DraftModel(draft.model, draft.model_id, weight_bytes=draft.weight_bytes)
