"""Images in: from a request's content parts (or offline multi_modal_data) to prompt token
ids with their images' placeholders expanded, plus a per-request payload (the processed
pixels, each image's placeholder span and content hash). Host only: no jax.

The settings (--limit-mm-per-prompt, --allowed-local-media-path, --mm-processor-kwargs,
fetch limits) are config/media.py's MediaConfig; media.py: a URL to a checked
PIL image; chat_parts.py: image parts out of chat messages; front.py: the checkpoint's
image processor and placeholder expansion, and the one check that refuses images until
the engine serves them.
"""
