"""/tokenize, /detokenize and /tokenizer_info: the model's tokenizer, as the server runs
it (a chat's messages through the same template and kwargs as /v1/chat/completions)."""
from __future__ import annotations

import asyncio

from jaxserve.api.chat_prompt import tokenize_request
from jaxserve.api.errors import APIError, bad_request
from jaxserve.api.protocol import DetokenizeRequest, TokenizeRequest
from jaxserve.api.serving.base import OpenAIServing
from jaxserve.api.tokenizer_info import tokenizer_info


class TokenizeServing:
    def __init__(self, base: OpenAIServing):
        self.base = base

    async def tokenize(self, req: TokenizeRequest) -> dict:
        base = self.base
        base.check_model(req.model)
        engine, settings = base.engine, base.settings
        try:
            ids = await asyncio.to_thread(tokenize_request, engine.inputs, req,
                                          chat_template=settings.chat_template,
                                          template_kwargs=base.template_kwargs(req))
        except ValueError as e:
            raise bad_request(e)
        out = {"count": len(ids), "max_model_len": settings.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
        return out

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self.base.check_model(req.model)
        engine = self.base.engine
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        vocab = engine.info.vocab_size
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                           "tokens")
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, req.tokens)}

    def tokenizer_info(self) -> dict:
        """The tokenizer's configuration (vLLM's shape), the chat template included."""
        engine, settings = self.base.engine, self.base.settings
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return tokenizer_info(engine.tokenizer, chat_template=settings.chat_template,
                              max_model_len=settings.max_model_len)
