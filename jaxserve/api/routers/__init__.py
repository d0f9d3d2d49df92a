"""The HTTP side of each endpoint family: its routes (paths, bodies, what /openapi.json
says), each one a call on the family's serving object (api/serving/), which create_app
puts on app.state and deps.py hands to the handlers.

probes.py       /health, /ping, /load, /metrics, /version     open (no --api-key)
admin.py        /v1/models, /reset_prefix_cache               behind --api-key
completions.py  /v1/completions                                behind --api-key
chat.py         /v1/chat/completions                           behind --api-key
tokenize.py     /tokenize, /detokenize; /tokenizer_info        behind --api-key
"""
