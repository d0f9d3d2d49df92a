"""Hand-built ModelInputs for model tests: requests packed into one ragged, padded step."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from models.inputs import ModelInputs


def make_inputs(seqs, *, page_size: int = 16, num_tokens: int = 96, num_rows: int = 4,
                pages_per_row: int = 8, state_slots=None) -> tuple[ModelInputs, list[tuple[int, int]]]:
    """seqs: list of (new_tokens, num_computed_tokens, pages). Returns the inputs and each
    request's [begin, end) token span. Padding tokens write to the null page 0.
    state_slots: hybrid models' recurrent-state slot per request (padding rows get 0)."""
    tok, pos, slot, qsl, lens = [], [], [], [0], []
    table = np.zeros((num_rows, pages_per_row), np.int32)
    spans = []
    for r, (new, start, pages) in enumerate(seqs):
        p = np.arange(start, start + len(new))
        pages = np.asarray(pages)
        tok.append(np.asarray(new))
        pos.append(p)
        slot.append(pages[p // page_size] * page_size + p % page_size)
        spans.append((qsl[-1], qsl[-1] + len(new)))
        qsl.append(qsl[-1] + len(new))
        lens.append(start + len(new))
        table[r, :len(pages)] = pages
    n = qsl[-1]
    if n > num_tokens or len(seqs) > num_rows:
        raise ValueError(f"{n} tokens / {len(seqs)} requests do not fit {num_tokens} / {num_rows}")

    def pad(parts):
        a = np.concatenate(parts).astype(np.int32)
        return jnp.asarray(np.concatenate([a, np.zeros(num_tokens - len(a), np.int32)]))

    qsl += [n] * (num_rows - len(seqs))
    lens += [0] * (num_rows - len(seqs))
    inputs = ModelInputs(token_ids=pad(tok), positions=pad(pos), slot_mapping=pad(slot),
                         query_start_loc=jnp.asarray(qsl, jnp.int32), seq_lens=jnp.asarray(lens, jnp.int32),
                         page_table=jnp.asarray(table), num_seqs=jnp.asarray([len(seqs)], jnp.int32),
                         state_slots=None if state_slots is None else jnp.asarray(
                             list(state_slots) + [0] * (num_rows - len(seqs)), jnp.int32))
    return inputs, spans
