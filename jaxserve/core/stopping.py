"""When a request stops on a token it was given (eos, stop ids, length)."""
from __future__ import annotations

from jaxserve.core.request import Request, RequestStatus


def check_stop(req: Request, tok: int, max_len: int) -> bool:
    """Whether `tok`, just appended, ends the request (setting its finished status and
    stop_reason). max_len: the scheduler's hard length limit (model length, pool size)."""
    sp = req.sampling_params
    n_out = len(req.output_token_ids)
    # The first min_tokens outputs may not stop the request (the sampler masks stop
    # tokens there, as vLLM does).
    if n_out > getattr(sp, "min_tokens", 0):
        if tok in req.eos_token_ids and not getattr(sp, "ignore_eos", False):
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = None
            return True
        stop_ids = getattr(sp, "stop_token_ids", None)
        if stop_ids and tok in stop_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = tok
            return True
    # The model length (and pool size) is a hard limit, even before min_tokens.
    max_tokens = sp.max_tokens
    if (max_tokens is not None and n_out >= max_tokens) or (
        len(req.all_token_ids) >= max_len
    ):
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
