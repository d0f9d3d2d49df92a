"""The serving layer: what each endpoint family does with a request, behind its router
(api/routers/).

base.py         OpenAIServing, the one object every family shares (app.state.serving):
                the settings, the engine client, the checks every request meets,
                admission against --max-waiting-requests, the merged engine stream
choices.py      a choice accumulated from delta outputs; usage
streaming.py    server-sent events (and the end of an admitted answer with them)
logprobs.py     OpenAI's logprobs shapes (completions, chat)
completions.py  /v1/completions
chat.py         /v1/chat/completions
tokenize.py     /tokenize, /detokenize, /tokenizer_info
admin.py        /health, /ping, /load, /metrics, /version, /v1/models, /reset_prefix_cache
"""
